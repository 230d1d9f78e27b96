"""Optimizers: the from-scratch versions (trainbook.pretrain.optimizers) against torch.optim, Lion
against the lion-pytorch package and its defining properties, optimizer state against the memory
estimator, and every optimizer through the trainer (CLI, checkpoint resume, GradScaler)."""

import dataclasses
import inspect
import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lion_pytorch import Lion as LionReference

from trainbook import configs
from trainbook.__main__ import main
from trainbook.compute import memory as M
from trainbook.model import Transformer
from trainbook.pretrain import optimizers as O
from trainbook.train import TrainConfig, latest_checkpoint, make_optimizer, train
from trainbook.train.config import OPTIMIZERS
from trainbook.train.optim import Composite, Lion, is_hidden_matrix, split_hidden

SHAPES = [(24, 40), (40, 24), (16,), (8, 8)]
MATRICES = [(8, 12), (12, 8)]
FEW = settings(max_examples=12, deadline=None,
               suppress_health_check=[HealthCheck.function_scoped_fixture])


def max_gap(make_a, make_b, steps=30, shapes=SHAPES, lr_decay=0.97):
    return O.max_difference(make_a, make_b, shapes, steps, lr_decay)


def defaults(cls) -> dict:
    return {k: v.default for k, v in inspect.signature(cls).parameters.items()
            if v.default is not inspect.Parameter.empty}


# ---------------------------------------------------------------------------------------------
# Library defaults the chapter states
# ---------------------------------------------------------------------------------------------

def test_torch_defaults_the_chapter_relies_on():
    adamw = defaults(torch.optim.AdamW)
    assert (adamw["lr"], adamw["betas"], adamw["eps"], adamw["weight_decay"]) == \
        (1e-3, (0.9, 0.999), 1e-8, 0.01)
    assert defaults(torch.optim.Adam)["weight_decay"] == 0
    sgd = defaults(torch.optim.SGD)
    assert (sgd["momentum"], sgd["dampening"], sgd["nesterov"]) == (0, 0, False)
    ada = defaults(torch.optim.Adafactor)
    assert (ada["lr"], ada["beta2_decay"], ada["eps"], ada["d"], ada["weight_decay"]) == \
        (1e-2, -0.8, (None, 1e-3), 1.0, 0.0)
    muon = defaults(torch.optim.Muon)
    assert muon == {"lr": 1e-3, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True,
                    "ns_coefficients": (3.4445, -4.775, 2.0315), "eps": 1e-7, "ns_steps": 5,
                    "adjust_lr_fn": None}
    assert O.MUON_NS == muon["ns_coefficients"]
    assert defaults(LionReference)["betas"] == defaults(Lion)["betas"] == (0.9, 0.99)


@pytest.mark.parametrize("ours, theirs", [(O.SGD, torch.optim.SGD), (O.Adam, torch.optim.Adam),
                                          (O.AdamW, torch.optim.AdamW),
                                          (O.Adafactor, torch.optim.Adafactor),
                                          (O.Muon, torch.optim.Muon), (Lion, LionReference)])
def test_from_scratch_defaults_are_the_references(ours, theirs):
    mine, ref = defaults(ours), defaults(theirs)
    shared = set(mine) & set(ref)
    assert len(shared) >= 3 and {k: mine[k] for k in shared} == {k: ref[k] for k in shared}


# ---------------------------------------------------------------------------------------------
# From scratch = torch.optim, over many steps
# ---------------------------------------------------------------------------------------------

@FEW
@given(lr=st.floats(1e-4, 0.5), momentum=st.sampled_from([0.0, 0.5, 0.9, 0.99]),
       wd=st.sampled_from([0.0, 1e-2, 0.1]), nesterov=st.booleans())
