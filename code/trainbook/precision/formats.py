"""Number formats taken apart: bit patterns, the format table, rounding and overflow, TF32.

`trainbook.formats` defines every format by its bit fields and rounds to it; this module is the
chapter's view of them. `decode`/`encode` turn bit patterns into values and back for any format
(checked on every code against torch's and ml_dtypes' own decoding), `fields` spells one code
out, `bf16_bits` is the fp32 -> bf16 conversion as kernels write it (keep the top 16 bits, after
adding 0x7FFF plus the lowest kept bit: round to nearest even), `format_table` and
`library_check` tabulate the constants against `torch.finfo` and `ml_dtypes.finfo`,
`overflow_table` measures what each cast PyTorch and ml_dtypes offer does with a value past the
format's max, and `input_rounding_error` emulates TF32 (and bf16, fp16) matmul inputs.
Block formats, the FP8 split between E4M3 and E5M2, the hardware that runs each format and what
weights take in memory are in `trainbook.precision.blocks`.

Chapter: book/precision/formats.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from .. import formats as F

# Casts offered by the libraries: (library, dtype name). torch's float4_e2m1fn_x2 packs two
# values per byte and has no cast from float32, so it is not here.
TORCH_CASTS = ("float16", "bfloat16", "float8_e5m2", "float8_e4m3fn", "float8_e5m2fnuz",
               "float8_e4m3fnuz", "float8_e8m0fnu")
ML_DTYPES_CASTS = ("bfloat16", "float8_e5m2", "float8_e4m3fn", "float8_e4m3fnuz",
                   "float8_e5m2fnuz", "float6_e3m2fn", "float6_e2m3fn", "float4_e2m1fn",
                   "float8_e8m0fnu")
LIBRARIES = ("torch", "ml_dtypes")


def _ml_dtypes():
    try:
        import ml_dtypes
    except ImportError:
        raise ValueError("ml_dtypes is not installed: pip install ml_dtypes (it comes with "
                         "trainbook[notebook])") from None
    return ml_dtypes


# ------------------------------------------------------------------------------------------------
# Bit patterns
# ------------------------------------------------------------------------------------------------

def _codes(codes: torch.Tensor | Sequence[int] | int, f: F.FloatFormat) -> torch.Tensor:
    c = torch.as_tensor(codes, dtype=torch.int64)
    if c.numel() and (c.min() < 0 or c.max() >= 2 ** f.bits):
        raise ValueError(f"{f.name} codes are {f.bits}-bit: each must be in [0, {2 ** f.bits})")
    return c


def decode(codes: torch.Tensor | Sequence[int] | int, fmt: str | F.FloatFormat) -> torch.Tensor:
    """The values (float64) of bit patterns of `fmt`: sign, exponent field E, mantissa field M.
    Normal (E > 0): (-1)^s 2^(E - bias) (1 + M / 2^m); subnormal (E = 0): (-1)^s 2^emin M / 2^m;
    the top exponent holds inf and NaN ("ieee") or one NaN per sign ("fn"); E8M0 is 2^(E-127)."""
    f = F.get(fmt)
    c = _codes(codes, f)
    m = c & (2 ** f.man_bits - 1)
    e = (c >> f.man_bits) & (2 ** f.exp_bits - 1)
    one = torch.ones(c.shape, dtype=torch.float64)
    top = e == 2 ** f.exp_bits - 1
    if f.special == "e8m0":
        v = torch.ldexp(one, e - f.bias)
        return torch.where(top, torch.full_like(v, math.nan), v)
    frac = m.double() / 2 ** f.man_bits
    v = torch.where(e > 0, torch.ldexp(1 + frac, e - f.bias), torch.ldexp(frac, f.emin + 0 * e))
    if f.special == "ieee":
        v = torch.where(top, torch.where(m == 0, math.inf, math.nan), v)
    elif f.special == "fn":
        v = torch.where(top & (m == 2 ** f.man_bits - 1), math.nan, v)
    sign = (c >> (f.exp_bits + f.man_bits)) & 1
    return torch.where(sign == 1, -v, v)


def encode(x: torch.Tensor, fmt: str | F.FloatFormat) -> torch.Tensor:
    """The bit patterns (int64) of x rounded to `fmt` (round to nearest even, the format's own
    overflow rule); NaN becomes the format's canonical quiet NaN."""
    f = F.get(fmt)
    if not torch.is_floating_point(x):
        raise ValueError(f"encode takes a floating-point tensor, got {x.dtype}")
    q = F.quantize(x.detach().double(), f)
    a = q.abs()
    ok = torch.isfinite(a) & (a > 0)
    _, e2 = torch.frexp(torch.where(ok, a, torch.ones_like(a)))
    exp = e2 - 1  # floor(log2 a)
    if f.special == "e8m0":
        code = (exp + f.bias).clamp(0, 254)
        return torch.where(torch.isnan(q), torch.full_like(code, 255), code)
    normal = exp >= f.emin
    E = torch.where(normal & ok, exp + f.bias, torch.zeros_like(exp))
    scale = torch.where(normal, exp, torch.full_like(exp, f.emin))
    frac = torch.ldexp(torch.where(ok, a, torch.zeros_like(a)), f.man_bits - scale)
    M = torch.where(normal & ok, frac - 2 ** f.man_bits, frac).round().long()
    top = 2 ** f.exp_bits - 1
    if f.special == "ieee":
        E = torch.where(torch.isinf(q) | torch.isnan(q), torch.full_like(E, top), E)
        M = torch.where(torch.isnan(q), torch.full_like(M, 2 ** (f.man_bits - 1)),
                        torch.where(torch.isinf(q), torch.zeros_like(M), M))
    elif f.special == "fn":
        E = torch.where(torch.isnan(q), torch.full_like(E, top), E)
        M = torch.where(torch.isnan(q), torch.full_like(M, 2 ** f.man_bits - 1), M)
    sign = torch.signbit(q).long() if f.signed else torch.zeros_like(E)
    return (sign << (f.exp_bits + f.man_bits)) | (E << f.man_bits) | M


