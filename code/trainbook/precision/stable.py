"""Order of operations: softmax, attention logits and norms, computed so they cannot overflow.

exp overflows early: in fp16 at ln(65504) = 11.09, in bf16 and fp32 at 88.7. A softmax that
exponentiates raw logits (`softmax_table`, "naive") returns NaN (inf / inf) as soon as one logit
passes that; subtracting the row's max first makes every exponent <= 0 and changes nothing
mathematically. The log of a softmax underflows where log-softmax does not (Part 2's loss
chapter builds cross-entropy on the stable form, `trainbook.pretrain.loss`).

Attention: q.k of two d-dimensional vectors with unit-variance entries has standard deviation
sqrt(d), so 1/sqrt(d) keeps the logits near unit scale (`logit_scale`). Rounding a logit s to a
format with unit roundoff u moves it by up to |s| u, and softmax is not scale-invariant: the
probabilities change by a factor up to exp(|s| u), so the error of logits written in bf16 grows
with their magnitude (`logit_rounding_error`); flash-attention kernels keep them in fp32.

Norms: a sum of squares overflows fp16 for any activation above 256 (256^2 > 65504), which is
why the reference model's RMSNorm upcasts to fp32 (`rms_norm_in`); a variance computed as
E[x^2] - E[x]^2 cancels catastrophically when the mean is large against the spread, in fp32
too (`variances`), where subtracting the mean first does not.

Chapter: book/precision/numerics.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .. import formats as F

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def exp_overflow(fmt: str) -> float:
    """The largest x whose exp is finite in fmt, to first order: ln(max)."""
    return math.log(F.get(fmt).max)


def naive_softmax(z: torch.Tensor) -> torch.Tensor:
    """exp(z) / sum exp(z) over the last dimension, in z's dtype, as written on paper."""
    e = z.exp()
    return e / e.sum(-1, keepdim=True)


def stable_softmax(z: torch.Tensor) -> torch.Tensor:
    """exp(z - max z) / sum exp(z - max z): every exponent <= 0, the largest term exactly 1."""
    e = (z - z.amax(-1, keepdim=True)).exp()
    return e / e.sum(-1, keepdim=True)


def softmax_table(peaks: Sequence[float], dtype: str = "fp16", n: int = 8) -> list[dict]:
    """For rows of n logits whose largest is each of `peaks` (the others 1 below it, spread
    evenly down to 0): whether the naive and the max-subtracted softmax in `dtype` come out
    finite, and the stable one's largest error against fp64."""
    dt = _dtype(dtype)
    if n < 2:
        raise ValueError(f"n must be >= 2, got {n}")
    rows = []
    for peak in peaks:
        z = torch.linspace(0, 1, n, dtype=torch.float64) * (peak - 1)
        z[-1] = peak
        ref = torch.softmax(z, -1)
        zd = z.to(dt)
        naive, stable = naive_softmax(zd), stable_softmax(zd)
        rows.append({"largest logit": peak, "dtype": dtype,
                     "naive finite": bool(torch.isfinite(naive).all()),
                     "stable finite": bool(torch.isfinite(stable).all()),
                     "stable max error": (stable.double() - ref).abs().max().item()})
    return rows


def logit_scale(d: int, n: int = 4096, seed: int = 0) -> dict[str, float]:
    """Standard deviation of q.k for n pairs of d-dimensional standard-normal vectors, before
    and after the 1/sqrt(d) scale of attention, and the softmax entropy (nats) of one query
    against n keys either way (log n for uniform attention)."""
    if d < 1 or n < 2:
        raise ValueError(f"need d >= 1 and n >= 2, got {d}, {n}")
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(d, generator=g, dtype=torch.float64)
    k = torch.randn(n, d, generator=g, dtype=torch.float64)
    s = k @ q

    def entropy(z):
        p = torch.softmax(z, -1)
        return -(p * p.clamp(min=1e-300).log()).sum().item()

    return {"d": d, "std raw": s.std().item(), "std scaled": (s / math.sqrt(d)).std().item(),
            "entropy raw": entropy(s), "entropy scaled": entropy(s / math.sqrt(d)),
            "uniform entropy": math.log(n)}


def logit_rounding_error(scales: Sequence[float], fmt: str = "bf16", n: int = 256,
                         rows: int = 64, seed: int = 0) -> list[dict]:
    """Attention probabilities from logits rounded to `fmt` (as an eager S = Q K^T written in
    bf16 is) against the same logits in fp64, for logits of standard deviation `scale`: the
    largest relative change of a probability that matters (p > 1/n) and the total variation."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for scale in scales:
        s = torch.randn(rows, n, generator=g, dtype=torch.float64) * scale
        p = torch.softmax(s, -1)
        q = torch.softmax(F.quantize(s, fmt), -1)
        big = p > 1 / n
        out.append({"logit std": scale, "format": fmt,
                    "largest |logit|": s.abs().max().item(),
                    "max relative change of p": ((q - p).abs() / p)[big].max().item(),
                    "total variation": 0.5 * (q - p).abs().sum(-1).max().item(),
                    "bound exp(2 max|s| u) - 1": math.expm1(s.abs().max().item() *
                                                            F.get(fmt).eps)})
    return out


def rms_norm_in(x: torch.Tensor, dtype: str, eps: float = 1e-5) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) computed entirely in `dtype`, without the upcast the reference
    model's RMSNorm (`trainbook.model.RMSNorm`) does: the squares overflow fp16 above 256."""
    xd = x.to(_dtype(dtype))
    return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)


def variances(x: torch.Tensor, dtype: str = "fp32") -> dict[str, float]:
    """The variance of the last dimension of x (one row) computed in `dtype` three ways:
    E[x^2] - E[x]^2 (one pass: cancels when |mean| >> std), E[(x - mean)^2] (two passes), and
    torch.var, each with its relative error against the fp64 variance of the same (rounded)
    values."""
    if x.dim() != 1 or x.numel() < 2:
        raise ValueError(f"x must be one row of >= 2 values, got shape {tuple(x.shape)}")
    xd = x.to(_dtype(dtype))
    ref = xd.double().var(unbiased=False).item()  # of the values as stored in dtype
    one_pass = (xd.pow(2).mean() - xd.mean().pow(2)).item()
    two_pass = (xd - xd.mean()).pow(2).mean().item()
    library = xd.var(unbiased=False).item()
    return {"dtype": dtype, "exact": ref, "E[x^2] - E[x]^2": one_pass,
            "E[(x - mean)^2]": two_pass, "torch.var": library,
            **{f"error {k}": abs(v - ref) / ref for k, v in
               (("one pass", one_pass), ("two pass", two_pass), ("torch.var", library))}}
