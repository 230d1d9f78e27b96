"""The trainer's initialisations (train/init.py) and the initialisation chapter's experiments
(pretrain/init_scale.py, mup.py, noise_scale.py)."""

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainbook import configs
from trainbook.model import Transformer
from trainbook.pretrain import init_scale, mup, noise_scale
from trainbook.train import TrainConfig, make_optimizer
from trainbook.train.init import (
    INITS,
    base_width_of,
    init_weights,
    lr_scale,
    mup_rule,
    param_kind,
)


def small(flavour="llama", d=64, **kw):
    base = configs.get("tiny-llama" if flavour == "llama" else "tiny-gpt2")
    sizes = dict(d_model=d, n_heads=2, n_kv_heads=2, d_ff=3 * d, vocab_size=96,
                 max_seq_len=16, n_layers=2)
    return base.with_(**{**sizes, **kw})


def drawn(cfg, scheme=None, base=None, seed=0):
    torch.manual_seed(seed)
    model = Transformer(cfg)
    if scheme is not None:
        init_weights(model, scheme, base)
    return model


def test_the_trainer_offers_every_scheme():
    assert INITS == ("scaled", "standard", "mup")
    assert TrainConfig(init="mup", mup_base_width=32).mup_base_width == 32


@pytest.mark.parametrize("flavour", ["llama", "gpt2"])
def test_scaled_is_the_models_own_draw_bit_for_bit(flavour):
    ref, model = drawn(small(flavour)), drawn(small(flavour), "scaled")
    for (n, a), b in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(a, b), n
    assert all(lr_scale(model, n, "scaled") == 1.0 for n, _ in model.named_parameters())


def test_standard_undoes_only_the_residual_scaling():
    cfg = small(d=128, n_layers=4)
    ref, std = drawn(cfg), drawn(cfg, "standard")
    for (name, a), b in zip(ref.named_parameters(), std.parameters()):
        if name.endswith(("o.weight", "down.weight")):
            assert torch.equal(b, a * math.sqrt(2 * cfg.n_layers)), name
            assert b.std().item() == pytest.approx(0.02, rel=0.05), name
        else:
            assert torch.equal(a, b), name


@pytest.mark.parametrize("flavour", ["llama", "gpt2"])
def test_mup_at_the_base_width_is_the_reference_model(flavour):
    """At m = 1 every rescaling is by 1 and 1/head_dim attention is 1/sqrt(head_dim): the same
    forward, bit for bit, and every learning-rate factor 1 (the tied gpt2 head included)."""
    cfg = small(flavour, d=64)
    ref, mp = drawn(cfg), drawn(cfg, "mup", base=64)
    x = torch.randint(0, cfg.vocab_size, (2, 16))
    assert torch.equal(ref(x)[0], mp(x)[0])
    assert {lr_scale(mp, n, "mup") for n, _ in mp.named_parameters()} == {1.0}


@pytest.mark.parametrize("m", [2, 4])
def test_mup_follows_table_8_relative_to_the_base(m):
    base, cfg = 32, small(d=32 * m)
    ref, mp = drawn(cfg), drawn(cfg, "mup", base=base)
    for (name, a), b in zip(ref.named_parameters(), mp.parameters()):
        kind = param_kind(name, a.dim())
        if kind == "hidden":  # init variance 1/fan_in, Adam LR 1/fan_in
            assert torch.equal(b, a * (1 / math.sqrt(m))), name
            assert lr_scale(mp, name, "mup") == 1 / m
        else:  # input weights, vectors and the head: init and LR as at the base
            assert torch.equal(a, b), name
            assert lr_scale(mp, name, "mup") == 1.0
    kinds = {n: param_kind(n, p.dim()) for n, p in mp.named_parameters()}
    assert kinds["embed.weight"] == "input" and kinds["head.weight"] == "output"
    assert kinds["blocks.0.attn.q.weight"] == kinds["blocks.1.mlp.down.weight"] == "hidden"
    assert kinds["blocks.0.attn_norm.weight"] == "input"
    # the readout's 1/m multiplier, and 1/head_dim attention equal to 1/sqrt at the base
    h = torch.randn(2, 16, cfg.d_model)
    torch.testing.assert_close(mp.project_logits(h), mp.head.weight.matmul(
        mp.norm(h).unsqueeze(-1)).squeeze(-1) / m)
    head_dim, base_head_dim = cfg.head_dim, cfg.head_dim / m
    for block in mp.blocks:
        assert block.attn.softmax_scale == pytest.approx(math.sqrt(base_head_dim) / head_dim)


