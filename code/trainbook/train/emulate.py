"""Low-precision matmuls emulated in fp32: FP8 training's numerics (and bf16's, fp16's) on any CPU.

An FP8 linear layer on a Hopper GPU quantises its two operands to FP8 with scales, multiplies them
on tensor cores with fp32 accumulation (`torch._scaled_mm`) and writes the result in bf16. Every
step of that is a rounding we can do in fp32: quantise and dequantise each operand (fake
quantisation, exact: `trainbook.formats`), multiply in fp32, multiply the scales in, round the
output to bf16. The operands are exactly the FP8 values and scales `torch._scaled_mm` takes, and
the products agree with its output up to the order of the fp32 sums (tests/test_emulate.py), at
fp32 matmul speed on any CPU.

`Recipe` says how each operand is scaled; `EmulatedLinear` applies it to the three matmuls of a
linear layer (forward y = x W^T, backward dx = g W and dW = g^T x), each operand scaled along the
dimensions that are not summed over, as the real kernels need; `convert_linears` swaps the blocks'
linear layers of a model for it (the head and embeddings stay in higher precision). Recipes:

- bf16, fp16: what autocast does to a linear layer: operands rounded, no scaling, every output
  (y, dx and dW) written in the format (fp16 overflows to inf and underflows to zero).
- tensorwise: one scale per tensor from its current amax (E4M3 forward, E5M2 gradients).
- delayed: one scale per tensor from the amax of the previous `history` steps, as Transformer
  Engine's default; a value above the history's amax saturates.
- rowwise: one scale per row of the left operand and per column of the right (E4M3 throughout).
- blockwise: DeepSeek-V3's 1x128 tiles for activations and gradients, 128x128 blocks for weights.
- mxfp8: OCP MX, blocks of 32 along the summed dimension with power-of-two E8M0 scales.

Block recipes pad a ragged edge with zeros (which change no block's amax), so any layer shape
works. An operand whose quantised values do not depend on the summed dimension (one scale per
tensor, square weight blocks) is quantised once in the forward pass and reused, transposed, in
the backward pass, as the kernels keep their FP8 copies of x and W.

Chapter: book/precision/fp8.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .. import formats

RECIPES = ("bf16", "fp16", "tensorwise", "delayed", "rowwise", "blockwise", "mxfp8")
TILE = 128  # DeepSeek-V3's tile (activations, 1 x 128) and block (weights, 128 x 128)
EPS = 1e-12  # amax floor: an all-zero tensor gets a finite scale


@dataclass(frozen=True)
class Recipe:
    """How operands are rounded and scaled. `forward`/`backward`: the element format of the
    forward operands (x, W) and of the gradient; `output`: the format y and dx are written in;
    `wgrad`: the format of dW (fp32 for the FP8 recipes: the optimizer's gradient; autocast's
    bf16 and fp16 write it in their own format)."""

    name: str = "tensorwise"
    forward: str = "fp8_e4m3"
    backward: str = "fp8_e5m2"
    output: str = "bf16"
    history: int = 16  # delayed scaling: steps of amax kept
    wgrad: str = "fp32"

    def __post_init__(self):
        if self.name not in RECIPES:
            raise ValueError(f"unknown recipe {self.name!r}; choose one of {', '.join(RECIPES)}")
        for f in (self.forward, self.backward, self.output, self.wgrad):
            formats.get(f)
        if self.history < 1:
            raise ValueError(f"history must be >= 1 step, got {self.history}")
        if self.name == "mxfp8":
            for f in (self.forward, self.backward):
                mx_format(f)

    @property
    def scaled(self) -> bool:
        return self.name not in ("bf16", "fp16")


def recipe(name: str) -> Recipe:
    """The recipe as usually configured: bf16/fp16 as autocast runs a linear layer (operands and
    outputs in the format), the tensor-level FP8 recipes hybrid (E4M3 forward, E5M2 gradients),
    the fine-grained ones E4M3 throughout."""
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; choose one of {', '.join(RECIPES)}")
    if name in ("bf16", "fp16"):
        return Recipe(name, name, name, name, wgrad=name)
    if name in ("rowwise", "blockwise", "mxfp8"):
        return Recipe(name, backward="fp8_e4m3")
    return Recipe(name)


def mx_format(fmt: str) -> formats.BlockFormat:
    """The OCP MX block format (E8M0 scales, blocks of 32) whose elements are `fmt`."""
    name = formats.get(fmt).name
    for b in formats.BLOCK_FORMATS.values():
        if b.element == name and b.scale == "e8m0":
            return b
    have = ", ".join(b.element for b in formats.BLOCK_FORMATS.values() if b.scale == "e8m0")
    raise ValueError(f"no MX block format has {name} elements; use one of {have}")


def _cast(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Round to `fmt`, saturating (the scaled FP8 conversion) except for unscaled fp16/bf16,
    which overflow to inf as their casts do. torch's cast where it has the dtype (faster)."""
    f = formats.get(fmt)
    if f.name == "fp32":
        return x
    if f.torch_dtype:
        if f.name not in ("fp16", "bf16"):
            x = x.clamp(-f.max, f.max)
        return x.to(getattr(torch, f.torch_dtype)).to(x.dtype)
    return formats.quantize(x, f, overflow="saturate")


