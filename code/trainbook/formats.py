"""Number formats: the floating-point and block-scaled formats training uses, and rounding to them.

One table of formats (`FORMATS`: fp32, tf32, fp16, bf16, the fp8, fp6 and fp4 element formats and
the E8M0 scale) and of block formats (`BLOCK_FORMATS`: MXFP8, MXFP6, MXFP4, NVFP4), each defined by
its bit fields, so max, min normal, min subnormal and epsilon are computed, not typed. `quantize`
rounds fp32 values to any of them (round to nearest even, or stochastically) with the overflow
behaviour you ask for; `block_quantize` applies a block format's shared scales. Both compute in
float64, where every step is exact, so they run on any CPU at fp32 speed and agree bit for bit
with PyTorch's casts and ml_dtypes wherever those define the format (tests/test_formats.py).

This is the one place for format constants: the precision chapters, the FP8 emulation of the
trainer and the memory estimator's bytes per element all read them here.

Chapter: book/precision/formats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

OVERFLOWS = ("saturate", "inf", "nan")


@dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point format: sign, `exp_bits` of exponent, `man_bits` of mantissa.

    `special` says which encodings are not finite numbers: "ieee" (the top exponent holds inf and
    NaN: fp32, fp16, bf16, E5M2), "fn" (finite, one NaN: only all-ones exponent and mantissa, as
    E4M3FN), "none" (every encoding a number: the fp6 and fp4 formats) or "e8m0" (unsigned powers
    of two, all-ones is NaN). `torch_dtype` and `ml_dtype` name the library types where they
    exist (ml_dtypes leaves fp32 and fp16 to numpy)."""

    name: str
    exp_bits: int
    man_bits: int
    special: str = "ieee"
    signed: bool = True
    torch_dtype: str | None = None
    ml_dtype: str | None = None
    storage_bits: int | None = None  # bits a value occupies in memory (tf32 lives in 32)

    @property
    def bits(self) -> int:
        """Bits of the encoding: sign + exponent + mantissa."""
        return int(self.signed) + self.exp_bits + self.man_bits

    @property
    def bias(self) -> int:
        return 2 ** (self.exp_bits - 1) - 1

    @property
    def emax(self) -> int:
        """Exponent of the largest finite value: the top exponent code is reserved under "ieee"."""
        top = 2 ** self.exp_bits - 1
        return top - self.bias - (1 if self.special == "ieee" else 0)

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal value (E8M0 has no subnormals: code 0 is 2^-127)."""
        return -self.bias if self.special == "e8m0" else 1 - self.bias

    @property
    def max(self) -> float:
        frac = 2 - 2.0 ** -self.man_bits  # 1.11...1
        if self.special == "fn":  # the all-ones mantissa at the top exponent is NaN
            frac -= 2.0 ** -self.man_bits
        if self.special == "e8m0":
            return 2.0 ** (2 ** self.exp_bits - 2 - self.bias)  # 0xFF is NaN
        return math.ldexp(frac, self.emax)

    @property
    def min_normal(self) -> float:
        return math.ldexp(1.0, self.emin)

    @property
    def min_subnormal(self) -> float:
        return self.min_normal if self.special == "e8m0" else \
            math.ldexp(1.0, self.emin - self.man_bits)

    @property
    def eps(self) -> float:
        """The gap from 1 to the next larger value: 2^-man_bits (the unit roundoff is half)."""
        return 2.0 ** -self.man_bits

    @property
    def has_inf(self) -> bool:
        return self.special == "ieee"

    @property
    def has_nan(self) -> bool:
        return self.special != "none"

    @property
    def default_overflow(self) -> str:
        """What an overflowing value becomes in an IEEE-style cast: inf where the format has one,
        else NaN where it has one, else the largest value."""
        return "inf" if self.has_inf else ("nan" if self.has_nan else "saturate")

    @property
    def memory_bits(self) -> int:
        return self.storage_bits or self.bits


@dataclass(frozen=True)
class BlockFormat:
    """Elements of `element` format sharing one `scale` per `block` consecutive values (OCP MX
    v1.0: E8M0 scales, blocks of 32; NVFP4: E4M3 scales, blocks of 16, plus one fp32 scale per
    tensor)."""

    name: str
    element: str
    scale: str
    block: int
    tensor_scale: bool = False

    @property
    def bits_per_element(self) -> float:
        """Storage per value, the block's scale shared out (the tensor scale is negligible)."""
        return FORMATS[self.element].bits + FORMATS[self.scale].bits / self.block


