"""train/emulate.py: low-precision linear layers emulated in fp32.

The bf16 and fp16 recipes against torch.autocast on a CPU linear layer; the FP8 recipes'
operands against torch._scaled_mm (exact FP8 values, products to fp32 summation order); the
block recipes against trainbook.formats and their padding; the three matmuls of the backward
pass against the formula written out; delayed scaling's history; convert_linears; the trainer's
--dtype fp8-emulated for every recipe.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trainbook import configs, formats
from trainbook.model import Transformer
from trainbook.train import TrainConfig, train
from trainbook.train.emulate import (
    RECIPES,
    TILE,
    EmulatedLinear,
    Recipe,
    convert_linears,
    fake_quantize,
    quantize_operand,
    recipe,
    same_both_ways,
    scaled_matmul,
    transpose,
)

FP8 = ("tensorwise", "delayed", "rowwise", "blockwise", "mxfp8")


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("kw, message", [
    (dict(name="fp4"), "unknown recipe 'fp4'"),
    (dict(forward="fp9"), "unknown number format 'fp9'"),
    (dict(wgrad="int8"), "unknown number format 'int8'"),
    (dict(history=0), "history must be >= 1 step"),
    (dict(name="mxfp8", forward="bf16"), "no MX block format has bf16 elements"),
])
def test_recipe_rejects_bad_input(kw, message):
    with pytest.raises(ValueError, match=message):
        Recipe(**kw)


def test_recipe_names_and_their_formats():
    with pytest.raises(ValueError, match="unknown recipe 'nope'; choose one of bf16, fp16"):
        recipe("nope")
    assert recipe("bf16") == Recipe("bf16", "bf16", "bf16", "bf16", wgrad="bf16")
    assert (recipe("tensorwise").forward, recipe("tensorwise").backward) == ("fp8_e4m3",
                                                                              "fp8_e5m2")
    for name in ("rowwise", "blockwise", "mxfp8"):  # fine-grained: E4M3 throughout
        assert recipe(name).backward == "fp8_e4m3" and recipe(name).wgrad == "fp32"
    assert not recipe("fp16").scaled and recipe("delayed").scaled


@pytest.mark.parametrize("name, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_bf16_and_fp16_recipes_are_what_autocast_does_to_a_linear_layer(name, dtype):
    """y, dx and dW equal autocast's but for the odd element where the fp32 sums' order
    differs, and then by one unit in the last place of the format."""
    g = _gen()
    lin = nn.Linear(64, 48, bias=False)
    x = torch.randn(32, 64, generator=g, requires_grad=True)
    dy = torch.randn(32, 48, generator=g)
    with torch.autocast("cpu", dtype=dtype):
        y = lin(x)
    y.backward(dy.to(dtype))
    ref = (y.detach().float(), x.grad.clone(), lin.weight.grad.clone())
    assert y.dtype == dtype
    x.grad, lin.weight.grad = None, None
    y2 = EmulatedLinear(lin, recipe(name))(x)
    y2.backward(dy)
    ulp = formats.get(name).eps
    for ours, theirs in zip((y2.detach(), x.grad, lin.weight.grad), ref):
        assert torch.equal(formats.quantize(ours, name), ours)  # every output is in the format
        assert (ours == theirs).double().mean() > 0.99
        assert ((ours - theirs).abs() <= ulp * theirs.abs()).all()


def test_fp16_recipe_overflows_to_inf_and_flushes_small_gradients():
    lin = EmulatedLinear(nn.Linear(4, 2, bias=False), recipe("fp16"))
    with torch.no_grad():
        lin.weight.fill_(1.0)
    assert torch.isinf(lin(torch.full((1, 4), 3e4))).all()  # 4 x 3e4 > 65504
    x = torch.ones(1, 4, requires_grad=True)
    lin(x).backward(torch.full((1, 2), 2.0**-26))  # below half fp16's smallest subnormal
    assert (x.grad == 0).all() and (lin.weight.grad == 0).all()


@pytest.mark.parametrize("name", ["tensorwise", "rowwise"])
def test_fp8_operands_are_what_scaled_mm_takes(name):
    """The quantised operands are FP8 numbers; _scaled_mm on them (with the inverse scales)
    gives our product up to fp32 summation order: within K 2^-24 sum |products|."""
    g = _gen(1)
    M, K, N = 48, 128, 64
    x = torch.randn(M, K, generator=g) * torch.logspace(-3, 1, M)[:, None]
    w = torch.randn(N, K, generator=g) * 0.02
    rcp = recipe(name)
    xq = quantize_operand(x, rcp, "fp8_e4m3", 1, False)
    wq = quantize_operand(w, rcp, "fp8_e4m3", 1, True)
    f8 = torch.float8_e4m3fn
    for q, _ in (xq, wq):
        assert torch.equal(q, q.to(f8).float()) and q.abs().max() <= 448
    assert xq[0].abs().amax(dim=1).eq(448).all() if name == "rowwise" else \
        xq[0].abs().max() == 448  # the amax lands on E4M3's largest value
    sa, sb = xq[1].float(), transpose(wq)[1].float().contiguous()
    ref = torch._scaled_mm(xq[0].to(f8), wq[0].to(f8).t(), scale_a=sa, scale_b=sb,
                           out_dtype=torch.float32)
    ours = scaled_matmul(xq, transpose(wq), "fp32")
    bound = K * 2.0**-24 * (xq[0].abs() @ wq[0].abs().t()) * (sa * sb)
    assert ((ours - ref).abs() <= bound).all()
    # and dequantising first, then multiplying, is the same product to that bound
    deq = fake_quantize(x, rcp, "fp8_e4m3") @ fake_quantize(w, rcp, "fp8_e4m3", 1, True).t()
    assert ((ours - deq).abs() <= 2 * bound).all()


@pytest.mark.parametrize("shape", [(64, 96), (5, 70)])
def test_mxfp8_operand_is_formats_block_quantize(shape):
    """The fast path (torch's FP8 cast) equals formats.block_quantize bit for bit, padding a
    ragged last block with zeros."""
    x = torch.randn(*shape, generator=_gen(2)) * torch.logspace(-4, 2, shape[1])
    q, inv = quantize_operand(x, recipe("mxfp8"), "fp8_e4m3", 1, False)
    pad = -shape[1] % 32
    ref = formats.block_quantize(F.pad(x, (0, pad)), "mxfp8_e4m3")[:, :shape[1]]
    assert inv is None and torch.equal(q, ref)
    q0, _ = quantize_operand(x, recipe("mxfp8"), "fp8_e4m3", 0, False)  # blocks down columns
    ref0 = formats.block_quantize(F.pad(x.t(), (0, -shape[0] % 32)), "mxfp8_e4m3")
    assert torch.equal(q0, ref0[:, :shape[0]].t())


def test_mxfp8_recipe_takes_any_mx_element_format():
    x = torch.randn(8, 64, generator=_gen(9))
    rcp = Recipe("mxfp8", forward="fp4_e2m1", backward="fp4_e2m1")
    q = fake_quantize(x, rcp, "fp4_e2m1")
    assert torch.equal(q, formats.block_quantize(x, "mxfp4"))


def test_blockwise_tiles_and_blocks_and_their_padding():
    g = _gen(3)
    x = torch.randn(4, 2 * TILE, generator=g)
    x[0, 5] = 1000.0  # an outlier changes only its own 1 x 128 tile
    q = fake_quantize(x, recipe("blockwise"), "fp8_e4m3")
    tiles = q.reshape(4, 2, TILE)
    rcp = recipe("tensorwise")
    for r in range(4):
        for t in range(2):
            own = fake_quantize(x[r, t * TILE:(t + 1) * TILE][None], rcp, "fp8_e4m3")
            assert torch.equal(tiles[r, t], own[0])
    w = torch.randn(200, 72, generator=g)  # neither dimension a multiple of 128: padded
    qw = fake_quantize(w, recipe("blockwise"), "fp8_e4m3", 1, True)
    assert torch.equal(qw[:TILE, :], fake_quantize(w[:TILE], rcp, "fp8_e4m3"))
    assert torch.equal(qw[TILE:, :], fake_quantize(w[TILE:], rcp, "fp8_e4m3"))


@pytest.mark.parametrize("name", RECIPES)
def test_an_operand_quantised_once_serves_both_ways_exactly_when_the_recipe_says(name):
    x = torch.randn(256, 160, generator=_gen(4)) * torch.logspace(-2, 2, 160)
    rcp = recipe(name)
    for is_weight in (False, True):
        a = fake_quantize(x, rcp, rcp.forward, 1, is_weight)
        b = fake_quantize(x, rcp, rcp.forward, 0, is_weight)
        assert torch.equal(a, b) == same_both_ways(rcp, is_weight), (name, is_weight)


@pytest.mark.parametrize("name", RECIPES)
def test_three_matmuls_are_the_formula(name):
    """y = q(x) q(W)^T, dx = q(g) q(W), dW = q(g)^T q(x), each operand quantised along its
    non-summed dimension (outputs kept in fp32 here, so only the sums' order differs)."""
    base = recipe(name)
    rcp = Recipe(base.name, base.forward, base.backward, "fp32", base.history, "fp32")
    g = _gen(5)
    lin = nn.Linear(160, 96, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(96, 160, generator=g) * 0.05)
    x = torch.randn(40, 160, generator=g, requires_grad=True)
    dy = torch.randn(40, 96, generator=g) * 1e-3
    y = EmulatedLinear(lin, rcp)(x)
    y.backward(dy)
    fq = lambda t, fmt, dim, wt=False: fake_quantize(t, rcp, fmt, dim, wt)  # noqa: E731
    w = lin.weight.detach()
    operands = ((fq(x.detach(), rcp.forward, 1), fq(w, rcp.forward, 1, True).t()),
                (fq(dy, rcp.backward, 1), fq(w, rcp.forward, 0, True)),
                (fq(dy, rcp.backward, 0).t(), fq(x.detach(), rcp.forward, 0)))
    for ours, (a, b) in zip((y.detach(), x.grad, lin.weight.grad), operands):
        # two fp32 sums of the same K products (and the scales applied before or after)
        bound = 3 * a.shape[1] * 2.0**-24 * (a.abs() @ b.abs())
        assert ((ours - a @ b).abs() <= bound).all()


def test_delayed_scaling_uses_the_history_and_it_rolls():
    layer = EmulatedLinear(nn.Linear(8, 8, bias=False), Recipe("delayed", history=3))
    assert layer.amax_history.shape == (3, 3) and "amax_history" in layer.state_dict()
    amaxes = [1.0, 4.0, 2.0, 0.5, 0.25, 0.25]
    used = [layer.amax("x", torch.full((2, 8), a)).item() for a in amaxes]
    # first step: its own amax; then the largest of the previous three
    assert used == [1.0, 1.0, 4.0, 4.0, 4.0, 2.0]
    assert layer.amax("w", torch.ones(1)).item() == 1.0  # each role has its own row
    assert EmulatedLinear(nn.Linear(8, 8), recipe("rowwise")).amax("x", torch.ones(1)) is None


def test_convert_linears_blocks_by_default_the_head_on_request():
    cfg = configs.get("tiny-llama").with_(vocab_size=64, d_model=32, n_layers=2, n_heads=2,
                                          n_kv_heads=2, d_ff=64, max_seq_len=16)
    model = Transformer(cfg)
    params = list(model.parameters())
    done = convert_linears(model, "tensorwise")
    assert len(done) == 2 * 7 and all(n.startswith("blocks.") for n in done)
    assert type(model.head) is nn.Linear
    assert list(model.parameters()) == params  # the same Parameters: an optimizer keeps them
    assert convert_linears(model, "tensorwise", skip=("router",), include=("head",)) == ["head"]
    assert isinstance(model.head, EmulatedLinear)
    with pytest.raises(ValueError, match="include names no part"):
        convert_linears(model, "bf16", include=())
    x = torch.randint(0, 64, (2, 16), generator=_gen())
    loss = model(x, x)[1]
    loss.backward()
    assert math.isfinite(loss.item()) and all(p.grad is not None for p in params)


def test_the_trainer_runs_every_recipe():
    base = dict(tokenizer="bytes", d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=64,
                seq_len=32, batch_size=4, steps=2, warmup_steps=1, eval_batches=1,
                progress=False, log_every=0)
    for name in RECIPES:
        res = train(TrainConfig(dtype="fp8-emulated", fp8_recipe=name, **base))
        assert all(math.isfinite(v) for v in res.losses()), name
        assert isinstance(res.model.blocks[0].mlp.down, EmulatedLinear)
        assert res.model.blocks[0].mlp.down.recipe.name == name