def test_sgd_matches_torch_bit_for_bit(lr, momentum, wd, nesterov):
    nesterov = nesterov and momentum > 0
    kw = dict(lr=lr, momentum=momentum, weight_decay=wd, nesterov=nesterov)
    assert max_gap(lambda p: O.SGD(p, **kw), lambda p: torch.optim.SGD(p, **kw)) == 0.0


@FEW
@given(lr=st.floats(1e-4, 0.1), b1=st.floats(0.0, 0.99), b2=st.floats(0.9, 0.9999),
       eps=st.sampled_from([1e-8, 1e-6]), wd=st.sampled_from([0.0, 1e-2, 0.1]))
def test_adam_and_adamw_match_torch_bit_for_bit(lr, b1, b2, eps, wd):
    kw = dict(lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    assert max_gap(lambda p: O.Adam(p, **kw), lambda p: torch.optim.Adam(p, **kw)) == 0.0
    assert max_gap(lambda p: O.AdamW(p, **kw), lambda p: torch.optim.AdamW(p, **kw)) == 0.0


@FEW
@given(lr=st.floats(1e-3, 0.1), decay=st.floats(-1.0, -0.5), d=st.floats(1.0, 2.0),
       wd=st.sampled_from([0.0, 0.1]))
def test_adafactor_matches_torch_to_float_rounding(lr, decay, d, wd):
    kw = dict(lr=lr, beta2_decay=decay, d=d, weight_decay=wd)
    gap = max_gap(lambda p: O.Adafactor(p, **kw), lambda p: torch.optim.Adafactor(p, **kw),
                  steps=50)
    assert gap < 2e-5  # row and column means summed in another order; parameters ~N(0, 1)


@settings(max_examples=6, deadline=None)  # bf16 Newton-Schulz: slow where bf16 is emulated
@given(lr=st.floats(1e-3, 0.1), momentum=st.floats(0.5, 0.99), nesterov=st.booleans(),
       wd=st.sampled_from([0.0, 0.1]), adjust=st.sampled_from([None, "match_rms_adamw"]))
def test_muon_matches_torch_bit_for_bit(lr, momentum, nesterov, wd, adjust):
    kw = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=wd, adjust_lr_fn=adjust)
    assert max_gap(lambda p: O.Muon(p, **kw), lambda p: torch.optim.Muon(p, **kw),
                   steps=10, shapes=MATRICES) == 0.0


@FEW
@given(lr=st.floats(1e-5, 1e-2), b1=st.floats(0.5, 0.99), b2=st.floats(0.9, 0.999),
       wd=st.sampled_from([0.0, 0.1, 1.0]))
def test_lion_matches_lion_pytorch_bit_for_bit(lr, b1, b2, wd):
    kw = dict(lr=lr, betas=(b1, b2), weight_decay=wd)
    assert max_gap(lambda p: Lion(p, **kw), lambda p: LionReference(p, **kw), steps=50) == 0.0


def test_lion_follows_algorithm_2_and_moves_every_element_by_lr():
    """Chen et al. 2023, Algorithm 2: c = b1 m + (1 - b1) g; p <- p - lr (sign(c) + wd p);
    m <- b2 m + (1 - b2) g. Written out here in float64 as the reference."""
    lr, wd, (b1, b2) = 1e-3, 0.5, (0.9, 0.99)
    p = torch.nn.Parameter(torch.randn(64, 32, dtype=torch.float64))
    ref, m = p.detach().clone(), torch.zeros_like(p)
    opt = Lion([p], lr=lr, weight_decay=wd)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64)
        before = p.detach().clone()
        opt.step()
        c = b1 * m + (1 - b1) * p.grad
        ref = ref - lr * (torch.sign(c) + wd * ref)
        m = b2 * m + (1 - b2) * p.grad
        torch.testing.assert_close(p.detach(), ref, rtol=0, atol=1e-12)
        # the sign: after the decay, every element moves by exactly lr ...
        torch.testing.assert_close((p.detach() - before * (1 - lr * wd)).abs(),
                                   torch.full_like(ref, lr), rtol=0, atol=1e-12)
        # ... so no element moves by more than lr (1 + wd |p|)
        assert ((p.detach() - before).abs() <= lr * (1 + wd * before.abs()) + 1e-12).all()
    assert set(opt.state[p]) == {"exp_avg"}  # one state tensor: the momentum


