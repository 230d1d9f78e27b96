"""FP8 numerics, measured: what each scaling recipe does to real tensors of the reference model.

An FP8 matmul multiplies values of 3 (E4M3) or 2 (E5M2) mantissa bits within a range of about
2^18 (E4M3) or 2^32 (E5M2), so every operand is first divided by a scale that puts its largest
magnitude at the format's maximum. Where that scale comes from is the recipe
(`train.emulate`): one per tensor from this step's amax (tensorwise, "current scaling"), from
past steps' amaxes (delayed), one per row, per 1x128 tile and 128x128 block (DeepSeek-V3), per
32 values with a power-of-two scale (MXFP8). Here:

- `scaled_mm_agreement`: the emulation against `torch._scaled_mm` (tensorwise and rowwise).
- `recipe_errors`: the signal-to-noise ratio and the share flushed to zero each recipe leaves
  the block linears' weights, inputs and output gradients of one step (captured by the formats
  chapter's `blocks.model_tensors`); `crest_factor` (amax over RMS) says which tensors are
  outlier-heavy; `outlier_errors` plants an outlier channel or token of growing size and
  measures what each recipe does to the rest of the tensor.
- `delayed_trace`: delayed scaling through an amax jump, against current scaling.

Chapter: book/precision/fp8.
"""

from __future__ import annotations

import math

import pandas as pd
import torch
from torch import nn

from ..launch import threads
from ..train.emulate import (
    EmulatedLinear,
    Recipe,
    fake_quantize,
    quantize_operand,
    recipe,
    scaled_matmul,
    transpose,
)

__all__ = ["KINDS", "SCALED", "crest_factor", "delayed_trace", "outlier", "outlier_errors",
           "recipe_errors", "scaled_mm_agreement", "snr_db"]

SCALED = ("tensorwise", "rowwise", "blockwise", "mxfp8")  # the recipes compared on one tensor
KINDS = ("weights", "activations", "gradients")  # what blocks.model_tensors returns


def snr_db(x: torch.Tensor, q: torch.Tensor) -> float:
    """Signal-to-noise ratio of q as a copy of x: 10 log10(sum x^2 / sum (x - q)^2), in dB
    (inf when q equals x; about 6 dB per bit of precision)."""
    x, q = x.double(), q.double()
    noise = (x - q).pow(2).sum().item()
    signal = x.pow(2).sum().item()
    if signal == 0:
        raise ValueError("x is all zeros: its signal-to-noise ratio is undefined")
    return math.inf if noise == 0 else 10 * math.log10(signal / noise)


def crest_factor(x: torch.Tensor) -> float:
    """amax / RMS: how far the largest magnitude stands above the typical one (a Gaussian of a
    million values about 5; an outlier channel makes it tens or hundreds)."""
    x = x.double()
    rms = x.pow(2).mean().sqrt().item()
    if rms == 0:
        raise ValueError("x is all zeros: its crest factor is undefined")
    return x.abs().max().item() / rms


def _underflow(x: torch.Tensor, q: torch.Tensor) -> float:
    nz = x != 0
    return ((q == 0) & nz).double().sum().item() / max(int(nz.sum()), 1)


@threads(1)
def scaled_mm_agreement(shapes: tuple[tuple[int, int, int], ...] = ((64, 256, 96),),
                        recipes: tuple[str, ...] = ("tensorwise", "rowwise"),
                        seed: int = 0) -> pd.DataFrame:
    """The emulation's y = x W^T against torch._scaled_mm on the same FP8 operands, for each
    (M, K, N) shape and recipe (E4M3 operands; x with a spread of row scales). Columns: whether
    the emulated operands are FP8 numbers, the largest |difference| of the fp32 outputs over
    the bound an fp32 sum of K terms allows (K 2^-24 sum|products|: below 1 means the two differ
    only by summation order), and the share of bf16 outputs that are bit-equal."""
    f8 = getattr(torch, "float8_e4m3fn", None)
    if f8 is None or not hasattr(torch, "_scaled_mm"):
        raise ValueError(f"this PyTorch ({torch.__version__}) has no torch._scaled_mm or "
                         "float8_e4m3fn; upgrade to torch >= 2.4")
    g = torch.Generator().manual_seed(seed)
    rows = []
    for M, K, N in shapes:
        if min(M, K, N) < 16 or any(d % 16 for d in (M, K, N)):
            raise ValueError(f"torch._scaled_mm needs M, K, N multiples of 16, got {(M, K, N)}")
        x = torch.randn(M, K, generator=g) * torch.logspace(-2, 1, M)[:, None]
        w = torch.randn(N, K, generator=g) * 0.02
        for name in recipes:
            rcp = recipe(name)
            xq = quantize_operand(x, rcp, "fp8_e4m3", 1, False)
            wq = quantize_operand(w, rcp, "fp8_e4m3", 1, True)
            exact = all(torch.equal(q, q.to(f8).float()) for q, _ in (xq, wq))
            a, b = xq[0].to(f8), wq[0].to(f8).t()
            sa = xq[1].float().contiguous()
            sb = transpose(wq)[1].float().contiguous()
            ref32 = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.float32)
            ref16 = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
            ours = scaled_matmul(xq, transpose(wq), "fp32")
            bound = K * 2.0**-24 * (xq[0].abs() @ wq[0].abs().t()) * (sa * sb)
            rows.append({"shape (M, K, N)": f"{M} x {K} x {N}", "recipe": name,
                         "operands are FP8 values": exact,
                         "max |diff| / fp32 bound": ((ours - ref32).abs() / bound).max().item(),
                         "bf16 outputs bit-equal": (ours.bfloat16() == ref16).double()
                         .mean().item()})
    return pd.DataFrame(rows)


