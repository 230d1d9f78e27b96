"""The formats chapter's code (trainbook.precision.formats, .blocks, the `formats` command):
bit patterns decoded and encoded as torch and ml_dtypes do, on every code; the table against
the libraries; the overflow rules measured from the casts; block against tensor scaling; the
hardware generations against the hardware table."""

import json
import math

import ml_dtypes
import numpy as np
import pytest
import torch

from trainbook import configs, hardware
from trainbook import formats as F
from trainbook.__main__ import main
from trainbook.compute import memory
from trainbook.nb import gpu_matmul_dtypes
from trainbook.precision import blocks as B
from trainbook.precision import formats as PF

# format -> (library view of its codes: a function of an int64 tensor of codes -> float64)
VIEWS = {
    "fp16": lambda c: c.to(torch.int16).view(torch.float16).double(),
    "bf16": lambda c: c.to(torch.int16).view(torch.bfloat16).double(),
    "fp8_e4m3": lambda c: c.to(torch.uint8).view(torch.float8_e4m3fn).double(),
    "fp8_e5m2": lambda c: c.to(torch.uint8).view(torch.float8_e5m2).double(),
    "e8m0": lambda c: c.to(torch.uint8).view(torch.float8_e8m0fnu).double(),
    **{name: (lambda c, t=t: torch.from_numpy(c.numpy().astype(np.uint8).view(
        getattr(ml_dtypes, t)).astype(np.float64)))
       for name, t in (("fp6_e3m2", "float6_e3m2fn"), ("fp6_e2m3", "float6_e2m3fn"),
                       ("fp4_e2m1", "float4_e2m1fn"))},
}


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, equal signs of zero, NaN where NaN."""
    both_nan = a.isnan() & b.isnan()
    return bool((both_nan | ((a == b) & (torch.signbit(a) == torch.signbit(b)))).all())


@pytest.mark.parametrize("name", list(VIEWS))
def test_decode_is_the_librarys_view_of_every_code(name):
    f = F.FORMATS[name]
    codes = torch.arange(2 ** f.bits)
    assert same(PF.decode(codes, name), VIEWS[name](codes))


@pytest.mark.parametrize("name", [n for n in F.FORMATS if F.FORMATS[n].bits <= 16])
def test_encode_inverts_decode_on_every_number(name):
    f = F.FORMATS[name]
    codes = torch.arange(2 ** f.bits)
    values = PF.decode(codes, name)
    keep = ~values.isnan()
    assert torch.equal(PF.encode(values[keep], name), codes[keep])
    assert PF.decode(PF.encode(torch.tensor([math.nan]), name), name).isnan().all() \
        or not f.has_nan


def test_fp32_codes_round_trip_on_random_bit_patterns():
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 2**32, (200_000,), generator=g, dtype=torch.int64)
    values = bits.to(torch.int32).view(torch.float32)  # wraps to the same 32 bits
    finite = ~values.isnan()
    assert same(PF.decode(bits, "fp32"), values.double())
    assert torch.equal(PF.encode(values[finite], "fp32"), bits[finite])


def test_fields_spell_out_pi():
    pi32 = PF.fields(0x40490FDB, "fp32")
    assert pi32["bits"] == "0 10000000 10010010000111111011011"
    assert pi32["value"] == torch.tensor(math.pi, dtype=torch.float32).item()
    pi16 = PF.fields(0x4049, "bf16")
    assert (pi16["bits"], pi16["value"], pi16["kind"]) == ("0 10000000 1001001", 3.140625,
                                                           "normal")
    assert PF.fields(0x01, "fp8_e4m3")["kind"] == "subnormal"
    assert PF.fields(0x7F, "fp8_e4m3")["kind"] == "NaN"
    assert PF.fields(0x7C00, "fp16")["kind"] == "infinity"
    assert PF.fields(127, "e8m0")["value"] == 1.0


def test_bf16_bits_round_to_nearest_even_like_torch_and_truncate_like_the_top_half():
    g = torch.Generator().manual_seed(1)
    x = torch.randint(-2**31, 2**31 - 1, (400_000,), generator=g).to(torch.int32) \
        .view(torch.float32)
    ours = PF.decode(PF.bf16_bits(x), "bf16")
    assert same(ours, x.bfloat16().double())
    top = (x.view(torch.int32).long() >> 16) & 0xFFFF
    finite = ~x.isnan()
    assert torch.equal(PF.bf16_bits(x, "truncate")[finite], top[finite])
    assert same(PF.decode(PF.bf16_bits(x[finite], "truncate"), "bf16"),
                F.quantize(x[finite].double(), "bf16", truncate=True, overflow="inf"))
    assert PF.decode(PF.bf16_bits(x[~finite], "truncate"), "bf16").isnan().all()


def test_truncation_rounds_toward_zero_and_is_biased():
    x = torch.tensor([1 + 2**-8 + 2**-9, -(1 + 2**-8 + 2**-9), 1 + 2**-7], dtype=torch.float64)
    assert F.quantize(x, "bf16", truncate=True).tolist() == [1.0, -1.0, 1 + 2**-7]
    assert F.quantize(x, "bf16").tolist() == [1 + 2**-7, -(1 + 2**-7), 1 + 2**-7]
    u = torch.rand(100_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64) + 1
    assert (F.quantize(u, "bf16", truncate=True) - u).mean() < -2**-9  # half a spacing, down
    assert abs((F.quantize(u, "bf16") - u).mean()) < 2**-14
    with pytest.raises(ValueError, match="not both"):
        F.quantize(x, "bf16", stochastic=True, truncate=True)


def test_spacing_grows_with_magnitude():
    s = PF.spacing(torch.tensor([1.0, 255.0, 256.0, 2048.0, 1e-40]), "bf16").tolist()
    assert s == [2**-7, 1.0, 2.0, 16.0, 2.0 ** -133]
    assert PF.spacing(torch.tensor([2048.0]), "fp16").item() == 2.0
    one = torch.tensor([256.0], dtype=torch.bfloat16)
    assert (one + 1).item() == 256.0 and (one + 2).item() == 258.0


def test_table_matches_finfo_of_torch_numpy_and_ml_dtypes():
    rows = PF.library_check()
    assert rows and all(r["equal"] for r in rows)
    assert {r["library"].split(".")[0] for r in rows} == {"torch", "numpy", "ml_dtypes"}
    table = {r["format"]: r for r in PF.format_table()}
    assert table["bf16"]["binades"] == pytest.approx(math.log2(F.FORMATS["bf16"].max) + 133)
    assert table["fp8_e4m3"]["max"] == 448 and table["fp8_e5m2"]["max"] == 57344
    assert table["tf32"]["bits"] == 32 and table["tf32"]["eps"] == 2**-10


def test_overflow_rules_as_measured():
    rows = {(r["library"], r["dtype"]): r for r in PF.overflow_table()}
    for dt in ("float16", "bfloat16", "float8_e5m2"):
        assert rows[("torch", dt)]["overflow"] == "inf"
        assert rows[("torch", dt)]["inf becomes"] == "inf"
    e4m3 = rows[("torch", "float8_e4m3fn")]
    assert (e4m3["overflow"], e4m3["inf becomes"], e4m3["nan becomes"]) == \
        ("saturate", "saturate", "nan")
    assert e4m3["max + gap/2"] == 448  # 464 is a tie and 448's mantissa is even
    assert rows[("ml_dtypes", "float8_e4m3fn")]["overflow"] == "nan"
    for dt in ("float6_e3m2fn", "float6_e2m3fn", "float4_e2m1fn"):
        assert rows[("ml_dtypes", dt)]["overflow"] == "saturate"
        assert rows[("ml_dtypes", dt)]["nan"] == 0  # no NaN in the format: a zero
    assert rows[("torch", "float16")]["max + gap/2"] == math.inf  # 65520 overflows


@pytest.mark.parametrize("library,dtype,name", [
    ("torch", "float16", "fp16"), ("torch", "bfloat16", "bf16"),
    ("torch", "float8_e5m2", "fp8_e5m2"), ("torch", "float8_e4m3fn", "fp8_e4m3"),
    ("ml_dtypes", "float8_e4m3fn", "fp8_e4m3"), ("ml_dtypes", "float4_e2m1fn", "fp4_e2m1")])
def test_quantize_with_the_measured_rule_reproduces_the_cast(library, dtype, name):
    row = next(r for r in PF.overflow_table((library,)) if r["dtype"] == dtype)
    f = F.FORMATS[name]
    probes = {k: v for k, v in PF.overflow_probes(f.max, f.eps).items()
              if v is not None and not (k == "nan" and not f.has_nan)}
    q = F.quantize(torch.tensor(list(probes.values()), dtype=torch.float64), name,
                   overflow=row["overflow"])
    got = torch.tensor([row[k] for k in probes], dtype=torch.float64)
    assert same(q, got)


def test_tf32_inputs_cost_what_fp16_inputs_do_and_an_eighth_of_bf16s():
    g = torch.Generator().manual_seed(0)
    err = PF.input_rounding_error(torch.randn(64, 256, generator=g),
                                  torch.randn(256, 64, generator=g))
    assert err["fp32"] < 1e-7
    assert err["tf32"] == pytest.approx(err["fp16"], rel=0.01)  # same 10 mantissa bits
    assert 5 < err["bf16"] / err["tf32"] < 12  # 3 fewer bits: about 8x


def test_matmul_precision_modes_restore_the_setting():
    torch.set_float32_matmul_precision("highest")
    out = PF.cpu_matmul_precision_modes(n=64)
    assert set(out) == {"high", "medium"}
    assert torch.get_float32_matmul_precision() == "highest"
    for r in out.values():
        assert r["changed"] == (r["max |difference|"] > 0)


# ------------------------------------------------------------------------------------------------
# Block formats, FP8, hardware, memory
# ------------------------------------------------------------------------------------------------

def data(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"gaussian": torch.randn(16, 512, generator=g),
            "student-t": B.heavy_tailed((16, 512), 3, g),
            "outliers": B.outlier_channels((16, 512), generator=g),
            "rows": B.row_scales((16, 512), 24, g)}


def test_block_scaling_beats_tensor_scaling_where_the_element_format_lacks_range():
    rows = {(r["format"], r["data"]): r for r in B.block_errors(data())}
    for fmt in ("mxfp6_e2m3", "mxfp4", "nvfp4"):
        for d in ("student-t", "outliers", "rows"):
            r = rows[(fmt, d)]
            assert r["block-scaled error"] < 0.5 * r["tensor-scaled error"], (fmt, d)
    r = rows[("mxfp8_e4m3", "rows")]  # 24 binades: more than E4M3's 17.8
    assert r["block-scaled error"] < 0.2 * r["tensor-scaled error"]
    g = rows[("mxfp8_e4m3", "gaussian")]  # within range, the block buys nothing...
    assert g["tensor-scaled error"] < g["block-scaled error"]
    assert g["scale rounded up"] < g["block-scaled error"]  # ...and OCP's scale clips
    assert rows[("nvfp4", "gaussian")]["block-scaled error"] < \
        rows[("mxfp4", "gaussian")]["block-scaled error"]
    assert rows[("nvfp4", "gaussian")]["scale rounded up"] is None


def test_scale_rounded_up_never_clips_and_is_the_smallest_such_power_of_two():
    x = data(1)["student-t"].double()
    for name in ("mxfp8_e4m3", "mxfp4", "mxfp6_e2m3"):
        b = F.BLOCK_FORMATS[name]
        top = F.FORMATS[b.element].max
        s = F.block_scales(x, name, scale_rounding="ceil")
        amax = x.reshape(16, -1, b.block).abs().amax(-1)
        assert (amax / s <= top).all() and (amax / (s / 2) > top).all()
        assert torch.equal(torch.log2(s), torch.round(torch.log2(s)))
        assert B.mx_clipped(x, name) > 0
    with pytest.raises(ValueError, match="E8M0"):
        F.block_scales(x, "nvfp4", scale_rounding="ceil")
    with pytest.raises(ValueError, match="scale_rounding must be one of"):
        F.block_quantize(x, "mxfp4", scale_rounding="up")


def test_gradients_span_more_binades_and_flush_in_e4m3_not_in_e5m2():
    g = torch.Generator().manual_seed(0)
    model = B.tiny_model()
    idx = torch.randint(0, model.cfg.vocab_size, (4, 65), generator=g)
    rows = {(r["tensor"], r["format"], r["scaling"]): r
            for r in B.fp8_split(B.model_tensors(model, idx))}
    span = {k[0]: r["span (binades)"] for k, r in rows.items()}
    assert span["gradients"] > max(span["weights"], span["activations"]) + 2
    e4 = rows[("gradients", "fp8_e4m3", "per tensor")]
    e5 = rows[("gradients", "fp8_e5m2", "per tensor")]
    tiles = rows[("gradients", "fp8_e4m3", "1 x 128 tiles")]
    assert e4["flushed to zero"] > 10 * e5["flushed to zero"]
    assert tiles["flushed to zero"] < e4["flushed to zero"] / 4
    assert e4["relative error"] < e5["relative error"]  # one more mantissa bit


def test_every_accelerator_of_the_hardware_table_is_in_one_generation_consistently():
    for name, spec in hardware.SPECS.items():
        g = B.generation_of(name)
        assert sum(name in x.specs for x in B.GENERATIONS) == 1
        assert (spec.tflops.get("fp8") is not None) == B.has_fp8(g), name
        assert (spec.tflops.get("bf16") is not None) == ("bf16" in g.formats), name
        assert (spec.tflops.get("tf32") is not None) == ("tf32" in g.formats), name
    for g in B.GENERATIONS:
        if g.capability:  # what the notebook helper says a GPU of that capability runs
            native = set(gpu_matmul_dtypes(g.capability)) - {"fp32"}
            ours = {"fp8" if f.startswith(("fp8", "mxfp8")) else f for f in g.formats
                    if f in ("fp16", "bf16", "tf32") or f.startswith(("fp8", "mxfp8"))}
            assert native == ours, g.name
    for r in B.generation_table():
        if r["fp8 TFLOPS"]:
            assert r["fp8 / bf16"] == pytest.approx(2.0, rel=1e-3)
    with pytest.raises(ValueError, match="unknown accelerator"):
        B.generation_of("tpu-v9")


def test_weight_memory_agrees_with_the_memory_estimator():
    rows = {r["format"]: r for r in B.weight_memory("llama-3-8b")}
    cfg = configs.get("llama-3-8b")
    for dtype in ("fp32", "bf16"):
        est = memory.estimate(memory.MemoryInputs(model=cfg, dtype=dtype, seq_len=4096))
        assert rows[dtype]["weights (GiB)"] * B.GiB == pytest.approx(est.weights, rel=1e-12)
    assert rows["fp8_e4m3"]["weights (GiB)"] == pytest.approx(rows["bf16"]["weights (GiB)"] / 2)
    assert rows["mxfp4"]["bytes/parameter"] == 4.25 / 8 and rows["nvfp4"]["bits/value"] == 4.5


# ------------------------------------------------------------------------------------------------
# The command and bad input
# ------------------------------------------------------------------------------------------------

def test_formats_command_json(capsys):
    assert main(["formats", "--json", "--value", "300", "--overflow"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {r["format"] for r in out["formats"]} == set(F.FORMATS)
    assert {r["format"] for r in out["block formats"]} == set(F.BLOCK_FORMATS)
    stored = {r["format"]: r["stored"] for r in out["value"]["rows"]}
    assert stored["fp8_e4m3"] == 288 and stored["bf16"] == 300 and stored["fp4_e2m1"] == 6
    assert any(r["dtype"] == "float8_e4m3fn" for r in out["overflow"])


def test_formats_command_text(capsys):
    assert main(["formats", "--value", "1e-6"]) == 0
    out = capsys.readouterr().out
    assert "mxfp4" in out and "4.25" in out and "3.403e+38" in out
    assert "subnormal" in out and "flushed to zero" in out


def test_formats_command_cuda_without_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert main(["formats", "--overflow", "--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_bad_input_says_what_to_do():
    with pytest.raises(ValueError, match="codes are 8-bit"):
        PF.decode([256], "fp8_e4m3")
    with pytest.raises(ValueError, match="floating-point"):
        PF.encode(torch.tensor([1]), "bf16")
    with pytest.raises(ValueError, match="float32"):
        PF.bf16_bits(torch.ones(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="'nearest' or 'truncate'"):
        PF.bf16_bits(torch.ones(2), "up")
    with pytest.raises(ValueError, match="library must be one of"):
        PF.overflow_table(("jax",))
    with pytest.raises(ValueError, match=r"\(m, k\) @ \(k, n\)"):
        PF.rounded_matmul(torch.ones(2, 3), torch.ones(2, 3), "tf32")
    with pytest.raises(ValueError, match="dof"):
        B.heavy_tailed((4,), 0)
    with pytest.raises(ValueError, match="n_channels"):
        B.outlier_channels((4, 8), n_channels=9)
    with pytest.raises(ValueError, match="not an MX format"):
        B.mx_clipped(torch.ones(2, 16), "nvfp4")
    with pytest.raises(ValueError, match="all zeros"):
        B.relative_error(torch.zeros(2, 4), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="binades"):
        B.row_scales((2, 4), -1)
