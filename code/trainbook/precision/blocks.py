"""Scaled formats in practice: block against tensor scaling, E4M3 against E5M2, the hardware
that runs each format, and what weights take in each.

A tensor scaled as a whole spends the format's range on its largest value; a block format (OCP
MX: 32 values share a power-of-two E8M0 scale; NVFP4: 16 share an E4M3 scale) spends it per
block, so one outlier costs precision only in its own block. `block_errors` measures both on
Gaussian data, heavy-tailed data and data with outlier channels, each in the same element format.
`fp8_split` measures, on the reference model's own weights, activations and gradients, why
FP8 training used E4M3 forward and E5M2 for gradients (range against precision) and what a
finer scale changes. `GENERATIONS` says which formats each accelerator generation multiplies
natively, cross-checked against the hardware table (`trainbook.hardware`); `weight_memory`
prices a model's weights in each format, block scales included.

Chapter: book/precision/formats.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .. import configs, hardware
from .. import formats as F
from ..launch import threads
from ..model import Transformer
from ..train.emulate import Recipe, fake_quantize

GiB = 2**30


# ------------------------------------------------------------------------------------------------
# Test data: what activations look like
# ------------------------------------------------------------------------------------------------

def heavy_tailed(shape: tuple[int, ...], dof: int = 3,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """Student-t samples with `dof` degrees of freedom (a normal over the root of an average of
    dof squared normals): tails that fall off as a power law, as activations' often do."""
    if dof < 1:
        raise ValueError(f"dof must be a whole number >= 1, got {dof}")
    z = torch.randn(shape, generator=generator)
    chi = torch.randn((dof, *shape), generator=generator).pow(2).mean(0)
    return z / chi.sqrt()


def outlier_channels(shape: tuple[int, int], n_channels: int = 4, scale: float = 50.0,
                     generator: torch.Generator | None = None) -> torch.Tensor:
    """Gaussian (tokens, channels) data whose first `n_channels` channels are `scale` times
    larger: the systematic outlier features of LLM activations (Dettmers et al. 2022)."""
    if not 0 <= n_channels <= shape[1] or scale <= 0:
        raise ValueError(f"need 0 <= n_channels <= {shape[1]} and scale > 0, got "
                         f"{n_channels}, {scale}")
    x = torch.randn(shape, generator=generator)
    x[:, :n_channels] *= scale
    return x


