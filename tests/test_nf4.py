"""NF4 from scratch (book/alignment/lora: align.nf4, align.nf4_linear) against bitsandbytes on
CPU: the 16 levels, the 8-bit dynamic map, block-wise quantisation (identical packed codes), double
quantisation (the constants' codes, ours always the nearest), bits per parameter, the NF4 linear
layer's forward and backward (which keeps no dequantised weight for backward), the error ranking
of 4-bit types, the CPU kernel's limit, and the bitsandbytes defaults the chapter depends on."""

import inspect
import logging
import math

import pytest
import torch
from torch import nn

from trainbook.align import lora_check as LC
from trainbook.align import nf4
from trainbook.align import nf4_linear as NL

logging.getLogger(LC.BNB_LOGGER).setLevel(logging.ERROR)
bnb = pytest.importorskip("bitsandbytes")
BF = bnb.functional


def weights(shape=(256, 1024), seed=0, std=0.02):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * std


# ---------------------------------------------------------------------------------------------
# The library facts the chapter rests on
# ---------------------------------------------------------------------------------------------

def test_bitsandbytes_defaults_are_what_the_chapter_says():
    q4 = inspect.signature(BF.quantize_4bit).parameters
    assert q4["quant_type"].default == nf4.BNB_DEFAULT_QUANT_TYPE == "fp4"
    assert q4["compress_statistics"].default is False
    assert q4["blocksize"].default is None  # None means 64:
    _, state = BF.quantize_4bit(weights((4, 64)), quant_type="nf4")
    assert state.blocksize == nf4.BLOCKSIZE == 64
    _, state = BF.quantize_4bit(weights((4, 64)), quant_type="nf4", compress_statistics=True)
    assert state.state2.blocksize == nf4.DQ_BLOCKSIZE == 256
    lin = inspect.signature(bnb.nn.Linear4bit.__init__).parameters
    assert lin["quant_type"].default == "fp4"
    assert lin["compress_statistics"].default is nf4.BNB_LINEAR4BIT_COMPRESS_STATISTICS
    assert inspect.signature(BF.create_normal_map).parameters["offset"].default == \
        nf4.NF4_OFFSET
    import transformers

    cfg = transformers.BitsAndBytesConfig(load_in_4bit=True)
    assert cfg.bnb_4bit_quant_type == nf4.BNB_DEFAULT_QUANT_TYPE
    assert cfg.bnb_4bit_use_double_quant is nf4.HF_DEFAULT_DOUBLE_QUANT


def test_offset_is_the_mean_of_two_tail_probabilities():
    assert 1 - (1 / 30 + 1 / 32) / 2 == pytest.approx(nf4.NF4_OFFSET, abs=5e-8)


# ---------------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------------

def test_nf4_levels_equal_bitsandbytes_table():
    mine = nf4.nf4_levels()
    theirs = BF.get_4bit_type("nf4", device="cpu")
    torch.testing.assert_close(mine, theirs, atol=1e-7, rtol=0)
    assert (mine > 0).sum() == 8 and (mine < 0).sum() == 7 and (mine == 0).sum() == 1
    assert mine.min() == -1 and mine.max() == 1
    # and equal to create_normal_map's first 16 nonzero-padded entries (it needs scipy)
    pytest.importorskip("scipy")
    full = BF.create_normal_map()
    torch.testing.assert_close(mine, torch.cat([full[:7], full[7:8], full[-8:]]), atol=1e-7,
                               rtol=0)


def test_other_tables_equal_bitsandbytes_and_formats():
    fp4 = BF.get_4bit_type("fp4", device="cpu").unique().sort().values  # +-0 collapse
    torch.testing.assert_close(nf4.levels("fp4"), fp4)
    e2m1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6]) / 6
    torch.testing.assert_close(nf4.levels("e2m1"), torch.cat([-e2m1.flip(0)[:-1], e2m1]))
    # symmetric int4: -7..7 over 7 (bitsandbytes' "int4" table fails to build: an integer
    # tensor divided in place)
    torch.testing.assert_close(nf4.levels("int4") * 7, torch.arange(-7.0, 8.0))