def test_lr_scale_reaches_the_optimizer_under_a_wrapper():
    """The loop builds the optimizer over ModuleList(parts): names gain a "0." prefix."""
    mp = drawn(small(d=128), "mup", base=32)
    cfg = TrainConfig(init="mup", weight_decay=0.1)
    groups = make_optimizer(torch.nn.ModuleList([mp]), cfg).param_groups
    by_scale: dict[float, int] = {}
    for g in groups:
        n = sum(p.numel() for p in g["params"])
        by_scale[g["lr_scale"]] = by_scale.get(g["lr_scale"], 0) + n
    hidden = sum(p.numel() for n, p in mp.named_parameters() if param_kind(n, p.dim()) == "hidden")
    assert by_scale[0.25] == hidden
    assert sum(by_scale.values()) == sum(p.numel() for p in mp.parameters())
    assert lr_scale(torch.nn.ModuleList([mp]), "0.blocks.1.mlp.up.weight", "mup") == 0.25


def test_mixture_of_experts_router_is_an_output_weight():
    cfg = configs.get("tiny-mixtral").with_(d_model=64, vocab_size=96, max_seq_len=16)
    mp = drawn(cfg, "mup", base=32)
    router = mp.blocks[0].mlp.router
    assert param_kind("blocks.0.mlp.router.weight", 2) == "output"
    assert router.mup_output_mult == 0.5
    assert lr_scale(mp, "blocks.0.mlp.experts.1.down.weight", "mup") == 0.5


@settings(max_examples=50, deadline=None)
@given(st.floats(min_value=1 / 64, max_value=1024))
def test_mup_rules_scale_with_the_width_multiplier(m):
    hidden, out, inp = mup_rule("hidden", m), mup_rule("output", m), mup_rule("input", m)
    assert hidden.init_std ** 2 * m == pytest.approx(1) and hidden.lr * m == pytest.approx(1)
    assert out.multiplier * m == pytest.approx(1) and out.lr == out.init_std == 1
    assert inp.init_std == inp.lr == inp.multiplier == 1 and hidden.multiplier == 1


def test_default_base_width_is_the_presets():
    assert base_width_of(configs.get("tiny-llama").with_(d_model=512)) == 128
    assert base_width_of(configs.get("tiny-llama").with_(name="mine", d_model=512)) == 512
    assert base_width_of(configs.get("tiny-llama"), 64) == 64


@pytest.mark.parametrize("call, message", [
    (lambda m: init_weights(m, "xavier"), "init must be one of scaled, standard, mup"),
    (lambda m: init_weights(torch.nn.Linear(2, 2), "mup"), "needs the reference Transformer"),
    (lambda m: init_weights(m, "mup", 0), "base width must be a positive integer"),
    (lambda m: lr_scale(m, "head.weight", "mup"), "was not initialised under mup"),
    (lambda m: lr_scale(m, "nope.weight", "scaled"), None),
    (lambda m: lr_scale(m, "head.weight", "he"), "init must be one of"),
    (lambda m: mup_rule("bias", 2.0), "kind must be input, hidden or output"),
    (lambda m: mup_rule("hidden", 0.0), "width multiplier must be positive"),
    (lambda m: TrainConfig(mup_base_width=0), "mup_base_width must be >= 1"),
])
def test_bad_input_is_refused(call, message):
    model = drawn(small())
    if message is None:  # schemes without factors need no lookup
        assert call(model) == 1.0
        return
    with pytest.raises(ValueError, match=message):
        call(model)


