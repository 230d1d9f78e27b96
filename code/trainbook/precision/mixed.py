"""Mixed precision, measured: what autocast runs in which dtype, what each parameter costs, and
which gradients fp16 cannot hold.

- `autocast_policy` runs ops under `torch.autocast` on this device (fp32 inputs, then inputs
  already in the low-precision dtype) and records the output dtype, next to the lists PyTorch
  documents for CPU and for CUDA (`DOCUMENTED`, quoted from docs/source/amp.md).
- `module_dtypes`: the dtype every module of the reference model outputs under autocast.
- `state_bytes`: bytes per parameter of the usual setups, from the memory estimator
  (`compute.memory`) and `lowp_weights`.
- `capture_gradients` takes the activation gradients (at every linear layer's output) and the
  weight gradients of one backward pass; `underflow` says which share a format flushes to zero,
  keeps only as subnormals or overflows, for each loss scale; `log2_histogram` bins them by
  binade (Micikevicius et al. 2018, Figure 3).

Chapter: book/precision/mixed-precision.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn

from .. import formats
from ..compute.memory import state_bytes_per_param
from ..hardware import normalize_dtype
from ..launch import threads
from .lowp_weights import bytes_per_param

__all__ = ["DOCUMENTED", "OPS", "autocast_policy", "capture_gradients", "log2_histogram",
           "module_dtypes", "state_bytes", "underflow"]

# PyTorch's Autocast Op Reference (docs/source/amp.md, torch 2.x), for the ops measured here:
# "lower" = can autocast to float16 (CUDA) / bfloat16 (CPU; float16 shares the CPU lists),
# "fp32" = can autocast to float32, "promote" = promote to the widest input type; ops not listed
# run in the type of their inputs.
DOCUMENTED = {
    "cuda": {
        "lower": {"__matmul__", "addbmm", "addmm", "addmv", "addr", "baddbmm", "bmm",
                  "multi_dot", "conv1d", "conv2d", "conv3d", "conv_transpose1d",
                  "conv_transpose2d", "conv_transpose3d", "GRUCell", "linear", "LSTMCell",
                  "matmul", "mm", "mv", "prelu", "RNNCell"},
        "fp32": {"__pow__", "__rdiv__", "__rpow__", "__rtruediv__", "acos", "asin",
                 "binary_cross_entropy_with_logits", "cosh", "cosine_embedding_loss", "cdist",
                 "cosine_similarity", "cross_entropy", "cumprod", "cumsum", "dist", "erfinv",
                 "exp", "expm1", "group_norm", "hinge_embedding_loss", "kl_div", "l1_loss",
                 "layer_norm", "log", "log_softmax", "log10", "log1p", "log2",
                 "margin_ranking_loss", "mse_loss", "multilabel_margin_loss",
                 "multi_margin_loss", "nll_loss", "norm", "normalize", "pdist",
                 "poisson_nll_loss", "pow", "prod", "reciprocal", "rsqrt", "sinh",
                 "smooth_l1_loss", "soft_margin_loss", "softmax", "softmin", "softplus", "sum",
                 "renorm", "tan", "triplet_margin_loss"},
        "promote": {"addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "grid_sample",
                    "index_put", "scatter_add", "tensordot"},
    },
    "cpu": {  # the CPU lists, as far as the ops measured here go
        "lower": {"conv1d", "conv2d", "conv3d", "bmm", "mm", "linalg_vecdot", "baddbmm", "addmm",
                  "addbmm", "linear", "matmul", "_convolution", "conv_tbc", "mkldnn_rnn_layer",
                  "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "prelu",
                  "scaled_dot_product_attention", "_native_multi_head_attention"},
        "fp32": {"mse_loss", "nll_loss", "cross_entropy_loss", "l1_loss", "huber_loss",
                 "kl_div", "binary_cross_entropy_with_logits", "prod", "cdist"},
        "promote": {"cat", "stack", "index_copy"},
    },
}

_W = torch.linspace(-1, 1, 64).reshape(8, 8)
_T = torch.arange(4) % 8
# op -> (function of one (4, 8) input, its name in the CUDA lists, its name in the CPU lists)
OPS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], str, str]] = {
    "linear": (lambda a: F.linear(a, _W.to(a.dtype)), "linear", "linear"),
    "matmul (@)": (lambda a: a @ a.t(), "matmul", "matmul"),
    "bmm": (lambda a: torch.bmm(a[None], a.t()[None]), "bmm", "bmm"),
    "scaled_dot_product_attention": (
        lambda a: F.scaled_dot_product_attention(a[None, None], a[None, None], a[None, None]),
        "scaled_dot_product_attention", "scaled_dot_product_attention"),
    "softmax": (lambda a: a.softmax(-1), "softmax", "softmax"),
    "log_softmax": (lambda a: a.log_softmax(-1), "log_softmax", "log_softmax"),
    "layer_norm": (lambda a: F.layer_norm(a, a.shape[-1:]), "layer_norm", "layer_norm"),
    "rms_norm": (lambda a: F.rms_norm(a, a.shape[-1:]), "rms_norm", "rms_norm"),
    "cross_entropy": (lambda a: F.cross_entropy(a, _T), "cross_entropy", "cross_entropy_loss"),
    "mse_loss": (lambda a: F.mse_loss(a, torch.zeros_like(a)), "mse_loss", "mse_loss"),
    "sum": (lambda a: a.sum(), "sum", "sum"),
    "mean": (lambda a: a.mean(), "mean", "mean"),
    "exp": (lambda a: a.exp(), "exp", "exp"),
    "pow": (lambda a: a.pow(2), "pow", "pow"),
    "norm": (lambda a: a.norm(), "norm", "norm"),
    "cumsum": (lambda a: a.cumsum(-1), "cumsum", "cumsum"),
    "silu": (F.silu, "silu", "silu"),
    "cat (with an fp32 tensor)": (lambda a: torch.cat([a, torch.ones(1, 8)]), "cat", "cat"),
    "add (with an fp32 tensor)": (lambda a: a + torch.ones(8), "add", "add"),
}
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _documented(device: str, name: str, low: str) -> str:
    lists = DOCUMENTED[device]
    for kind, label in (("lower", low), ("fp32", "fp32"), ("promote", "widest input")):
        if name in lists[kind]:
            return label
    return "input dtype (unlisted)"


@threads(1)
def autocast_policy(dtype: str = "bf16", device: str = "cpu") -> pd.DataFrame:
    """For every op in OPS: the output dtype under torch.autocast(device, dtype) with an fp32
    input and with an input already in `dtype`, beside what the CPU and CUDA lists document.
    Runs on (4, 8) tensors: cheap even where bf16 is emulated."""
    if dtype not in _DTYPES:
        raise ValueError(f"autocast dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    low = _DTYPES[dtype]
    a = torch.linspace(-2, 2, 32).reshape(4, 8).to(device)
    rows = []
    for op, (fn, cuda_name, cpu_name) in OPS.items():
        out = {}
        for label, x in (("fp32 input", a), (f"{dtype} input", a.to(low))):
            with torch.autocast(torch.device(device).type, dtype=low):
                out[label] = normalize_dtype(fn(x).dtype)
        rows.append({"op": op, **out,
                     "CPU lists": _documented("cpu", cpu_name, dtype),
                     "CUDA lists": _documented("cuda", cuda_name, "fp16/bf16")})
    return pd.DataFrame(rows).set_index("op")


@threads(1)
def module_dtypes(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                  dtype: str = "bf16") -> pd.DataFrame:
    """The dtype of every module's output in one forward pass of `model(x, y)` under autocast,
    counted by module class (and the loss's dtype as 'loss')."""
    if dtype not in _DTYPES:
        raise ValueError(f"autocast dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    seen: list[tuple[str, str]] = []

    def hook(mod, _inp, out):
        if torch.is_tensor(out):
            seen.append((type(mod).__name__, normalize_dtype(out.dtype)))

    handles = [m.register_forward_hook(hook) for m in model.modules() if m is not model]
    try:
        with torch.no_grad(), torch.autocast(x.device.type, dtype=_DTYPES[dtype]):
            logits, loss = model(x, y)
    finally:
        for h in handles:
            h.remove()
    seen += [("logits", normalize_dtype(logits.dtype)), ("loss", normalize_dtype(loss.dtype))]
    df = pd.DataFrame(seen, columns=["module", "output dtype"])
    return df.groupby(["module", "output dtype"], sort=False).size().rename("count").to_frame()


def state_bytes(optimizer: str = "adamw") -> pd.DataFrame:
    """Bytes per parameter of weights, gradients and optimizer state (master copy included)
    for fp32 training, mixed precision (ZeRO's accounting: 16-bit gradients), mixed precision
    with fp32 gradients (Megatron's main_grad), and bf16 weights without a master copy: the
    memory estimator's numbers for the first three, `lowp_weights.bytes_per_param` for the
    rest (AdamW's moments in fp32)."""
    rows = {"fp32": state_bytes_per_param("fp32", optimizer),
            "bf16 mixed (16-bit grads)": state_bytes_per_param("bf16", optimizer),
            "bf16 mixed, fp32 grads": state_bytes_per_param("bf16", optimizer, "fp32")}
    opt = state_bytes_per_param("fp32", optimizer)["optimizer"]
    for mode in ("nearest", "kahan", "stochastic"):
        b = bytes_per_param(mode, optimizer_bytes=opt)
        rows[f"bf16 weights, {mode}"] = {"weights": b["weights"], "grads": b["grads"],
                                         "optimizer": b["compensation"] + b["optimizer"]}
    df = pd.DataFrame(rows).T[["weights", "grads", "optimizer"]]
    df["total"] = df.sum(axis=1)
    return df


@threads(1)
def capture_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                      loss_multiplier: float = 1.0) -> dict[str, torch.Tensor]:
    """One forward and backward of `model(x, y)` (its loss times `loss_multiplier`): the
    gradients at every nn.Linear's output ("activation", what the backward matmuls take in) and
    every parameter's gradient ("weight"), flattened, in fp32."""
    acts: list[torch.Tensor] = []

    def hook(_mod, _gin, gout):
        acts.append(gout[0].detach().float().flatten())

    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ValueError("the model has no nn.Linear layers to capture gradients at")
    handles = [m.register_full_backward_hook(hook) for m in linears]
    try:
        model.zero_grad(set_to_none=True)
        (model(x, y)[1] * loss_multiplier).backward()
    finally:
        for h in handles:
            h.remove()
    weight = torch.cat([p.grad.detach().float().flatten() for p in model.parameters()
                        if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return {"activation": torch.cat(acts), "weight": weight}


@threads(1)
def underflow(values: torch.Tensor, scales: Iterable[float], fmt: str = "fp16") -> pd.DataFrame:
    """For each loss scale S: the share of the non-zero `values` that S * value, stored in
    `fmt`, flushes to zero (round to nearest), keeps as a subnormal (fewer significant bits),
    keeps as a normal number, or overflows to inf."""
    f = formats.get(fmt)
    v = values[values != 0].double()
    if v.numel() == 0:
        raise ValueError("no non-zero values to classify")
    rows = []
    for s in scales:
        if not s > 0:
            raise ValueError(f"loss scales must be positive, got {s}")
        q = formats.quantize(v * s, f)
        a = (v * s).abs()
        zero = q == 0
        over = ~torch.isfinite(q)
        sub = ~zero & ~over & (a < f.min_normal)
        rows.append({"scale": s, "flushed to zero": zero.double().mean().item(),
                     "subnormal": sub.double().mean().item(),
                     "normal": (~zero & ~sub & ~over).double().mean().item(),
                     "overflow": over.double().mean().item()})
    return pd.DataFrame(rows).set_index("scale")


def log2_histogram(values: torch.Tensor, low: int = -40, high: int = 16) -> pd.Series:
    """Counts of the values by binade, floor(log2 |v|) clamped to [low, high], and of the exact
    zeros (index 'zero'), as fractions of all values."""
    if low >= high:
        raise ValueError(f"need low < high, got {low}, {high}")
    v = values.detach().double()
    nz = v[v != 0].abs()
    e = torch.floor(torch.log2(nz)).clamp(low, high).long()
    counts = torch.bincount(e - low, minlength=high - low + 1).double()
    s = pd.Series(counts.numpy(), index=list(range(low, high + 1)))
    s["zero"] = float((v == 0).sum())
    return s / v.numel()