def test_dynamic_map_equals_bitsandbytes():
    torch.testing.assert_close(nf4.dynamic_map(), BF.create_dynamic_map(), atol=0, rtol=0)
    with pytest.raises(ValueError, match="signed 8-bit"):
        nf4.dynamic_map(signed=False)


# ---------------------------------------------------------------------------------------------
# Quantisation against quantize_4bit / dequantize_4bit
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(256, 1024), (5, 192)])  # rows straddling blocks: below
def test_codes_and_values_equal_bitsandbytes_without_double_quant(shape):
    x = weights(shape)
    out = LC.compare_nf4(x, double=False)
    assert out["codes_equal"]
    assert out["dequant_max_diff"] <= 1e-7 * out["dequant_max_abs"] or \
        out["dequant_max_diff"] < 1e-8
    assert out["ours_bits_per_param"] == pytest.approx(out["bnb_bits_per_param"])
    if math.prod(shape) % 64 == 0:
        assert out["ours_bits_per_param"] == 4.5


def test_double_quantisation_against_bitsandbytes():
    x = weights((1024, 1024))
    out = LC.compare_nf4(x, double=True)
    assert out["codes_equal"] and out["offset_diff"] == 0
    # bitsandbytes' CPU kernel breaks near-ties of the 8-bit constants its own way
    assert out["constant_codes_differing"] <= 0.005 * out["constants"]
    assert out["constant_codes_max_step"] <= 2
    assert out["dequant_max_diff"] < 0.01 * out["dequant_max_abs"]
    assert out["ours_bits_per_param"] == pytest.approx(out["bnb_bits_per_param"])
    assert out["ours_bits_per_param"] == pytest.approx(4 + 8 / 64 + 32 / (64 * 256), abs=1e-4)


def test_partial_and_odd_blocks_equal_bitsandbytes_pure_pytorch_path():
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute

    reference = getattr(_dequantize_4bit_compute, "__wrapped__", _dequantize_4bit_compute)
    for shape in [(3, 96), (7, 33)]:  # 4.5 blocks; an odd count (padded with a zero code)
        x = weights(shape)
        packed, state = BF.quantize_4bit(x, blocksize=64, quant_type="nf4")
        q = nf4.quantize(x)
        assert torch.equal(q.packed, packed) and torch.equal(q.absmax, state.absmax)
        theirs = reference(packed.reshape(-1), state.absmax, BF.get_4bit_type("nf4", "cpu"),
                           64, shape, torch.float32)
        torch.testing.assert_close(nf4.dequantize(q), theirs, atol=1e-8, rtol=1e-6)


def test_our_constant_codes_are_the_nearest_where_bitsandbytes_differs():
    x = weights((1024, 1024), seed=3)
    q = nf4.quantize(x, double=True)
    _, state = BF.quantize_4bit(x, blocksize=64, quant_type="nf4", compress_statistics=True)
    absmax = x.reshape(-1, 64).abs().amax(-1)
    scaled = (absmax - absmax.mean()) / q.absmax2.repeat_interleave(256)[:absmax.numel()]
    code = nf4.dynamic_map()
    for i in (q.absmax != state.absmax).nonzero().flatten().tolist():
        mine, theirs = code[int(q.absmax[i])], code[int(state.absmax[i])]
        d_mine, d_theirs = abs(scaled[i] - mine), abs(scaled[i] - theirs)
        assert d_mine <= d_theirs  # ours is the nearest; the CPU kernel's search is not exact