FORMATS: dict[str, FloatFormat] = {f.name: f for f in [
    FloatFormat("fp32", 8, 23, torch_dtype="float32"),
    FloatFormat("tf32", 8, 10, storage_bits=32),  # tensor cores read fp32 and round to this
    FloatFormat("fp16", 5, 10, torch_dtype="float16"),
    FloatFormat("bf16", 8, 7, torch_dtype="bfloat16", ml_dtype="bfloat16"),
    FloatFormat("fp8_e4m3", 4, 3, "fn", torch_dtype="float8_e4m3fn", ml_dtype="float8_e4m3fn"),
    FloatFormat("fp8_e5m2", 5, 2, torch_dtype="float8_e5m2", ml_dtype="float8_e5m2"),
    FloatFormat("fp6_e3m2", 3, 2, "none", ml_dtype="float6_e3m2fn"),
    FloatFormat("fp6_e2m3", 2, 3, "none", ml_dtype="float6_e2m3fn"),
    FloatFormat("fp4_e2m1", 2, 1, "none", ml_dtype="float4_e2m1fn"),
    FloatFormat("e8m0", 8, 0, "e8m0", signed=False, torch_dtype="float8_e8m0fnu",
                ml_dtype="float8_e8m0fnu"),
]}

BLOCK_FORMATS: dict[str, BlockFormat] = {b.name: b for b in [
    BlockFormat("mxfp8_e4m3", "fp8_e4m3", "e8m0", 32),
    BlockFormat("mxfp8_e5m2", "fp8_e5m2", "e8m0", 32),
    BlockFormat("mxfp6_e3m2", "fp6_e3m2", "e8m0", 32),
    BlockFormat("mxfp6_e2m3", "fp6_e2m3", "e8m0", 32),
    BlockFormat("mxfp4", "fp4_e2m1", "e8m0", 32),
    BlockFormat("nvfp4", "fp4_e2m1", "fp8_e4m3", 16, tensor_scale=True),
]}


def get(name: str | FloatFormat) -> FloatFormat:
    """A format by name ('bf16', 'fp8_e4m3', ...), or the format itself."""
    if isinstance(name, FloatFormat):
        return name
    if name not in FORMATS:
        raise ValueError(f"unknown number format {name!r}; choose one of {', '.join(FORMATS)}")
    return FORMATS[name]


def get_block(name: str | BlockFormat) -> BlockFormat:
    if isinstance(name, BlockFormat):
        return name
    if name not in BLOCK_FORMATS:
        raise ValueError(f"unknown block format {name!r}; choose one of "
                         f"{', '.join(BLOCK_FORMATS)}")
    return BLOCK_FORMATS[name]


def quantize(x: torch.Tensor, fmt: str | FloatFormat, overflow: str | None = None,
             stochastic: bool = False, generator: torch.Generator | None = None,
             truncate: bool = False) -> torch.Tensor:
    """`x` rounded to `fmt`, returned in x's dtype (float32 or float64).

    Round to nearest, ties to even (IEEE 754's default), or stochastically: up with probability
    equal to the distance from the value below, in units of the spacing, so the rounding is
    unbiased on average; or, with `truncate`, toward zero (the bits below the format's last
    mantissa bit dropped: fp32 -> bf16 by truncation, a limited-precision accumulator that
    chops). Values whose rounded magnitude exceeds the format's max become the max
    ("saturate"), inf ("inf") or NaN ("nan"); the default is the format's `default_overflow`.
    NaN stays NaN; formats without NaN (fp6, fp4) have no right answer, and here it becomes the
    max, so that it stays visible (ml_dtypes makes it a zero). An infinite input follows the
    overflow rule."""
    f = get(fmt)
    overflow = overflow or f.default_overflow
    if overflow not in OVERFLOWS:
        raise ValueError(f"overflow must be one of {', '.join(OVERFLOWS)}, got {overflow!r}")
    if overflow == "inf" and not f.has_inf:
        raise ValueError(f"{f.name} has no infinity; use overflow='saturate' or 'nan'")
    if overflow == "nan" and not f.has_nan:
        raise ValueError(f"{f.name} has no NaN; use overflow='saturate'")
    if stochastic and truncate:
        raise ValueError("choose one rounding: stochastic=True or truncate=True, not both")
    if not torch.is_floating_point(x) or x.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"quantize takes float32 or float64 tensors, got {x.dtype}; "
                         "convert with .float() first")
    xd = x.detach().double()
    a = xd.abs()
    finite = torch.isfinite(a)
    a0 = torch.where(finite, a, torch.zeros_like(a))
    _, e = torch.frexp(a0)  # a = m * 2^e, m in [0.5, 1): floor(log2 a) = e - 1
    e = (e - 1).clamp(min=f.emin)  # subnormals share the smallest normal's spacing
    quantum = torch.ldexp(torch.ones_like(a0), e - f.man_bits)
    scaled = a0 / quantum  # exact: a power-of-two scaling in float64
    if stochastic:
        u = torch.rand(scaled.shape, generator=generator, dtype=torch.float64)
        q = torch.floor(scaled + u.to(scaled.device))
    elif truncate:
        q = torch.floor(scaled)  # scaled >= 0: toward zero
    else:
        q = torch.round(scaled)  # half to even
    q = q * quantum
    if f.special == "e8m0":  # powers of two from 2^-127 up: 0 and tiny values become the least
        q = q.clamp(min=f.min_normal)
    over = (q > f.max) | ~finite
    big = {"saturate": f.max, "inf": math.inf, "nan": math.nan}[overflow]
    q = torch.where(over, torch.full_like(q, big), q)
    if f.has_nan:
        q = torch.where(torch.isnan(xd), torch.full_like(q, math.nan), q)
    if not f.signed:
        q = torch.where(xd < 0, torch.full_like(q, math.nan), q)
        return q.to(x.dtype)
    return torch.copysign(q, xd).to(x.dtype)  # -0.0 stays -0.0