def test_initialising_twice_is_refused():
    model = drawn(small(), "standard")
    with pytest.raises(ValueError, match="already initialised under standard"):
        init_weights(model, "mup")
    mp = drawn(small(), "mup", base=32)
    with pytest.raises(ValueError, match="has no parameter 'blocks.9.attn.q.weight'"):
        lr_scale(mp, "blocks.9.attn.q.weight", "mup")


def test_train_command_runs_under_mup(cache_dir, tmp_path):
    from trainbook.__main__ import main

    out = tmp_path / "run.json"
    assert main(["train", "--init", "mup", "--d-model", "64", "--n-layers", "1", "--n-heads",
                 "2", "--n-kv-heads", "2", "--d-ff", "176", "--tokenizer", "bytes",
                 "--seq-len", "16", "--batch-size", "4", "--steps", "6", "--warmup-steps", "1",
                 "--no-progress", "--cache-dir", cache_dir, "--json-out", str(out)]) == 0
    history = json.loads(out.read_text())["history"]
    assert len(history) == 6 and all(math.isfinite(r["loss"]) for r in history)


def test_pytorch_defaults_the_chapter_contrasts_with():
    """nn.Linear: kaiming_uniform_(a=sqrt(5)) = U(-1/sqrt(fan_in), 1/sqrt(fan_in)), std
    1/sqrt(3 fan_in); nn.Embedding: N(0, 1)."""
    model = init_scale.build_model(small(d=256), "pytorch")
    q = model.blocks[0].attn.q.weight
    assert q.abs().max() <= 1 / math.sqrt(256)
    assert q.std().item() == pytest.approx(1 / math.sqrt(3 * 256), rel=0.05)
    assert model.embed.weight.std().item() == pytest.approx(1.0, rel=0.05)
    tied = init_scale.build_model(small("gpt2", d=256), "pytorch")
    assert tied.head.weight is tied.embed.weight  # the tie survives: one N(0, 1) draw
    assert tied.embed.weight.std().item() == pytest.approx(1.0, rel=0.05)
    with pytest.raises(ValueError, match="scheme must be one of"):
        init_scale.build_model(small(), "zeros")


def test_residual_scaling_keeps_the_stream_flat_in_depth():
    blocks = torch.randint(0, 96, (32, 17))
    df = init_scale.depth_profile(small(d=32), [1, 16], ["scaled", "standard"], blocks, 4)
    last = df[df.layer == df.depth].set_index(["scheme", "depth"]).resid_rms
    assert last["scaled", 16] / last["scaled", 1] < 1.2  # 1/sqrt(2L): flat in depth
    assert last["standard", 16] / last["standard", 1] > 1.6  # grows about as sqrt(L)
    with pytest.raises(ValueError, match="at least one depth"):
        init_scale.depth_profile(small(), [], ["scaled"], blocks)


def test_coordinate_check_is_flat_under_mup_only():
    blocks = init_scale.byte_blocks(32)
    coords = mup.coord_check([32, 64, 128], blocks, base_width=32, steps=4, batch_size=8)
    s = mup.slopes(coords).drop(index="embed")  # the embedding's size is width-free in both
    assert s.loc[["attn.1", "mlp.1"], "SP"].min() > 1  # Adam's update grows with fan_in
    assert (s.SP - s.muP).min() > 0.8 and s.muP.abs().max() < 0.6
    with pytest.raises(ValueError, match="at least two positive widths"):
        mup.coord_check([32], blocks, base_width=32)