def test_bits_per_param_formula():
    assert nf4.bits_per_param() == 4.5
    assert nf4.bits_per_param(double=True) == pytest.approx(4.127, abs=5e-4)
    assert nf4.bits_per_param(double=True) - 4 == pytest.approx(0.127, abs=5e-4)
    assert nf4.bits_per_param(128) == 4.25
    q = nf4.quantize(weights((4096, 1024)), double=True)
    assert q.bits_per_param() == pytest.approx(nf4.bits_per_param(double=True), rel=1e-4)


def test_pack_unpack_round_trip_and_layout():
    codes = torch.tensor([1, 2, 15, 0, 7])
    packed = nf4.pack(codes, pad_code=7)
    assert packed.tolist() == [[0x12], [0xF0], [0x77]]
    assert nf4.unpack(packed)[:5].tolist() == codes.tolist()


def test_round_trip_error_is_bounded_by_half_the_widest_gap():
    x = weights((64, 128))
    q = nf4.quantize(x)
    gap = nf4.nf4_levels().diff().max() / 2
    absmax = x.reshape(-1, 64).abs().amax(-1).repeat_interleave(64).reshape(x.shape)
    assert ((nf4.dequantize(q) - x).abs() <= gap * absmax + 1e-7).all()
    assert nf4.dequantize(q, torch.bfloat16).dtype == torch.bfloat16


def test_paged_optimizer_falls_back_on_cpu():
    """Documented in the chapter: paged optimizer state needs a GPU (CUDA unified memory)."""
    out = LC.paged_optimizer("cpu")
    assert not out["state_paged"] and out["state_device"] == "cpu"
    assert any("not supported on CPU" in m for m in out["warnings"])


def test_bnb_cpu_kernel_is_wrong_when_blocks_straddle_rows():
    """Documented in the chapter: if this starts failing, bitsandbytes fixed its CPU kernel and
    the chapter's remark (and the QLoRA comparison's choice of d_ff) can go."""
    bad = LC.bnb_cpu_dequantize_error((128, 352))
    good = LC.bnb_cpu_dequantize_error((128, 384))
    assert bad["ours_vs_torch_path"] < 1e-7 and good["ours_vs_torch_path"] < 1e-7
    assert bad["bnb_cpu_kernel"] > 3 * bad["bnb_torch_path"]
    assert good["bnb_cpu_kernel"] == pytest.approx(good["bnb_torch_path"], rel=1e-6)


# ---------------------------------------------------------------------------------------------
# Quantisation error of 4-bit types
# ---------------------------------------------------------------------------------------------

def test_nf4_has_the_least_error_and_most_entropy_of_the_tables_on_normal_weights():
    x = weights((512, 1024), std=1.0)
    rows = {r["type"]: r for r in nf4.quantization_error(x)}
    err = {k: r["rel_rms_error"] for k, r in rows.items()}
    assert min(err, key=err.get) == "nf4"
    assert err["nf4"] < 0.9 * err["int4"] and err["nf4"] < 0.8 * err["fp4"]
    ent = {k: rows[k]["code_entropy_bits"] for k in nf4.KINDS}
    assert max(ent, key=ent.get) == "nf4" and 3.8 < ent["nf4"] < 4.0
    assert rows["mxfp4"]["bits_per_param"] == 4.25 and rows["nvfp4"]["bits_per_param"] == 4.5


def test_lloyd_max_beats_nf4_on_error_with_less_entropy():
    x = weights((256, 1024), std=1.0)
    table = nf4.lloyd_max_levels(x)
    assert table.numel() == 16 and bool((table.diff() > 0).all())
    rows = {r["type"]: r for r in nf4.quantization_error(x, ("nf4",), tables={"lm": table})}
    assert rows["lm"]["rel_rms_error"] < 0.97 * rows["nf4"]["rel_rms_error"]
    assert rows["lm"]["code_entropy_bits"] < rows["nf4"]["code_entropy_bits"]


# ---------------------------------------------------------------------------------------------
# The NF4 linear layer
# ---------------------------------------------------------------------------------------------