SCALE_ROUNDINGS = ("floor", "ceil")


def block_scales(x: torch.Tensor, bfmt: str | BlockFormat,
                 scale_rounding: str = "floor") -> torch.Tensor:
    """One scale per block of the last dimension (which must divide into blocks), as the format
    computes it. MX (OCP MX v1.0, Section 6.3): 2^(floor(log2 amax) - emax of the element), an
    E8M0 power of two, so the block's largest value lands in the element's top binade (and
    clips when it lands above the element's max); `scale_rounding="ceil"` takes instead
    2^ceil(log2(amax / element max)), the smallest power of two that fits the block without
    clipping (Mishra et al. 2025's round-up of the scale; Blackwell's cvt.rp to ue8m0). NVFP4:
    amax / 6 rounded to E4M3 (the element's max maps to the block's max)."""
    b = get_block(bfmt)
    if scale_rounding not in SCALE_ROUNDINGS:
        raise ValueError(f"scale_rounding must be one of {', '.join(SCALE_ROUNDINGS)}, "
                         f"got {scale_rounding!r}")
    if scale_rounding != "floor" and b.scale != "e8m0":
        raise ValueError(f"scale_rounding applies to the power-of-two (E8M0) scales of MX "
                         f"formats; {b.name}'s scales are {b.scale}")
    if x.shape[-1] % b.block:
        raise ValueError(f"the last dimension ({x.shape[-1]}) must be a multiple of "
                         f"{b.name}'s block of {b.block}; pad it")
    amax = x.detach().double().reshape(*x.shape[:-1], -1, b.block).abs().amax(-1)
    elem = FORMATS[b.element]
    if b.scale == "e8m0":
        if scale_rounding == "ceil":
            m, e = torch.frexp(amax / elem.max)  # amax / max = m 2^e, m in [0.5, 1)
            exp = torch.where(m > 0.5, e, e - 1)  # ceil(log2(amax / max))
        else:
            _, e = torch.frexp(amax)
            exp = e - 1 - elem.emax
        exp = torch.where(amax > 0, exp, torch.zeros_like(exp))
        return torch.ldexp(torch.ones_like(amax), exp.clamp(-127, 127))
    return quantize(amax / elem.max, b.scale, overflow="saturate").clamp(
        min=FORMATS[b.scale].min_subnormal)


def block_quantize(x: torch.Tensor, bfmt: str | BlockFormat,
                   stochastic: bool = False,
                   generator: torch.Generator | None = None,
                   scale_rounding: str = "floor") -> torch.Tensor:
    """`x` stored in a block format and read back (dequantised), in x's dtype. Elements are
    divided by their block's scale and rounded to the element format with saturation, as the MX
    specification and NVFP4 recipes convert; NVFP4 first divides by a per-tensor fp32 scale that
    puts the tensor's amax at the largest block scale times the element max. `scale_rounding`:
    see `block_scales`."""
    b = get_block(bfmt)
    xd = x.double()
    tensor_scale = 1.0
    if b.tensor_scale:
        amax = xd.abs().max().item()
        top = FORMATS[b.scale].max * FORMATS[b.element].max
        tensor_scale = amax / top if amax > 0 else 1.0
        xd = xd / tensor_scale
    scales = block_scales(xd, b, scale_rounding)
    blocks = xd.reshape(*x.shape[:-1], -1, b.block)
    q = quantize(blocks / scales[..., None], b.element, overflow="saturate",
                 stochastic=stochastic, generator=generator)
    return (q * scales[..., None] * tensor_scale).reshape(x.shape).to(x.dtype)