def fields(code: int, fmt: str | F.FloatFormat) -> dict:
    """One bit pattern spelt out: its bits grouped as sign | exponent | mantissa, the fields,
    what kind of value it is and the formula that gives its value."""
    f = F.get(fmt)
    c = int(_codes(code, f))
    bits = format(c, f"0{f.bits}b")
    s, e, m = (bits[:1], bits[1:1 + f.exp_bits], bits[1 + f.exp_bits:]) if f.signed else \
        ("", bits[:f.exp_bits], bits[f.exp_bits:])
    E, M = int(e, 2), int(m, 2) if m else 0
    value = decode(c, f).item()
    sign = "-" if s == "1" else "+"
    if math.isnan(value) or math.isinf(value):
        kind, formula = ("NaN" if math.isnan(value) else "infinity"), "special"
    elif f.special == "e8m0":
        kind, formula = "power of two", f"2^({E} - {f.bias})"
    elif E == 0:
        kind = "zero" if M == 0 else "subnormal"
        formula = f"{sign}2^{f.emin} x {M}/{2 ** f.man_bits}"
    else:
        kind, formula = "normal", f"{sign}2^({E} - {f.bias}) x (1 + {M}/{2 ** f.man_bits})"
    return {"format": f.name, "code": f"0x{c:0{(f.bits + 3) // 4}X}",
            "bits": " ".join(p for p in (s, e, m) if p), "exponent field": E,
            "mantissa field": M, "kind": kind, "formula": formula, "value": value}


def bf16_bits(x: torch.Tensor, rounding: str = "nearest") -> torch.Tensor:
    """fp32 -> bf16 as kernels write it, on the bit patterns (int64 codes 0..65535).

    bf16 is the top 16 bits of fp32 (same sign and 8-bit exponent, the first 7 mantissa bits),
    so 'truncate' is a shift right by 16. 'nearest' first adds 0x7FFF plus the lowest bit that is
    kept: anything above half of the dropped 16 bits carries into the kept part, exactly half
    carries only when the kept part is odd (ties to even). NaN becomes a quiet NaN either way
    (truncating a NaN whose payload sits in the low bits would give an infinity)."""
    if rounding not in ("nearest", "truncate"):
        raise ValueError(f"rounding must be 'nearest' or 'truncate', got {rounding!r}")
    if x.dtype != torch.float32:
        raise ValueError(f"bf16_bits takes a float32 tensor, got {x.dtype}")
    b = x.view(torch.int32).long() & 0xFFFFFFFF
    if rounding == "nearest":
        b = b + 0x7FFF + ((b >> 16) & 1)
    out = (b >> 16) & 0xFFFF
    quiet_nan = ((x.view(torch.int32).long() >> 16) & 0x8000) | 0x7FC0
    return torch.where(torch.isnan(x), quiet_nan, out)


def spacing(x: torch.Tensor, fmt: str | F.FloatFormat) -> torch.Tensor:
    """The gap between consecutive values of `fmt` at |x| (float64): 2^(e - m) with e the
    exponent of x's binade, never below the subnormals' gap 2^(emin - m). 1 + eps is the value
    after 1; at 256 the gap in bf16 is 2, so 256 + 1 is a tie and rounds back to 256."""
    f = F.get(fmt)
    a = x.detach().double().abs()
    _, e = torch.frexp(torch.where(a > 0, a, torch.ones_like(a)))
    e = torch.where(a > 0, e - 1, torch.full_like(e, f.emin)).clamp(min=f.emin)
    return torch.ldexp(torch.ones_like(a), e - f.man_bits)


