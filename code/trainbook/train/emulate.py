"""Low-precision matmuls emulated in fp32: FP8 training's numerics (and bf16's, fp16's) on any CPU.

An FP8 linear layer on a Hopper GPU quantises its two operands to FP8 with scales, multiplies them
on tensor cores with fp32 accumulation (`torch._scaled_mm`) and writes the result in bf16. Every
step of that is a rounding we can do in fp32: quantise and dequantise each operand (fake
quantisation, exact: `trainbook.formats`), multiply in fp32, round the output to bf16. The result
equals `torch._scaled_mm`'s bf16 output bit for bit (tests/test_emulate.py; the fp32 sums differ
only in order), at fp32 matmul speed, where `_scaled_mm` on a CPU is a slow reference kernel.

`Recipe` says how each operand is scaled; `EmulatedLinear` applies it to the three matmuls of a
linear layer (forward y = x W^T, backward dx = g W and dW = g^T x), each operand scaled along the
dimensions that are not summed over, as the real kernels need; `convert_linears` swaps the blocks'
linear layers of a model for it (the head and embeddings stay in higher precision). Recipes:

- bf16, fp16: operands rounded, no scaling (fp16 overflows to inf, underflows to zero).
- tensorwise: one scale per tensor from its current amax (E4M3 forward, E5M2 gradients).
- delayed: one scale per tensor from the amax of the previous `history` steps, as Transformer
  Engine's default; a value above the history's amax saturates.
- rowwise: one scale per row of the left operand and per column of the right (E4M3 throughout).
- blockwise: DeepSeek-V3's 1x128 tiles for activations and gradients, 128x128 blocks for weights.
- mxfp8: OCP MX, blocks of 32 along the summed dimension with power-of-two E8M0 scales.

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
    forward operands (x, W) and of the gradient; `output`: the format the matmul writes."""

    name: str = "tensorwise"
    forward: str = "fp8_e4m3"
    backward: str = "fp8_e5m2"
    output: str = "bf16"
    history: int = 16  # delayed scaling: steps of amax kept

    def __post_init__(self):
        if self.name not in RECIPES:
            raise ValueError(f"unknown recipe {self.name!r}; choose one of {', '.join(RECIPES)}")
        for f in (self.forward, self.backward, self.output):
            formats.get(f)
        if self.history < 1:
            raise ValueError(f"history must be >= 1 step, got {self.history}")

    @property
    def scaled(self) -> bool:
        return self.name not in ("bf16", "fp16")


def recipe(name: str) -> Recipe:
    """The recipe as usually configured: bf16/fp16 round to themselves, the tensor-level FP8
    recipes are hybrid (E4M3 forward, E5M2 gradients), the fine-grained ones E4M3 throughout."""
    if name in ("bf16", "fp16"):
        return Recipe(name, name, name, "fp32")
    if name in ("rowwise", "blockwise", "mxfp8"):
        return Recipe(name, backward="fp8_e4m3")
    return Recipe(name)


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
    block = 32 if rcp.name == "mxfp8" else TILE
    pad = -xt.shape[1] % block  # zeros change no block's amax
    xp = torch.nn.functional.pad(xt, (0, pad)) if pad else xt
    if rcp.name == "mxfp8":
        out = formats.block_quantize(xp, "mxfp8_e4m3" if fmt == "fp8_e4m3" else "mxfp8_e5m2")
    else:  # blockwise: 1 x 128 tiles (activations, gradients), 128 x 128 blocks (weights)
        t = _tiles(xp, TILE if is_weight else 1, TILE)
        scale = top / t.detach().abs().amax(dim=(-2, -1), keepdim=True).clamp(min=EPS)
        out = (_cast(t * scale, fmt) / scale).transpose(1, 2).reshape(xp.shape)
    out = out[:, :xt.shape[1]]
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


class _Matmuls(torch.autograd.Function):
    """y = q(x) q(W)^T; dx = q(g) q(W); dW = q(g)^T q(x): each operand quantised along its own
    non-summed dimension, outputs rounded to the recipe's output format (dW stays fp32, the
    master gradient)."""

    @staticmethod
    def forward(ctx, x, w, layer):
        rcp = layer.recipe
        xq = quantize_operand(x, rcp, rcp.forward, 1, False, layer.amax("x", x))
        wq = quantize_operand(w, rcp, rcp.forward, 1, True, layer.amax("w", w))
        ctx.save_for_backward(x, w)
        ctx.layer = layer
        return scaled_matmul(xq, _t(wq), rcp.output)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        layer, rcp = ctx.layer, ctx.layer.recipe
        g = g.contiguous()
        amax_g, amax_w, amax_x = (layer.amax("g", g), layer.amax("w", w, update=False),
                                  layer.amax("x", x, update=False))
        dx = scaled_matmul(quantize_operand(g, rcp, rcp.backward, 1, False, amax_g),
                           quantize_operand(w, rcp, rcp.forward, 0, True, amax_w), rcp.output)
        dw = scaled_matmul(_t(quantize_operand(g, rcp, rcp.backward, 0, False, amax_g)),
                           quantize_operand(x, rcp, rcp.forward, 0, False, amax_x), "fp32")
        return dx, dw, None


def _t(op: tuple[torch.Tensor, torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor | None]:
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
        if rcp.name == "blockwise" and (self.in_features % TILE or self.out_features % TILE):
            raise ValueError(f"blockwise scaling needs both dimensions to be multiples of {TILE}, "
                             f"got {self.out_features} x {self.in_features}")
        if rcp.name == "mxfp8" and (self.in_features % 32 or self.out_features % 32):
            raise ValueError(f"mxfp8 scales blocks of 32 along each summed dimension: "
                             f"{self.out_features} x {self.in_features} does not divide")
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
                    skip: tuple[str, ...] = ("head", "router")) -> list[str]:
    """Replace every nn.Linear under `model.blocks` (except names containing a `skip` part)
    with an EmulatedLinear; returns the converted names. Embeddings, the final norm and the
    head stay as they are: the first and last layers are the most sensitive to precision."""
    rcp = recipe(rcp) if isinstance(rcp, str) else rcp
    done = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if type(child) is nn.Linear and full.startswith("blocks.") and \
                    not any(s in full.split(".") for s in skip):
                setattr(module, child_name, EmulatedLinear(child, rcp))
                done.append(full)
    return done