def test_nf4_linear_forward_and_backward_use_the_dequantised_weight():
    torch.manual_seed(0)
    lin = nn.Linear(128, 64)
    layer = NL.NF4Linear(lin)
    w = layer.weight_dequantized()
    x = torch.randn(3, 5, 128, requires_grad=True)
    y = layer(x)
    torch.testing.assert_close(y, nn.functional.linear(x, w, lin.bias))
    y.square().sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    nn.functional.linear(x2, w, lin.bias).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    assert not layer.bias.requires_grad and layer.numel_weight == 128 * 64
    assert layer.packed.dtype == torch.uint8 and layer.packed.numel() == 128 * 64 // 2


def test_nf4_linear_keeps_no_dequantised_weight_for_backward():
    layer = NL.NF4Linear(nn.Linear(256, 256, bias=False))
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    x = torch.randn(2, 256, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x).sum().backward()
    assert 256 * 256 not in saved  # F.linear(x, dequantised W) would save W for x's gradient


def test_nf4_linear_forward_equals_bitsandbytes_linear4bit():
    torch.manual_seed(1)
    lin = nn.Linear(256, 128, bias=False)
    theirs = bnb.nn.Linear4bit(256, 128, bias=False, compute_dtype=torch.float32,
                               quant_type="nf4", compress_statistics=False)
    theirs.weight = bnb.nn.Params4bit(lin.weight.data.clone(), requires_grad=False,
                                      quant_type="nf4", compress_statistics=False, blocksize=64)
    theirs = theirs.to("cpu")
    ours = NL.NF4Linear(lin, double=False)
    assert torch.equal(ours.packed, theirs.weight.data)
    x = torch.randn(4, 256)
    torch.testing.assert_close(ours(x), theirs(x), atol=1e-6, rtol=1e-5)


def test_quantize_linears_replaces_only_the_named_layers():
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    NL.quantize_linears(model, ["0"])
    assert isinstance(model[0], NL.NF4Linear) and isinstance(model[2], nn.Linear)
    with pytest.raises(ValueError, match="not nn.Linear"):
        NL.quantize_linears(model, ["1"])


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("call, match", [
    (lambda: nf4.quantize(torch.ones(4, 64, dtype=torch.int32)), "float32/bf16/fp16"),
    (lambda: nf4.quantize(torch.empty(0)), "empty"),
    (lambda: nf4.quantize(torch.tensor([1.0, float("nan")] * 32)), "inf or NaN"),
    (lambda: nf4.quantize(torch.ones(64), kind="nf5"), "unknown 4-bit type"),
    (lambda: nf4.quantize(torch.ones(64), blocksize=0), "blocksize"),
    (lambda: nf4.nf4_levels(offset=1.5), "probability"),
    (lambda: nf4.bits_per_param(blocksize=-1), "blocksize"),
    (lambda: nf4.float_levels("fp32"), "at most 8 bits"),
    (lambda: nf4.quantization_error(torch.ones(64), ("bogus",)), "unknown type"),
    (lambda: nf4.quantization_error(torch.ones(48), ("mxfp4",)), "multiple of 32"),
    (lambda: nf4.lloyd_max_levels(torch.ones(64), iters=0), "iters"),
    (lambda: NL.NF4Linear(nn.Conv1d(2, 2, 1)), "wraps an nn.Linear"),
    (lambda: LC.bnb_cpu_dequantize_error((3,)), "rows, columns"),
    (lambda: LC.paged_optimizer("tpu"), "device must be"),
    (lambda: nf4.pack(torch.tensor([1, 16])), "4-bit values"),
    (lambda: nf4.pack(torch.tensor([1, 2]), pad_code=-1), "pad_code"),
])
def test_bad_input_is_rejected_with_a_fix(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_nf4_linear_refuses_a_meta_weight():
    with torch.device("meta"):
        lin = nn.Linear(64, 64)
    with pytest.raises(ValueError, match="meta device"):
        NL.NF4Linear(lin)