def test_classic_momentum_equals_pytorchs_until_the_learning_rate_changes():
    kw = dict(lr=0.05, momentum=0.9)
    same = max_gap(lambda p: O.SGD(p, **kw), lambda p: O.SGD(p, classic=True, **kw),
                   lr_decay=1.0)
    assert same < 1e-5  # the same steps: classic's velocity is -lr times PyTorch's
    assert max_gap(lambda p: O.SGD(p, **kw), lambda p: O.SGD(p, classic=True, **kw),
                   lr_decay=0.8) > 10 * same
    df = O.lr_drop(momentum=0.9, lr=0.1, factor=10, drop_at=20, steps=40)
    step = df.pivot(index="step", columns="convention", values="step_size")
    assert step.loc[21, "pytorch"] / step.loc[20, "pytorch"] < 0.11  # drops at once
    assert step.loc[21, "classic"] / step.loc[20, "classic"] > 0.9  # old velocity decays


def test_adam_first_step_moves_every_element_by_lr():
    p = torch.nn.Parameter(torch.randn(100, dtype=torch.float64))
    before = p.detach().clone()
    signs = torch.randint(0, 2, (100,), generator=torch.Generator().manual_seed(0)) * 2 - 1
    p.grad = signs * torch.logspace(-2, 3, 100, dtype=torch.float64)  # five decades of scale
    O.Adam([p], lr=1e-3).step()
    torch.testing.assert_close((p.detach() - before).abs(),
                               torch.full((100,), 1e-3, dtype=torch.float64), rtol=1e-6, atol=0)


def test_l2_in_adam_decays_by_gradient_scale_and_adamw_does_not():
    df = O.decay_in_one_step(grad_scales=(1.0, 1e-3), lr=1e-3, weight_decay=0.1)
    # one step of L2 decay enters m with weight (1 - b1) and is divided by sqrt(v_hat)
    adamw = df[df.optimizer == "AdamW"]["decay / (lr wd)"].tolist()
    l2 = df[df.optimizer == "Adam + L2"]["decay / (lr wd)"].tolist()
    assert adamw == pytest.approx([1.0, 1.0], rel=1e-6)
    assert l2[0] < 0.2 and l2[1] > 5  # large gradients: weak decay; small: strong


def test_newton_schulz_orthogonalises_and_ignores_scale():
    G = torch.randn(48, 128, generator=torch.Generator().manual_seed(0))
    X = O.newton_schulz(G, dtype=torch.float32)
    s = torch.linalg.svdvals(X)
    assert 0.6 < s.min() and s.max() < 1.2  # every singular value pushed towards 1
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    assert torch.nn.functional.cosine_similarity(X.flatten(), (U @ Vh).flatten(), dim=0) > 0.98
    torch.testing.assert_close(O.newton_schulz(1e3 * G, dtype=torch.float32), X, atol=1e-5,
                               rtol=0)
    assert O.newton_schulz(G.T, dtype=torch.float32).shape == (128, 48)
    with pytest.raises(ValueError, match="2-D matrix"):
        O.newton_schulz(torch.ones(3))


# ---------------------------------------------------------------------------------------------
# State memory: measured from the state_dict, fed to the estimator
# ---------------------------------------------------------------------------------------------