def _tiles(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """(R, C) -> (R/rows, C/cols, rows, cols) view of tiles (the shape must divide)."""
    R, C = x.shape
    return x.reshape(R // rows, rows, C // cols, cols).transpose(1, 2)


def quantize_operand(x: torch.Tensor, rcp: Recipe, fmt: str, contract: int, is_weight: bool,
                     amax: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x (2-D) as the kernel holds it: (values, inverse scale) or, for the block recipes, whose
    scales vary along the summed dimension, the dequantised values and None.

    `contract` is the dimension the matmul sums over. Tensor and row scales vary only along the
    other one, so the kernel multiplies them in after the sum, as `torch._scaled_mm` does; block
    scales are applied per block. `amax` overrides the tensor's own amax (delayed scaling)."""
    if not rcp.scaled:
        return _cast(x, fmt), None
    top = formats.get(fmt).max
    if rcp.name in ("tensorwise", "delayed", "rowwise"):
        if rcp.name == "rowwise":
            a = x.detach().abs().amax(dim=contract, keepdim=True)
        else:
            a = x.detach().abs().amax() if amax is None else amax
        scale = top / a.float().clamp(min=EPS)
        return _cast(x * scale, fmt), 1.0 / scale
    xt = x if contract == 1 else x.t()  # the summed dimension last
    block = mx_format(fmt).block if rcp.name == "mxfp8" else TILE
    rows = TILE if rcp.name == "blockwise" and is_weight else 1
    pad = -xt.shape[1] % block  # zeros change no block's amax
    pad_rows = -xt.shape[0] % rows
    xp = torch.nn.functional.pad(xt, (0, pad, 0, pad_rows)) if pad or pad_rows else xt
    if rcp.name == "mxfp8":  # = formats.block_quantize, with torch's fast fp8 cast
        scales = formats.block_scales(xp, mx_format(fmt))
        scales = scales.to(xp.dtype)[..., None]  # powers of two: exact in fp32
        t = xp.reshape(xp.shape[0], -1, block)
        out = (_cast(t / scales, fmt) * scales).reshape(xp.shape)
    else:  # blockwise: 1 x 128 tiles (activations, gradients), 128 x 128 blocks (weights)
        t = _tiles(xp, rows, TILE)
        scale = top / t.detach().abs().amax(dim=(-2, -1), keepdim=True).clamp(min=EPS)
        out = (_cast(t * scale, fmt) * (1.0 / scale)).transpose(1, 2).reshape(xp.shape)
    out = out[:xt.shape[0], :xt.shape[1]]
    return (out if contract == 1 else out.t()), None


def scaled_matmul(a: tuple[torch.Tensor, torch.Tensor | None],
                  b: tuple[torch.Tensor, torch.Tensor | None], out: str) -> torch.Tensor:
    """a @ b of two quantised operands (values, inverse scale), summed in fp32, the scales
    multiplied in afterwards (a's per row, b's per column), rounded to `out`."""
    (qa, ia), (qb, ib) = a, b
    y = qa @ qb
    if ia is not None:
        y = y * (ia * ib)  # ia: scalar or (M, 1); ib: scalar or (1, N)
    return _cast(y, out)


def fake_quantize(x: torch.Tensor, rcp: Recipe, fmt: str, contract: int = 1,
                  is_weight: bool = False) -> torch.Tensor:
    """The values a kernel multiplies, dequantised: what quantisation does to x."""
    q, inv = quantize_operand(x, rcp, fmt, contract, is_weight)
    return q if inv is None else q * inv


def same_both_ways(rcp: Recipe, is_weight: bool) -> bool:
    """Whether an operand quantises to the same values whichever dimension a matmul sums over:
    true for one scale per tensor (or none), and for square blocks (blockwise weights), so a
    kernel quantises it once and uses it, transposed, in the backward pass too."""
    return rcp.name in ("bf16", "fp16", "tensorwise", "delayed") or \
        (rcp.name == "blockwise" and is_weight)


class _Matmuls(torch.autograd.Function):
    """y = q(x) q(W)^T; dx = q(g) q(W); dW = q(g)^T q(x): each operand quantised along its own
    non-summed dimension (once, when that gives the same values both ways, as the kernels keep
    the forward's FP8 copies of x and W for the backward); y and dx rounded to the recipe's
    output format, dW to its wgrad format."""

    @staticmethod
    def forward(ctx, x, w, layer):
        rcp = layer.recipe
        xq = quantize_operand(x, rcp, rcp.forward, 1, False, layer.amax("x", x))
        wq = quantize_operand(w, rcp, rcp.forward, 1, True, layer.amax("w", w))
        ctx.save_for_backward(x, w, *xq, *wq)
        ctx.layer = layer
        return scaled_matmul(xq, transpose(wq), rcp.output)

    @staticmethod
    def backward(ctx, g):
        x, w, xv, xi, wv, wi = ctx.saved_tensors
        layer, rcp = ctx.layer, ctx.layer.recipe
        g = g.contiguous()
        amax_g = layer.amax("g", g)
        g1 = quantize_operand(g, rcp, rcp.backward, 1, False, amax_g)
        g0 = g1 if same_both_ways(rcp, False) else \
            quantize_operand(g, rcp, rcp.backward, 0, False, amax_g)
        w0 = (wv, wi) if same_both_ways(rcp, True) else \
            quantize_operand(w, rcp, rcp.forward, 0, True)
        x0 = (xv, xi) if same_both_ways(rcp, False) else \
            quantize_operand(x, rcp, rcp.forward, 0, False)
        dx = scaled_matmul(g1, w0, rcp.output)
        dw = scaled_matmul(transpose(g0), x0, rcp.wgrad)
        return dx, dw, None


def transpose(op: tuple[torch.Tensor, torch.Tensor | None]
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The transpose of a quantised operand: its row scales become column scales."""
    q, inv = op
    return q.t(), (None if inv is None else inv.t() if inv.dim() else inv)


class EmulatedLinear(nn.Module):
    """An nn.Linear whose matmuls run with a recipe's numerics. It holds the original layer's
    weight and bias (the same Parameters: an optimizer built before or after sees them), and a
    delayed recipe's amax history as buffers (saved in checkpoints)."""

    def __init__(self, linear: nn.Linear, rcp: Recipe):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias, self.recipe = linear.weight, linear.bias, rcp
        if rcp.name == "delayed":
            self.register_buffer("amax_history", torch.zeros(3, rcp.history))

    def amax(self, role: str, t: torch.Tensor, update: bool = True) -> torch.Tensor | None:
        """Delayed scaling: the largest amax of the previous steps (this tensor's own amax on
        the first step), then this step's amax enters the history. None for other recipes."""
        if self.recipe.name != "delayed":
            return None
        row = self.amax_history["xwg".index(role)]
        now = t.detach().abs().amax().float()
        past = row.max()
        if update:
            row.copy_(torch.cat([now.reshape(1), row[:-1]]))
        return now if past == 0 else past

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = _Matmuls.apply(x.reshape(-1, shape[-1]).float(), self.weight.float(), self)
        y = y.reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, recipe={self.recipe.name}"


def convert_linears(model: nn.Module, rcp: Recipe | str,
                    skip: tuple[str, ...] = ("head", "router"),
                    include: tuple[str, ...] = ("blocks",)) -> list[str]:
    """Replace every nn.Linear whose name starts with an `include` part (default: the blocks)
    and has no `skip` part with an EmulatedLinear; returns the converted names. By default the
    embeddings, the final norm, the head and MoE routers stay as they are, as in DeepSeek-V3's
    FP8 recipe; `include=("blocks", "head"), skip=("router",)` converts the head too."""
    rcp = recipe(rcp) if isinstance(rcp, str) else rcp
    if not include:
        raise ValueError("include names no part of the model to convert; give e.g. ('blocks',)")
    done = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            parts = full.split(".")
            if type(child) is nn.Linear and parts[0] in include and \
                    not any(s in parts for s in skip):
                setattr(module, child_name, EmulatedLinear(child, rcp))
                done.append(full)
    return done