@threads(1)
def recipe_errors(tensors: dict[str, dict[str, torch.Tensor]],
                  recipes: tuple[str, ...] = SCALED, fmt: str = "fp8_e4m3") -> pd.DataFrame:
    """For every tensor of `blocks.model_tensors` (kind: weights, activations, gradients; then
    layer): its crest factor and, per recipe ('unscaled' too: a plain cast), the SNR in dB of
    its copy in `fmt` and the share of its non-zero values flushed to zero, as the forward and
    input-gradient matmuls hold it (the feature dimension summed)."""
    rows = []
    for kind, named in tensors.items():
        if kind not in KINDS:
            raise ValueError(f"unknown tensor kind {kind!r}: give blocks.model_tensors' "
                             f"{', '.join(KINDS)}")
        for layer, t in named.items():
            row = {"kind": kind, "layer": layer, "crest": crest_factor(t)}
            for name in recipes:
                q = fake_quantize(t.float(), _recipe(name, fmt), fmt, 1, kind == "weights")
                row[f"snr: {name}"] = snr_db(t, q)
                row[f"flushed: {name}"] = _underflow(t, q)
            rows.append(row)
    return pd.DataFrame(rows)


def _recipe(name: str, fmt: str) -> Recipe:
    """The recipe with `fmt` for every operand (to compare granularity in one element format);
    'unscaled' is a plain (saturating) cast."""
    if name == "unscaled":
        return Recipe("bf16", fmt, fmt, "fp32")
    return Recipe(name, forward=fmt, backward=fmt)


def outlier(x: torch.Tensor, kind: str = "channel", factor: float = 100.0,
            index: int = 0) -> torch.Tensor:
    """x (tokens x features) with one feature column ("channel") or one token row ("token")
    multiplied by `factor`: the two shapes of outliers activations have."""
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (tokens x features), got shape {tuple(x.shape)}")
    if kind not in ("channel", "token"):
        raise ValueError(f"kind must be 'channel' or 'token', got {kind!r}")
    out = x.clone()
    if kind == "channel":
        out[:, index] *= factor
    else:
        out[index] *= factor
    return out


@threads(1)
def outlier_errors(x: torch.Tensor, factors: tuple[float, ...] = (10.0, 100.0, 1e3, 1e4),
                   recipes: tuple[str, ...] = SCALED, fmt: str = "fp8_e4m3",
                   index: int = 0) -> pd.DataFrame:
    """Plant an outlier channel, then an outlier token, of each size in `factors` into x and
    quantise it with each recipe (feature dimension summed): the SNR of the rest of the tensor
    (the outlier excluded: it is always stored well) and the share of the rest flushed to
    zero."""
    rows = []
    for kind in ("channel", "token"):
        rest = torch.ones_like(x, dtype=torch.bool)
        if kind == "channel":
            rest[:, index] = False
        else:
            rest[index] = False
        for f in factors:
            xo = outlier(x, kind, f, index)
            for name in recipes:
                q = fake_quantize(xo, _recipe(name, fmt), fmt, 1, False)
                rows.append({"outlier": kind, "factor": f, "recipe": name,
                             "snr of the rest": snr_db(xo[rest], q[rest]),
                             "flushed": _underflow(xo[rest], q[rest])})
    return pd.DataFrame(rows)


@threads(1)
def delayed_trace(xs: list[torch.Tensor], history: int = 16,
                  fmt: str = "fp8_e4m3") -> pd.DataFrame:
    """Quantise a sequence of tensors (one per step) as the input of one EmulatedLinear under
    delayed scaling (the largest amax of the previous `history` steps) and under current
    scaling. Per step: the tensor's amax, the amax each recipe scaled by, the share each
    saturates (clipped to the format's max), the share each flushes to zero, and their SNR."""
    if not xs:
        raise ValueError("give at least one tensor")
    d = xs[0].shape[-1]
    layer = EmulatedLinear(nn.Linear(d, d, bias=False), Recipe("delayed", history=history))
    rows = []
    for step, x in enumerate(xs, start=1):
        row = {"step": step, "amax": x.abs().max().item()}
        for label, amax in (("delayed", layer.amax("x", x)), ("current", x.abs().amax())):
            q, inv = quantize_operand(x, layer.recipe, fmt, 1, False, amax)
            deq = q * inv
            row[f"amax used ({label})"] = amax.item()
            # above the amax the scale was set from, compared unscaled: x * (top / amax) can
            # round one ulp past top at the amax itself, and would count it on some CPUs
            row[f"saturated ({label})"] = (x.abs() > amax).double().mean().item()
            row[f"flushed ({label})"] = _underflow(x, deq)
            row[f"snr ({label})"] = snr_db(x, deq)
        rows.append(row)
    return pd.DataFrame(rows).set_index("step")