def stepped(model, cfg, scratch=False):
    opt = O.build(model, cfg) if scratch else make_optimizer(model, cfg)
    x = torch.randint(0, model.cfg.vocab_size, (2, 16))
    model(x, x)[1].backward()
    opt.step()
    opt.zero_grad()
    return opt


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt2"])
def test_state_bytes_measured_match_the_memory_estimator(preset):
    mcfg = configs.get(preset).with_(vocab_size=256, max_seq_len=64, d_model=32, n_heads=2,
                                     n_kv_heads=2, d_ff=64, n_layers=2)
    model = Transformer(mcfg)
    n = sum(p.numel() for p in model.parameters())
    vectors = sum(p.numel() for p in model.parameters() if p.dim() == 1)
    for name in OPTIMIZERS:
        cfg = TrainConfig(optimizer=name)
        measured = O.state_bytes(stepped(model, cfg))["bytes_per_param"]
        assert O.state_bytes(stepped(model, cfg, scratch=True))["bytes_per_param"] == measured
        est = M.estimate(M.MemoryInputs(model=mcfg, dtype="fp32", optimizer=name,
                                        seq_len=16)).optimizer / n
        if name == "adafactor":  # rows + cols per matrix, a full second moment per vector
            rc = sum(sum(p.shape) for p in model.parameters() if p.dim() == 2)
            assert measured == 4 * (rc + vectors) / n
            # the estimator spreads the matrices' rows + cols over all parameters (the ratio
            # of rows + cols to matrix elements) and leaves the vectors' second moment out
            mats = sum(p.numel() for p in model.parameters() if p.dim() == 2)
            assert est == pytest.approx(4 * rc / mats, rel=1e-12) and est < measured
        else:
            assert measured == pytest.approx(est, rel=1e-12), name
    plain = torch.optim.SGD(model.parameters(), lr=0.1)  # momentum 0: no state at all
    model(torch.zeros(1, 4, dtype=torch.long))[0].sum().backward()
    plain.step()
    assert O.state_bytes(plain)["bytes_per_param"] == M.state_bytes_per_param(
        "fp32", "sgd-plain")["optimizer"] == 0


def test_memory_estimator_optimizer_choices():
    per = {o: M.state_bytes_per_param("fp32", o)["optimizer"] for o in M.OPTIMIZERS}
    assert per["adamw"] == per["adam"] == 8 and per["lion"] == per["muon"] == per["sgd"] == 4
    assert per["sgd-plain"] == 0
    assert M.state_bytes_per_param("bf16", "lion")["optimizer"] == 8  # + fp32 master weights
    assert M.MemoryInputs(params=100).optimizer == "adamw"  # the default is unchanged
    bare = M.estimate(M.MemoryInputs(params=10**6, optimizer="muon"))
    assert any("muon" in n for n in bare.notes)
    llama = configs.get("llama-3-8b")
    big = M.estimate(M.MemoryInputs(model=llama, optimizer="muon", dtype="fp32", dp=8, zero=1))
    lion = M.estimate(M.MemoryInputs(model=llama, optimizer="lion", dtype="fp32", dp=8, zero=1))
    c = configs.param_counts(llama)  # AdamW's second moment: embedding, head, norms (13%)
    share = (c["embedding"] + c["head"] + c["norms"]) / c["total"]
    assert big.optimizer / lion.optimizer == pytest.approx(1 + share, rel=1e-12)
    with pytest.raises(ValueError, match="optimizer"):
        M.state_bytes_per_param("fp32", "adagrad")


def test_state_elements_of_the_newer_optimizers():
    e = O.state_elements(4096, 14336)
    assert e["adafactor"] == 4096 + 14336 and e["lion"] == e["muon"] == 4096 * 14336
    assert e["soap"] > e["shampoo"] > e["adam(w)"] == e["sophia"]
    with pytest.raises(ValueError, match="rows, cols >= 1"):
        O.state_elements(0, 3)


# ---------------------------------------------------------------------------------------------
# The trainer: every optimizer, the composite for Muon, resume, GradScaler, CLI
# ---------------------------------------------------------------------------------------------

