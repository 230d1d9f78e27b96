"""trainbook.formats against the libraries that define the formats: torch's dtypes and casts,
ml_dtypes' types and finfo, bit for bit on random bit patterns; block formats by their spec."""

import math

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainbook import formats as F

TORCH_CAST = {  # format -> the overflow rule PyTorch's CPU cast follows (measured, torch 2.13)
    "fp16": "inf", "bf16": "inf", "fp8_e5m2": "inf",
    "fp8_e4m3": "saturate",  # E4M3FN has no inf; torch clamps to +-448, inf included
    "e8m0": "nan",
}


def random_floats(n: int, seed: int = 0) -> torch.Tensor:
    """Every kind of fp32 value: random bit patterns (NaNs, infs, subnormals, both zeros)."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-2**31, 2**31 - 1, (n,), generator=g, dtype=torch.int64)
    return bits.to(torch.int32).view(torch.float32)


def same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Equal values with equal signs of zero, NaN equal to NaN."""
    both_nan = a.isnan() & b.isnan()
    return both_nan | ((a == b) & (torch.signbit(a) == torch.signbit(b)))


@pytest.mark.parametrize("name", list(TORCH_CAST))
def test_quantize_is_torchs_cast_bit_for_bit(name):
    f = F.FORMATS[name]
    x = random_floats(400_000)
    ref = x.to(getattr(torch, f.torch_dtype)).float()
    q = F.quantize(x, name, overflow=TORCH_CAST[name])
    if not f.signed:  # e8m0 holds positive normal values; torch rounds fp32 subnormals
        keep = x >= torch.finfo(torch.float32).tiny  # differently from ml_dtypes and IEEE
        x, q, ref = x[keep], q[keep], ref[keep]
    bad = ~same(q, ref)
    assert not bad.any(), (x[bad][:5], q[bad][:5], ref[bad][:5])


@pytest.mark.parametrize("name", [n for n, f in F.FORMATS.items() if f.ml_dtype])
def test_quantize_is_ml_dtypes_cast_bit_for_bit(name):
    f = F.FORMATS[name]
    x = random_floats(400_000, seed=1)
    if not f.has_nan:  # ml_dtypes turns NaN into a zero where the format has no NaN
        x = x[~x.isnan()]
    with np.errstate(all="ignore"):
        ref = torch.from_numpy(x.numpy().astype(getattr(ml_dtypes, f.ml_dtype))
                               .astype(np.float32))
    q = F.quantize(x, name)
    if not f.signed:
        q, ref = q[x > 0], ref[x > 0]
    assert same(q, ref).all()


@pytest.mark.parametrize("name", list(F.FORMATS))
def test_constants_match_finfo(name):
    f = F.FORMATS[name]
    if f.torch_dtype:
        fi = torch.finfo(getattr(torch, f.torch_dtype))
        assert (fi.bits, fi.max, fi.smallest_normal, fi.eps) == \
            (f.bits, f.max, f.min_normal, f.eps)
    if f.ml_dtype:
        fi = ml_dtypes.finfo(getattr(ml_dtypes, f.ml_dtype))
        assert (fi.bits, float(fi.max), float(fi.smallest_normal),
                float(fi.smallest_subnormal), float(fi.eps)) == \
            (f.bits, f.max, f.min_normal, f.min_subnormal, f.eps)
    assert f.torch_dtype or f.ml_dtype or f.name == "tf32"


def test_tf32_keeps_ten_mantissa_bits():
    x = torch.tensor([1 + 2**-10, 1 + 2**-11, 1 + 3 * 2**-11, torch.finfo(torch.float32).max])
    assert F.quantize(x, "tf32").tolist() == [1 + 2**-10, 1.0, 1 + 2**-9, math.inf]