# ------------------------------------------------------------------------------------------------
# The table, against the libraries
# ------------------------------------------------------------------------------------------------

def format_table(names: Sequence[str] | None = None) -> list[dict]:
    """One row per element format, every number computed from the bit fields: range (max, the
    smallest normal and subnormal), precision (eps, decimal digits (m + 1) log10 2) and the
    dynamic range in binades (powers of two from the smallest subnormal to the max)."""
    rows = []
    for name in names or list(F.FORMATS):
        f = F.get(name)
        rows.append({
            "format": f.name, "bits": f.memory_bits, "layout": (
                f"{'S ' if f.signed else ''}E{f.exp_bits} M{f.man_bits}"),
            "bias": f.bias, "max": f.max, "min normal": f.min_normal,
            "min subnormal": f.min_subnormal, "eps": f.eps,
            "decimal digits": (f.man_bits + 1) * math.log10(2),
            "binades": math.log2(f.max / f.min_subnormal),
            "inf": f.has_inf, "NaN": f.has_nan,
            "torch": f.torch_dtype, "ml_dtypes": f.ml_dtype})
    return rows


def _finfo(library: str, dtype_name: str) -> dict[str, float]:
    if library == "torch":
        fi = torch.finfo(getattr(torch, dtype_name))
        return {"bits": fi.bits, "max": fi.max, "min normal": fi.smallest_normal, "eps": fi.eps}
    if library == "numpy":
        fi = np.finfo(getattr(np, dtype_name))
    else:
        fi = _ml_dtypes().finfo(getattr(_ml_dtypes(), dtype_name))
    return {"bits": int(fi.bits), "max": float(fi.max), "min normal": float(fi.smallest_normal),
            "min subnormal": float(fi.smallest_subnormal), "eps": float(fi.eps)}


def library_check(names: Sequence[str] | None = None) -> list[dict]:
    """Every constant of `format_table` that torch.finfo, numpy.finfo (fp32, fp16) or
    ml_dtypes.finfo defines for the same format, side by side with ours."""
    rows = []
    for name in names or list(F.FORMATS):
        f = F.get(name)
        sources = [("torch", f.torch_dtype), ("ml_dtypes", f.ml_dtype)]
        if f.name in ("fp32", "fp16"):
            sources.append(("numpy", {"fp32": "float32", "fp16": "float16"}[f.name]))
        ours = {"bits": f.bits, "max": f.max, "min normal": f.min_normal,
                "min subnormal": f.min_subnormal, "eps": f.eps}
        for library, dtype_name in sources:
            if dtype_name is None:
                continue
            for field, theirs in _finfo(library, dtype_name).items():
                rows.append({"format": f.name, "library": f"{library}.{dtype_name}",
                             "field": field, "ours": ours[field], "theirs": theirs,
                             "equal": ours[field] == theirs})
    return rows


# ------------------------------------------------------------------------------------------------
# Overflow: what each cast does past the max
# ------------------------------------------------------------------------------------------------

def overflow_probes(max_value: float, eps: float) -> dict[str, float]:
    """Inputs around and past a format's max: max itself, max + a quarter of the top spacing
    (rounds back to max), max + half the spacing (the tie: IEEE rounding goes up, to overflow,
    when max's last mantissa bit is odd), twice the max, -2 max, inf and NaN. Inputs that
    fp32 cannot hold are left out (None)."""
    gap = 2.0 ** math.floor(math.log2(max_value)) * eps
    probes = {"max": max_value, "max + gap/4": max_value + gap / 4,
              "max + gap/2": max_value + gap / 2, "2 max": 2 * max_value,
              "-2 max": -2 * max_value, "inf": math.inf, "nan": math.nan}
    fp32_max = torch.finfo(torch.float32).max
    return {k: (v if not math.isfinite(v) or abs(v) <= fp32_max else None)
            for k, v in probes.items()}


def _cast(values: list[float], library: str, name: str, device: str) -> list[float]:
    x = torch.tensor(values, dtype=torch.float32, device=device)
    if library == "torch":
        return x.to(getattr(torch, name)).float().cpu().tolist()
    md = _ml_dtypes()
    with np.errstate(all="ignore"):
        return x.cpu().numpy().astype(getattr(md, name)).astype(np.float32).tolist()