def tiny(**kw):
    base = dict(model="tiny-llama", d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32,
                tokenizer="bytes", seq_len=16, batch_size=8, steps=12, warmup_steps=2,
                log_every=0, progress=False, eval_batches=2)
    base.update(kw)
    return TrainConfig(**base)


LRS = {"adamw": 1e-2, "adam": 1e-2, "sgd": 0.3, "adafactor": 0.1, "lion": 3e-3, "muon": 1e-2}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_optimizer_trains_through_the_trainer(name):
    r = train(tiny(optimizer=name, lr=LRS[name]))
    losses = r.losses()
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 0.3


@pytest.mark.parametrize("name", ["muon", "lion"])
def test_resume_is_exact_for_muon_and_lion(name, tmp_path):
    cfg = tiny(optimizer=name, lr=LRS[name], steps=8)
    full = train(dataclasses.replace(cfg, ckpt_dir=str(tmp_path / "full")))
    part = dataclasses.replace(cfg, ckpt_dir=str(tmp_path / "part"), stop_after=3)
    train(part)
    assert latest_checkpoint(tmp_path / "part").name == "step-000003.pt"
    resumed = train(dataclasses.replace(part, stop_after=None, resume=True))
    assert resumed.losses() == full.losses()
    for a, b in zip(resumed.model.parameters(), full.model.parameters()):
        assert torch.equal(a, b)


def test_muon_composite_splits_hidden_matrices_from_the_rest():
    model = Transformer(configs.get("tiny-llama"))
    opt = make_optimizer(model, TrainConfig(optimizer="muon", lr=0.02))
    assert isinstance(opt, Composite)
    muon, adamw = opt.parts
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    names = {id(p): n for n, p in model.named_parameters()}
    in_muon = {names[id(p)] for g in muon.param_groups for p in g["params"]}
    assert in_muon == {n for n, p in model.named_parameters() if is_hidden_matrix(n, p)}
    assert {"embed.weight", "head.weight", "norm.weight"} <= \
        {names[id(p)] for g in adamw.param_groups for p in g["params"]}
    for g in opt.param_groups:  # the loop's lr writes reach the parts' own groups
        g["lr"] = 0.5 * g["lr_scale"]
    assert all(g["lr"] == 0.5 for part in opt.parts for g in part.param_groups)
    assert all(g["adjust_lr_fn"] == "match_rms_adamw" for g in muon.param_groups)
    hidden, rest = split_hidden(model, [{"params": list(model.parameters()), "lr_scale": 2.0}])
    assert hidden[0]["lr_scale"] == rest[0]["lr_scale"] == 2.0


def test_grad_scaler_steps_the_composite_like_an_unscaled_step():
    def run(scaled):
        torch.manual_seed(0)
        model = Transformer(configs.get("tiny-llama").with_(d_model=32, n_heads=2, n_layers=1,
                                                           n_kv_heads=1, d_ff=64))
        opt = make_optimizer(model, TrainConfig(optimizer="muon", lr=1e-2))
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, enabled=scaled)
        x = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
        for _ in range(3):
            scaler.scale(model(x, x)[1]).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]
    for a, b in zip(run(True), run(False)):  # a power-of-two scale unscales exactly
        assert torch.equal(a, b)