def row_scales(shape: tuple[int, int], binades: float = 24.0,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """Gaussian (tokens, channels) data whose rows are scaled by 2^u, u evenly spaced over
    `binades` binades centred on 1: tokens whose magnitudes differ by orders of magnitude, as
    gradients' rows do (each token's loss has its own scale)."""
    if binades < 0:
        raise ValueError(f"binades must be >= 0, got {binades}")
    u = torch.linspace(-binades / 2, binades / 2, shape[0], dtype=torch.float64)[:, None]
    return (torch.randn(shape, generator=generator, dtype=torch.float64) * 2.0 ** u).float()


def relative_error(q: torch.Tensor, x: torch.Tensor) -> float:
    """||q_r - x_r|| / ||x_r|| for each row r (vectors along the last dimension), averaged over
    the rows that are not all zero: every token counts, whatever its scale."""
    xd = x.double().reshape(-1, x.shape[-1])
    err = (q.double().reshape(xd.shape) - xd).norm(dim=-1)
    size = xd.norm(dim=-1)
    keep = size > 0
    if not keep.any():
        raise ValueError("x is all zeros: its relative error is undefined")
    return (err[keep] / size[keep]).mean().item()


def tensor_scaled(x: torch.Tensor, element: str) -> torch.Tensor:
    """x through one per-tensor scale (amax -> the element format's max) and the element
    format, as the trainer's tensorwise FP8 recipe does (`train.emulate.fake_quantize`)."""
    rcp = Recipe("tensorwise", forward=element, backward=element)
    return fake_quantize(x.float(), rcp, element)


def block_errors(data: dict[str, torch.Tensor],
                 names: Sequence[str] | None = None) -> list[dict]:
    """For each block format and data set: bits per element (scales included), the relative
    error stored in the block format (MX: with OCP's scale and with the scale rounded up), and
    stored with one scale per tensor in the same element format. Blocks run along the last
    dimension."""
    rows = []
    for name in names or list(F.BLOCK_FORMATS):
        b = F.get_block(name)
        for label, x in data.items():
            up = relative_error(F.block_quantize(x, b, scale_rounding="ceil"), x) \
                if b.scale == "e8m0" else None
            rows.append({"format": b.name, "element": b.element, "scale": b.scale,
                         "block": b.block, "bits/element": b.bits_per_element, "data": label,
                         "block-scaled error": relative_error(F.block_quantize(x, b), x),
                         "scale rounded up": up,
                         "tensor-scaled error": relative_error(tensor_scaled(x, b.element), x)})
    return rows


def mx_clipped(x: torch.Tensor, name: str) -> float:
    """Share of values an MX block format clips: OCP's scale 2^(floor(log2 amax) - emax) maps
    a block's amax into [2^emax, 2^(emax+1)), but the element's max is below 2^(emax+1) (E4M3:
    448 = 1.75 x 2^8; E2M1: 6 = 1.5 x 2^2), so scaled values past max + half the top spacing
    saturate to max instead of rounding (E4M3: from 464 up)."""
    b = F.get_block(name)
    if b.scale != "e8m0":
        raise ValueError(f"{name} is not an MX format (its scale is {b.scale}, not E8M0)")
    s = F.block_scales(x, b)
    scaled = x.double().reshape(*x.shape[:-1], -1, b.block) / s[..., None]
    elem = F.FORMATS[b.element]
    threshold = elem.max + 2.0 ** elem.emax * elem.eps / 2
    return (scaled.abs() > threshold).double().mean().item()


# ------------------------------------------------------------------------------------------------
# E4M3 or E5M2: the reference model's own tensors
# ------------------------------------------------------------------------------------------------

def model_tensors(model: nn.Module, idx: torch.Tensor) -> dict[str, dict[str, torch.Tensor]]:
    """One forward and backward of `model` on tokens `idx` (next-token targets): for every
    linear layer of the blocks, its weight, its input (the activation) and the gradient of its
    output, each as a (rows, features) matrix."""
    acts: dict[str, torch.Tensor] = {}
    grads: dict[str, torch.Tensor] = {}
    handles = []
    linears = {n: m for n, m in model.named_modules()
               if isinstance(m, nn.Linear) and n.startswith("blocks.")}
    if not linears:
        raise ValueError("the model has no linear layers under .blocks")
    for n, m in linears.items():
        handles.append(m.register_forward_hook(
            lambda mod, inp, out, n=n: acts.__setitem__(n, inp[0].detach().flatten(0, -2))))
        handles.append(m.register_full_backward_hook(
            lambda mod, gin, gout, n=n: grads.__setitem__(n, gout[0].detach().flatten(0, -2))))
    try:
        model.zero_grad(set_to_none=True)
        with threads(1):  # a tiny model: one thread is as fast, and steady on a busy machine
            _, loss = model(idx[:, :-1], idx[:, 1:])
            loss.backward()
    finally:
        for h in handles:
            h.remove()
    return {"weights": {n: m.weight.detach() for n, m in linears.items()},
            "activations": acts, "gradients": grads}


def _fp8_stats(t: torch.Tensor, fmt: str, recipe: str) -> tuple[float, float]:
    rcp = Recipe(recipe, forward=fmt, backward=fmt)
    q = fake_quantize(t.float(), rcp, fmt)
    nonzero = t != 0
    flushed = ((q == 0) & nonzero).double().sum() / nonzero.sum().clamp(min=1)
    return flushed.item(), relative_error(q, t)


def fp8_split(tensors: dict[str, dict[str, torch.Tensor]]) -> list[dict]:
    """For weights, activations and gradients: the span of their magnitudes in binades (from
    the 0.1% quantile of the nonzero |x| to the max, averaged over layers), and, for E4M3 and
    E5M2 with one scale per tensor and for E4M3 with DeepSeek-V3's 1 x 128 tiles, the share of
    nonzero values that flush to zero and the relative error (averaged over layers)."""
    cases = (("fp8_e4m3", "tensorwise"), ("fp8_e5m2", "tensorwise"), ("fp8_e4m3", "blockwise"))
    with threads(1):  # small elementwise work: one thread, steady on a busy machine
        return [row for kind, named in tensors.items() for row in _fp8_rows(kind, named, cases)]


def _fp8_rows(kind: str, named: dict[str, torch.Tensor],
              cases: tuple[tuple[str, str], ...]) -> list[dict]:
    spans = []
    for t in named.values():
        a = t.abs()[t != 0].float()
        low = a.kthvalue(max(1, math.ceil(0.001 * a.numel()))).values
        spans.append(math.log2(a.max().item() / low.item()))
    rows = []
    for fmt, recipe in cases:
        stats = [_fp8_stats(t, fmt, recipe) for t in named.values()]
        rows.append({"tensor": kind, "format": fmt,
                     "scaling": "per tensor" if recipe == "tensorwise" else "1 x 128 tiles",
                     "span (binades)": sum(spans) / len(spans),
                     "flushed to zero": sum(s[0] for s in stats) / len(stats),
                     "relative error": sum(s[1] for s in stats) / len(stats)})
    return rows


# ------------------------------------------------------------------------------------------------
# Which hardware runs which format
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Generation:
    """An accelerator generation: the formats its matrix units multiply natively (names of
    `trainbook.formats`; 'fp8' is both E4M3 and E5M2), the hardware-table entries built on it,
    and the source."""

    name: str
    vendor: str
    capability: tuple[int, int] | None  # CUDA compute capability (NVIDIA)
    formats: tuple[str, ...]
    specs: tuple[str, ...]
    source: str


_FP8 = ("fp8_e4m3", "fp8_e5m2")
_MX = ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4")
GENERATIONS: tuple[Generation, ...] = (
    Generation("Volta", "NVIDIA", (7, 0), ("fp16",), ("v100-sxm2-32gb",),
               "NVIDIA Tesla V100 GPU architecture whitepaper (first tensor cores: fp16)"),
    Generation("Turing", "NVIDIA", (7, 5), ("fp16",), ("t4",),
               "NVIDIA Turing architecture whitepaper (fp16 tensor cores; int8/int4 aside)"),
    Generation("Ampere", "NVIDIA", (8, 0), ("fp16", "bf16", "tf32"), ("a100-40gb", "a100-80gb"),
               "NVIDIA A100 tensor core GPU architecture whitepaper (adds bf16 and tf32)"),
    Generation("Ada Lovelace", "NVIDIA", (8, 9), ("fp16", "bf16", "tf32", *_FP8), ("l4",),
               "NVIDIA Ada GPU architecture whitepaper (fourth-generation tensor cores: fp8)"),
    Generation("Hopper", "NVIDIA", (9, 0), ("fp16", "bf16", "tf32", *_FP8),
               ("h100-sxm", "h100-pcie", "h200", "h20"),
               "NVIDIA H100 tensor core GPU architecture whitepaper (fp8 E4M3 and E5M2)"),
    Generation("Blackwell", "NVIDIA", (10, 0), ("fp16", "bf16", "tf32", *_FP8, *_MX, "nvfp4"),
               ("b200", "gb200-nvl72"),
               "NVIDIA Blackwell architecture technical brief (fifth-generation tensor cores: "
               "MXFP8, MXFP6, MXFP4 and NVFP4)"),
    Generation("CDNA 3", "AMD", None, ("fp16", "bf16", "tf32", "fp8 (FNUZ)"),
               ("mi300x", "mi325x"),
               "AMD CDNA 3 architecture whitepaper (fp8 in the FNUZ encodings, torch's "
               "float8_e4m3fnuz and float8_e5m2fnuz)"),
    Generation("CDNA 4", "AMD", None, ("fp16", "bf16", *_FP8, *_MX), ("mi355x",),
               "AMD CDNA 4 architecture whitepaper (OCP fp8, MXFP6 and MXFP4; no tf32 rate)"),
    Generation("TPU v5p, v6e", "Google", None, ("bf16",), ("tpu-v5p", "tpu-v6e"),
               "Google Cloud TPU documentation (bf16 matrix units; int8 aside)"),
)


def has_fp8(g: Generation) -> bool:
    return any(f.startswith(("fp8", "mxfp8")) for f in g.formats)


def generation_of(spec: str) -> Generation:
    """The generation an entry of the hardware table belongs to."""
    name = hardware.get(spec).name
    for g in GENERATIONS:
        if name in g.specs:
            return g
    raise ValueError(f"{name!r} is in no generation of precision.blocks.GENERATIONS; add it")


def generation_table() -> list[dict]:
    """One row per generation: its native formats, and for each of its hardware-table entries
    the dense bf16 and fp8 peaks (TFLOPS) as the table has them."""
    rows = []
    for g in GENERATIONS:
        for spec in g.specs:
            a = hardware.get(spec)
            bf16, fp8 = a.tflops.get("bf16"), a.tflops.get("fp8")
            rows.append({"generation": g.name, "accelerator": spec,
                         "native formats": ", ".join(g.formats),
                         "bf16 TFLOPS": bf16, "fp8 TFLOPS": fp8,
                         "fp8 / bf16": fp8 / bf16 if fp8 and bf16 else None})
    return rows


# ------------------------------------------------------------------------------------------------
# Memory
# ------------------------------------------------------------------------------------------------

def bits_per_value(name: str) -> float:
    """Storage per value of an element format (tf32 occupies 32) or a block format (its
    share of the block's scale included)."""
    if name in F.BLOCK_FORMATS:
        return F.BLOCK_FORMATS[name].bits_per_element
    return float(F.get(name).memory_bits)


def weight_memory(model: str | configs.ModelConfig = "llama-3-8b",
                  names: Sequence[str] = ("fp32", "bf16", "fp8_e4m3", "mxfp8_e4m3",
                                          "mxfp6_e2m3", "mxfp4", "nvfp4")) -> list[dict]:
    """GiB the model's parameters take when every one is stored in each format (scales of
    block formats included; NVFP4's one fp32 scale per tensor is left out, a few bytes)."""
    cfg = configs.resolve(model) if isinstance(model, str) else model
    n = configs.param_counts(cfg)["total"]
    return [{"format": name, "bits/value": bits_per_value(name),
             "bytes/parameter": bits_per_value(name) / 8,
             "weights (GiB)": n * bits_per_value(name) / 8 / GiB} for name in names]


def tiny_model(seed: int = 0, name: str = "tiny-llama") -> Transformer:
    """The reference model at initialisation, seeded (for `model_tensors`)."""
    torch.manual_seed(seed)
    return Transformer(configs.get(name))