def test_best_lr_refines_the_grid_by_a_parabola():
    import pandas as pd

    lrs = [2.0 ** k for k in range(-10, -3)]
    rows = [{"param": p, "width": w, "lr": lr, "loss": (math.log2(lr) - c) ** 2}
            for p, c in (("SP", -7.3), ("muP", -6.0)) for w in (32, 64) for lr in lrs]
    best = mup.best_lrs(pd.DataFrame(rows)).set_index(["param", "width"])
    assert best.loc[("SP", 64), "best_lr"] == pytest.approx(2 ** -7.3)
    assert best.loc[("muP", 32), "grid_lr"] == 2 ** -6 and (best.shift_log2.abs() < 1e-9).all()


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 12), st.integers(1, 40), st.integers(0, 10_000))
def test_two_batch_estimator_with_single_examples_is_the_sample_variance(n, dim, seed):
    """With B_small = 1 the Appendix A.1 estimators are, algebraically, the unbiased sample
    variance (torch.var) and |mean|^2 minus the mean's own variance."""
    g = torch.randn(n, dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    g = g + torch.linspace(-1, 1, dim, dtype=torch.float64)
    small_sq = float(g.pow(2).sum(dim=1).mean())
    big_sq = float(g.mean(dim=0).pow(2).sum())
    two = noise_scale.simple_noise_scale(small_sq, big_sq, 1, n)
    direct = noise_scale.per_example(g)
    assert two[:2] == pytest.approx(direct[:2], rel=1e-9, abs=1e-9)


def test_noise_scale_estimator_is_unbiased():
    """Gradients G + noise with tr(Sigma) = dim * sigma^2: the averaged estimates recover
    |G|^2 and tr(Sigma)."""
    gen = torch.Generator().manual_seed(0)
    dim, sigma, b_small, n_small, trials = 20, 0.5, 2, 8, 4000
    G = torch.full((dim,), 0.1, dtype=torch.float64)
    per = torch.randn(trials, n_small, b_small, dim, generator=gen, dtype=torch.float64)
    small = G + sigma * per.mean(dim=2)  # (trials, n_small, dim): batch-of-2 gradients
    est = [noise_scale.simple_noise_scale(float(s.pow(2).sum(1).mean()),
                                          float(s.mean(0).pow(2).sum()), b_small,
                                          b_small * n_small) for s in small]
    g2, tr = (sum(e[i] for e in est) / trials for i in range(2))
    assert g2 == pytest.approx(float(G.pow(2).sum()), rel=0.05)
    assert tr == pytest.approx(dim * sigma ** 2, rel=0.02)
    with pytest.raises(ValueError, match="need 1 <= b_small < b_big"):
        noise_scale.simple_noise_scale(1.0, 0.5, 4, 4)


def test_noise_scale_of_the_model_matches_per_example_gradients():
    model = init_scale.build_model(small(), "scaled")
    blocks = torch.randint(0, 96, (64, 17))
    per = noise_scale.per_example(noise_scale.batch_grads(model, blocks, 1, 12, seed=3))
    two = noise_scale.measure(model, blocks, b_small=1, n_small=12, seed=3)
    assert two["B_simple"] == pytest.approx(per[2], rel=1e-4)
    assert all(p.grad is None for p in model.parameters())  # the model's gradients untouched


def test_the_loop_uses_the_configured_base_width(cache_dir):
    from trainbook.train import train

    res = train(TrainConfig(init="mup", mup_base_width=32, d_model=64, n_heads=2, n_kv_heads=2,
                            d_ff=176, n_layers=1, tokenizer="bytes", seq_len=16, batch_size=2,
                            steps=1, warmup_steps=0, log_every=0, progress=False,
                            eval_batches=1, cache_dir=cache_dir))
    assert res.model.mup_width_mult == 2.0


def test_rules_table_and_sweep_shapes():
    mp = drawn(small(d=64), "mup", base=16)
    table = mup.rules_table(mp)
    assert table.loc["blocks.i.mlp.up.weight", "lr x"] == 0.25
    assert table.loc["head.weight", "output x"] == 0.25 and len(table) == 12
    with pytest.raises(ValueError, match="not initialised under mup"):
        mup.rules_table(drawn(small()))
    blocks = init_scale.byte_blocks(16)
    sweep = mup.lr_sweep([16, 32], [1e-3, 1e-2], blocks, blocks[:8], base_width=16, steps=3,
                         batch_size=2, warmup_steps=1)
    assert len(sweep) == 8 and sweep.loss.notna().all()
    base = sweep[sweep.width == 16].pivot(index="lr", columns="param", values="loss")
    assert (base.SP == base.muP).all()  # at the base width muP is SP: one shared run
    with pytest.raises(ValueError, match="need positive learning rates"):
        mup.lr_sweep([16, 32], [], blocks, blocks[:8], base_width=16)