def classify(result: float, max_value: float) -> str:
    """What an overflowing input became: 'inf', 'nan', 'saturate' (the max), or the value."""
    if math.isnan(result):
        return "nan"
    if math.isinf(result):
        return "inf"
    return "saturate" if abs(result) == max_value else f"{result:g}"


def overflow_table(libraries: Sequence[str] = LIBRARIES, device: str = "cpu") -> list[dict]:
    """Measure each cast on the probes of `overflow_probes` (its own max and eps from its
    finfo): one row per cast, the value each probe became, and the rule the cast follows for
    finite overflow ('2 max', or 'max + gap/2' where 2 max is beyond fp32) and for inf.
    A probe fp32 cannot hold is shown as '-'."""
    rows = []
    for library in libraries:
        if library not in LIBRARIES:
            raise ValueError(f"library must be one of {', '.join(LIBRARIES)}, got {library!r}")
        names = TORCH_CASTS if library == "torch" else ML_DTYPES_CASTS
        for name in names:
            fi = _finfo(library, name)
            probes = overflow_probes(fi["max"], fi["eps"])
            keys = [k for k, v in probes.items() if v is not None]
            got = dict(zip(keys, _cast([probes[k] for k in keys], library, name, device)))
            finite_over = got.get("2 max", got["max + gap/2"])
            rows.append({"library": library, "dtype": name, "max": fi["max"],
                         **{k: got.get(k, "-") for k in probes},  # "-": beyond fp32
                         "overflow": classify(finite_over, fi["max"]),
                         "inf becomes": classify(got["inf"], fi["max"]),
                         "nan becomes": classify(got["nan"], fi["max"])})
    return rows


# ------------------------------------------------------------------------------------------------
# TF32 and other matmul inputs
# ------------------------------------------------------------------------------------------------

def rounded_matmul(a: torch.Tensor, b: torch.Tensor, fmt: str) -> torch.Tensor:
    """a @ b with both inputs rounded to `fmt` and the products summed exactly (float64), as a
    tensor core reading fp32 and rounding its inputs to tf32 (or bf16, fp16) does before it
    accumulates in fp32: the error is the inputs' rounding alone. The hardware's rounding
    mode for tf32 inputs is not documented; this rounds to nearest even."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"need (m, k) @ (k, n) matrices, got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    return F.quantize(a.double(), fmt) @ F.quantize(b.double(), fmt)


def input_rounding_error(a: torch.Tensor, b: torch.Tensor,
                         names: Sequence[str] = ("fp32", "tf32", "bf16", "fp16")) -> dict:
    """Relative error ||C_fmt - C|| / ||C|| (Frobenius) of a @ b with inputs rounded to each
    format, against the exact product of the unrounded inputs."""
    exact = a.double() @ b.double()
    return {n: ((rounded_matmul(a, b, n) - exact).norm() / exact.norm()).item() for n in names}


def cpu_matmul_precision_modes(n: int = 256, seed: int = 0) -> dict[str, dict]:
    """What torch.set_float32_matmul_precision does to an fp32 matmul on this CPU: for each
    mode, whether the result changed from 'highest' and whether it equals the fp32 matmul of
    bf16-rounded inputs (oneDNN on a CPU with AMX may compute 'medium' in bf16). The setting is
    restored afterwards."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    before = torch.get_float32_matmul_precision()
    out = {}
    try:
        torch.set_float32_matmul_precision("highest")
        ref = a @ b
        bf16_inputs = a.bfloat16().float() @ b.bfloat16().float()
        for mode in ("high", "medium"):
            torch.set_float32_matmul_precision(mode)
            y = a @ b
            out[mode] = {"changed": not torch.equal(y, ref),
                         "max |difference|": (y - ref).abs().max().item(),
                         "like bf16 inputs": (y - bf16_inputs).abs().max().item()
                         < 1e-3 * (bf16_inputs - ref).abs().max().item()}
    finally:
        torch.set_float32_matmul_precision(before)
    return out


def flush_denormal_effect(value: float = 1e-40) -> dict[str, object]:
    """What torch.set_flush_denormal(True) does on this CPU to an fp32 subnormal: whether the
    CPU supports it (x86 with SSE3: the FTZ and DAZ flags), and what `value` times one becomes
    with it on and off. The setting is off again afterwards."""
    if not 0 < abs(value) < torch.finfo(torch.float32).tiny:
        raise ValueError(f"value must be an fp32 subnormal (0 < |value| < 1.18e-38), got {value}")
    x = torch.tensor([value])
    off = (x * 1.0).item()
    supported = torch.set_flush_denormal(True)
    try:
        on = (torch.tensor([value]) * 1.0).item()
    finally:
        torch.set_flush_denormal(False)
    return {"supported": supported, "value": value, "flush off": off, "flush on": on}