def test_composite_state_dict_round_trip_and_bad_input():
    model = Transformer(configs.get("tiny-llama").with_(d_model=32, n_heads=2, n_kv_heads=1,
                                                        n_layers=1))
    cfg = TrainConfig(optimizer="muon")
    opt = stepped(model, cfg)
    fresh = make_optimizer(model, cfg)
    fresh.load_state_dict(opt.state_dict())
    for p in model.parameters():  # the parts see the loaded state
        assert all(torch.equal(a, b) for a, b in zip(fresh.state[p].values(),
                                                        opt.state[p].values()))
    assert fresh.parts[0].state is fresh.state
    with pytest.raises(ValueError, match="at least one optimizer"):
        Composite()
    with pytest.raises(ValueError, match="optimizer must be one of"):
        TrainConfig(optimizer="adagrad")
    with pytest.raises(ValueError, match="Lion needs lr > 0"):
        Lion(model.parameters(), lr=0.0)
    with pytest.raises(ValueError, match="2-D matrices only"):
        O.Muon(model.parameters())


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw", "adafactor", "lion", "muon"])
def test_from_scratch_twin_follows_the_trainers_optimizer(name):
    """`build` = `make_optimizer` with this module's classes: the same trajectory."""
    def run(maker):
        torch.manual_seed(0)
        model = Transformer(configs.get("tiny-llama").with_(d_model=32, n_heads=2, n_layers=1,
                                                           n_kv_heads=1, d_ff=64))
        opt = maker(model, TrainConfig(optimizer=name, lr=LRS[name]))
        x = torch.randint(0, 512, (4, 16), generator=torch.Generator().manual_seed(1))
        for _ in range(5):
            model(x, x)[1].backward()
            opt.step()
            opt.zero_grad()
        return torch.cat([p.detach().flatten() for p in model.parameters()])
    gap = (run(make_optimizer) - run(O.build)).abs().max().item()
    assert gap <= (1e-6 if name == "adafactor" else 0.0)


def test_train_command_takes_an_optimizer(capsys):
    argv = ["train", "--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--n-kv-heads",
            "1", "--d-ff", "32", "--tokenizer", "bytes", "--seq-len", "16", "--batch-size", "4",
            "--steps", "2", "--warmup-steps", "1", "--no-progress", "--json"]
    assert main([*argv, "--optimizer", "lion", "--lr", "1e-3"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == 2
    assert main([*argv, "--optimizer", "adagrad"]) == 2
    assert "optimizer must be one of adamw, adam, sgd" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# The chapter's sweep and its bad input
# ---------------------------------------------------------------------------------------------

def test_lr_sweep_rows_and_divergence():
    df = O.lr_sweep({"adamw": [1e-2], "muon": [1e-2], "sgd": [1e6]}, steps=4, d_model=16,
                    seq_len=16, batch_size=4, warmup_steps=1, eval_batches=1)
    assert list(df.optimizer) == ["adamw", "muon", "sgd"]
    assert math.isfinite(df.loss[0]) and math.isfinite(df.loss[1])
    assert math.isinf(df.loss[2])  # lr 1e6 diverges, and is reported as such


@pytest.mark.parametrize("call, message", [
    (lambda: O.lr_sweep({"adagrad": [1e-3]}), "grid maps optimizers"),
    (lambda: O.lr_sweep({"adamw": [-1.0]}), "grid maps optimizers"),
    (lambda: O.lr_sweep({"adamw": [1e-3]}, steps=5, warmup_steps=10), "warmup_steps"),
    (lambda: O.SGD([torch.nn.Parameter(torch.ones(1))], lr=0), "lr must be > 0"),
    (lambda: O.SGD([torch.nn.Parameter(torch.ones(1))], lr=1, nesterov=True), "nesterov"),
    (lambda: O.Adam([torch.nn.Parameter(torch.ones(1))], betas=(1.0, 0.9)), "betas"),
    (lambda: O.Adafactor([torch.nn.Parameter(torch.ones(1))], d=0.5), "d >= 1"),
    (lambda: O.Muon([torch.nn.Parameter(torch.ones(2, 2))], adjust_lr_fn="x"), "adjust_lr_fn"),
    (lambda: O.decay_in_one_step(grad_scales=()), "positive gradient scales"),
    (lambda: O.lr_drop(drop_at=50, steps=40), "drop_at < steps"),
    (lambda: O.max_difference(O.SGD, O.SGD, steps=0), "steps >= 1"),
    (lambda: O.state_bytes(torch.optim.SGD([torch.zeros(0, requires_grad=True)], lr=1)),
     "no parameters"),
])
def test_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()