@settings(max_examples=300, deadline=None)
@given(st.floats(width=32, allow_nan=False), st.sampled_from(list(F.FORMATS)))
def test_rounding_lands_on_a_value_within_half_a_spacing(v, name):
    """The result is a value of the format (rounding it again changes nothing) and no further
    from v than half the spacing of v's binade, or v overflowed to the max."""
    f = F.FORMATS[name]
    if not f.signed and v <= 0:
        return
    q = F.quantize(torch.tensor([v], dtype=torch.float64), name, overflow="saturate").item()
    assert F.quantize(torch.tensor([q], dtype=torch.float64), name, overflow="saturate").item() == q
    if abs(v) >= f.max:
        assert abs(q) == f.max
        return
    e = max(math.frexp(abs(v))[1] - 1, f.emin) if v else f.emin
    assert abs(q - v) <= math.ldexp(1, e - f.man_bits) / 2 or (f.special == "e8m0" and
                                                                 v < f.min_normal)


def test_stochastic_rounding_is_unbiased_and_lands_on_neighbours():
    x = torch.full((200_000,), 1 + 2**-9, dtype=torch.float32)  # a quarter of bf16's spacing
    q = F.quantize(x, "bf16", stochastic=True, generator=torch.Generator().manual_seed(0))
    assert set(q.unique().tolist()) == {1.0, 1 + 2**-7}
    assert abs((q.double().mean() - (1 + 2**-9)).item()) < 4 * 2**-7 / math.sqrt(len(x))
    assert (F.quantize(x, "bf16") == 1.0).all()  # nearest rounding loses it every time


def test_bits_per_element_of_block_formats():
    got = {n: b.bits_per_element for n, b in F.BLOCK_FORMATS.items()}
    assert got == {"mxfp8_e4m3": 8.25, "mxfp8_e5m2": 8.25, "mxfp6_e3m2": 6.25,
                   "mxfp6_e2m3": 6.25, "mxfp4": 4.25, "nvfp4": 4.5}


def test_mx_scale_puts_the_block_max_in_the_top_binade():
    g = torch.Generator().manual_seed(0)
    spread = torch.logspace(-20, 20, 64, dtype=torch.float64)[:, None]
    x = torch.randn(64, 256, generator=g, dtype=torch.float64) * spread
    for name in ("mxfp8_e4m3", "mxfp4"):
        b = F.BLOCK_FORMATS[name]
        s = F.block_scales(x, name)
        amax = x.reshape(64, -1, b.block).abs().amax(-1)
        top = F.FORMATS[b.element].emax
        assert torch.equal(torch.floor(torch.log2(amax / s)), torch.full_like(s, top))
        assert torch.equal(torch.log2(s), torch.round(torch.log2(s)))  # powers of two


def test_block_quantize_error_shrinks_with_more_bits():
    x = torch.randn(16, 1024, generator=torch.Generator().manual_seed(0))
    err = {n: ((F.block_quantize(x, n) - x).norm() / x.norm()).item() for n in F.BLOCK_FORMATS}
    assert err["mxfp8_e4m3"] < err["mxfp6_e3m2"] < err["mxfp4"] < 0.2
    assert err["mxfp6_e2m3"] < err["mxfp6_e3m2"]  # in a scaled block, mantissa beats range
    assert err["nvfp4"] < err["mxfp4"]  # finer blocks, finer (E4M3) scales


def test_bad_input_says_what_to_do():
    with pytest.raises(ValueError, match="unknown number format 'fp7'"):
        F.quantize(torch.ones(2), "fp7")
    with pytest.raises(ValueError, match="has no infinity"):
        F.quantize(torch.ones(2), "fp8_e4m3", overflow="inf")
    with pytest.raises(ValueError, match="has no NaN"):
        F.quantize(torch.ones(2), "fp4_e2m1", overflow="nan")
    with pytest.raises(ValueError, match="overflow must be one of"):
        F.quantize(torch.ones(2), "bf16", overflow="wrap")
    with pytest.raises(ValueError, match="float32 or float64"):
        F.quantize(torch.ones(2, dtype=torch.int64), "bf16")
    with pytest.raises(ValueError, match="multiple of mxfp4's block of 32"):
        F.block_quantize(torch.ones(2, 40), "mxfp4")
    with pytest.raises(ValueError, match="unknown block format"):
        F.block_quantize(torch.ones(2, 32), "mxfp5")
