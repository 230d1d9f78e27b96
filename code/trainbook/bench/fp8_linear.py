"""An FP8 linear layer's three matmuls against bf16's, timed on the device at hand (gpumeasure).

One training step of a linear layer is three matmuls: forward y = x W^T, input gradient
dx = g W, weight gradient dW = g^T x. In FP8 each operand is first cast: its amax is reduced,
it is scaled and rounded to E4M3 (E5M2 for the gradient under the tensorwise recipe, as
torchao's default), in the layout `torch._scaled_mm` takes (the left operand row-major, the
right one column-major, so transposed copies are cast where the backward needs them). `step`
does exactly that with tensorwise or rowwise scales; `time_step` times it against the same
three matmuls in bf16, and the FP8 matmuls alone on operands cast beforehand (what the kernels
gain before the casts take some back). `torchao_times` adds torchao's Float8Linear where
torchao is installed. The numbers are stored by `python -m trainbook gpumeasure`
(fp8-linear.json) and shown in the FP8 chapter.

Chapter: book/precision/fp8.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from .timing import Timer

RECIPES = ("tensorwise", "rowwise")
E4M3 = "float8_e4m3fn"


def _fp8(name: str) -> torch.dtype:
    """The FP8 dtype (ROCm's MI300 uses the 'fnuz' variants)."""
    if torch.version.hip:
        name = name.replace("e4m3fn", "e4m3fnuz").replace("e5m2", "e5m2fnuz")
    dt = getattr(torch, name, None)
    if dt is None or not hasattr(torch, "_scaled_mm"):
        raise ValueError(f"this PyTorch ({torch.__version__}) has no {name} or torch._scaled_mm")
    return dt


def cast(t: torch.Tensor, dtype: torch.dtype, rowwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(t scaled and cast to `dtype`, the inverse scale): one scale per tensor, or per row."""
    top = torch.finfo(dtype).max
    amax = t.abs().amax(dim=1, keepdim=True) if rowwise else t.abs().amax()
    scale = top / amax.float().clamp(min=1e-12)
    q = (t.float() * scale).clamp(-top, top).to(dtype)
    return q, scale.reciprocal()


def _mm(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]
        ) -> torch.Tensor:
    """a @ b^T for a (M, K) and b (N, K), both row-major casts: b^T is then column-major, the
    layout _scaled_mm needs; b's row scales become the column scales."""
    (qa, sa), (qb, sb) = a, b
    return torch._scaled_mm(qa, qb.t(), scale_a=sa, scale_b=sb.t().contiguous() if sb.dim() else sb,
                            out_dtype=torch.bfloat16)


def step(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor,
         recipe: str = "tensorwise") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, dx, dW) of one linear layer in FP8, casts included: x (M, K), w (N, K), g (M, N)."""
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {', '.join(RECIPES)}, got {recipe!r}")
    rowwise = recipe == "rowwise"
    e4m3 = _fp8(E4M3)
    grad = e4m3 if rowwise else _fp8("float8_e5m2")  # rowwise: E4M3 throughout
    y = _mm(cast(x, e4m3, rowwise), cast(w, e4m3, rowwise))
    dx = _mm(cast(g, grad, rowwise), cast(w.t().contiguous(), e4m3, rowwise))
    dw = _mm(cast(g.t().contiguous(), grad, rowwise), cast(x.t().contiguous(), e4m3, rowwise))
    return y, dx, dw


def _check_shape(m: int, k: int, n: int) -> None:
    if min(m, k, n) < 16 or any(d % 16 for d in (m, k, n)):
        raise ValueError(f"FP8 matmuls need every dimension a multiple of 16, got "
                         f"M={m}, K={k}, N={n}")


def _median_time(fn: Callable[[], object], timer: Timer, repeats: int, warmup: int,
                 deadline: float) -> float:
    for _ in range(warmup):
        fn()
    timer.sync()
    times = []
    while len(times) < repeats and (not times or time.perf_counter() < deadline):
        times.append(timer(fn))
    return sorted(times)[len(times) // 2]


def time_step(m: int, k: int, n: int, device: torch.device, repeats: int = 20,
              warmup: int = 3, budget_s: float = 10.0) -> dict:
    """Median milliseconds of one linear layer's three matmuls for M tokens, K inputs and N
    outputs: bf16, FP8 with the casts (per recipe), and the FP8 matmuls alone; the speed-ups
    over bf16, and the bf16 TFLOPS (6 M K N FLOPs)."""
    _check_shape(m, k, n)
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, k, device=device, generator=gen, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=device, generator=gen, dtype=torch.bfloat16) * 0.02
    g = torch.randn(m, n, device=device, generator=gen, dtype=torch.bfloat16) * 1e-3
    timer, deadline = Timer(device), time.perf_counter() + budget_s
    row = {"m": m, "k": k, "n": n}
    row["bf16 ms"] = 1e3 * _median_time(lambda: (x @ w.t(), g @ w, g.t() @ x), timer, repeats,
                                        warmup, deadline)
    for rcp in RECIPES:
        row[f"fp8 {rcp} ms"] = 1e3 * _median_time(lambda r=rcp: step(x, w, g, r), timer,
                                                  repeats, warmup, deadline)
    e4m3 = _fp8(E4M3)
    ops = [cast(t, e4m3, False) for t in (x, w, g, w.t().contiguous(), g.t().contiguous(),
                                          x.t().contiguous())]
    row["fp8 matmuls only ms"] = 1e3 * _median_time(
        lambda: (_mm(ops[0], ops[1]), _mm(ops[2], ops[3]), _mm(ops[4], ops[5])), timer,
        repeats, warmup, deadline)
    for key in ("fp8 tensorwise ms", "fp8 rowwise ms", "fp8 matmuls only ms"):
        row[f"speed-up: {key.removesuffix(' ms')}"] = row["bf16 ms"] / row[key]
    row["bf16 TFLOPS"] = 6 * m * k * n / (row["bf16 ms"] / 1e3) / 1e12
    return row


def torchao_times(m: int, k: int, n: int, device: torch.device, repeats: int = 20,
                  warmup: int = 3, budget_s: float = 10.0) -> dict:
    """Median milliseconds of forward and backward through torchao's Float8Linear (tensorwise
    and rowwise recipes, eager) against nn.Linear in bf16; {'torchao': reason} when torchao
    is not installed or refuses."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        return {"torchao": f"not installed ({e}); pip install torchao"}
    _check_shape(m, k, n)
    device = torch.device(device)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    timer, deadline = Timer(device), time.perf_counter() + budget_s
    out = {"m": m, "k": k, "n": n}

    def fwd_bwd(layer):
        layer(x).sum().backward()

    base = torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
    out["bf16 ms"] = 1e3 * _median_time(lambda: fwd_bwd(base), timer, repeats, warmup, deadline)
    for rcp in RECIPES:
        try:
            layer = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False, device=device,
                                                        dtype=torch.bfloat16))
            convert_to_float8_training(layer, config=Float8LinearConfig.from_recipe_name(rcp))
            out[f"torchao {rcp} ms"] = 1e3 * _median_time(lambda lay=layer: fwd_bwd(lay), timer,
                                                          repeats, warmup, deadline)
        except Exception as e:  # an old torchao or an unsupported device: recorded, not fatal
            out[f"torchao {rcp}"] = f"{type(e).__name__}: {e}"
    return out
