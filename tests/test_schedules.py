"""Learning-rate schedules: the pure function, the trainer's use of it, the `schedule` command,
the native schedulers it must equal, and the chapter's experiments (book/pretraining/schedules)."""

import contextlib
import io
import json
import math

import pandas as pd
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainbook.__main__ import main
from trainbook.pretrain import schedules as S
from trainbook.train import TrainConfig, lr_at, train
from trainbook.train.config import DECAY_SHAPES, SCHEDULES
from trainbook.train.schedule import decay_start, learning_rate, phase, schedule_lrs

TINY = dict(d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32, seq_len=16, batch_size=4,
            eval_batches=2)


def old_cosine(step, cfg):
    """The trainer's cosine before this chapter, verbatim: it must stay bit-identical."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


runs = st.integers(1, 3000).flatmap(lambda n: st.tuples(
    st.just(n), st.integers(0, n), st.floats(1e-6, 10.0), st.floats(0.0, 1.0)))


@settings(max_examples=200, deadline=None)
@given(runs, st.data())
def test_cosine_is_bit_identical_to_the_old_trainer(run, data):
    steps, warmup, lr, floor = run
    cfg = TrainConfig(steps=steps, warmup_steps=warmup, lr=lr, min_lr_ratio=floor)
    step = data.draw(st.integers(0, steps))  # the loop uses 0 .. steps - 1
    assert lr_at(step, cfg) == old_cosine(step, cfg)


@settings(max_examples=200, deadline=None)
@given(runs, st.sampled_from(SCHEDULES), st.sampled_from(DECAY_SHAPES), st.floats(0.01, 1.0))
def test_every_schedule_warms_up_then_never_rises_and_ends_on_its_floor(run, kind, shape, frac):
    steps, warmup, lr, floor = run
    if kind == "wsd" and decay_start(steps, frac) < warmup:
        warmup = decay_start(steps, frac)
    lrs = [learning_rate(kind, t, steps, lr, warmup, floor, frac, shape) for t in range(steps + 1)]
    assert lrs[:warmup] == [lr * (t + 1) / warmup for t in range(warmup)]
    after = lrs[warmup:]
    assert all(b <= a for a, b in zip(after, after[1:]))
    assert all(floor * lr * (1 - 1e-12) <= x <= lr for x in after)
    end = lr if kind == "constant" or warmup == steps else floor * lr  # no steps left to decay
    assert lrs[-1] == pytest.approx(end, rel=1e-12)
    assert learning_rate(kind, steps + 7, steps, lr, warmup, floor, frac, shape) == lrs[-1]


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 2000), st.floats(0.01, 1.0), st.floats(0.0, 0.5))
def test_wsd_is_the_constant_run_until_its_decay_and_1sqrt_cools_faster(steps, frac, floor):
    start = decay_start(steps, frac)
    assert 0 <= start < steps and steps - start == max(1, math.floor(frac * steps + 0.5))
    warmup = min(start, 3)
    for t in range(start + 1):  # up to and including the first decay step (progress 0)
        assert learning_rate("wsd", t, steps, 1.0, warmup, floor, frac) == \
            learning_rate("constant", t, steps, 1.0, warmup)
    for t in range(start, steps):
        sq = learning_rate("wsd", t, steps, 1.0, warmup, floor, frac, "1-sqrt")
        lin = learning_rate("wsd", t, steps, 1.0, warmup, floor, frac, "linear")
        assert sq <= lin + 1e-15  # 1 - sqrt(q) <= 1 - q on [0, 1]


def test_named_values():
    assert learning_rate("cosine", 55, 100, 1.0, 10, 0.1) == pytest.approx(0.55)
    assert learning_rate("linear", 55, 100, 1.0, 10, 0.0) == pytest.approx(0.5)
    assert decay_start(100, 0.2) == 80
    assert learning_rate("wsd", 80, 100, 1.0, 10, 0.0) == 1.0
    assert learning_rate("wsd", 85, 100, 1.0, 10, 0.0, 0.2, "1-sqrt") == pytest.approx(0.5)
    assert learning_rate("wsd", 85, 100, 1.0, 10, 0.0, 0.2, "linear") == pytest.approx(0.75)
    assert learning_rate("constant", 99, 100, 0.5, 10, 0.1) == 0.5
    cfg = TrainConfig(schedule="wsd", steps=10, warmup_steps=2)
    assert [phase(t, cfg) for t in range(10)] == ["warmup"] * 2 + ["stable"] * 6 + ["decay"] * 2


@pytest.mark.parametrize("kind, floor", [("cosine", 0.1), ("cosine", 0.0), ("linear", 0.0),
                                         ("linear", 0.2), ("constant", 0.0)])
@pytest.mark.parametrize("warmup", [0, 1, 7])
def test_equals_torch_lr_schedulers(kind, floor, warmup):
    ours = [learning_rate(kind, t, 120, 3e-3, warmup, floor) for t in range(120)]
    assert ours == pytest.approx(S.native_lrs(kind, 120, 3e-3, warmup, floor), rel=1e-12,
                                 abs=1e-18)


@pytest.mark.parametrize("shape", DECAY_SHAPES)
@pytest.mark.parametrize("steps, warmup, frac, floor", [(100, 10, 0.2, 0.0), (97, 5, 0.13, 0.1),
                                                        (50, 0, 1.0, 0.0)])
def test_wsd_equals_transformers_after_warmup(shape, steps, warmup, frac, floor):
    ours = [learning_rate("wsd", t, steps, 1e-3, warmup, floor, frac, shape) for t in range(steps)]
    native = S.native_lrs("wsd", steps, 1e-3, warmup, floor, frac, shape)
    assert ours[warmup:] == pytest.approx(native[warmup:], rel=1e-12, abs=1e-18)


def test_library_defaults_the_chapter_relies_on():
    assert torch.optim.AdamW([torch.zeros(1)]).defaults["eps"] == 1e-8  # the sign-step argument
    assert (TrainConfig().beta2, TrainConfig().decay_frac) == (0.95, 0.2)
    # transformers warms up from min_lr_ratio * lr at step 0 (ours from lr / warmup_steps): the
    # chapter compares WSD only after warmup
    assert S.native_lrs("wsd", 10, 1.0, 4, 0.0)[:2] == [0.0, 0.25]
    assert learning_rate("wsd", 0, 10, 1.0, 4, 0.0) == 0.25


@pytest.mark.parametrize("kwargs, message", [
    (dict(kind="cosin"), "unknown schedule 'cosin'"),
    (dict(steps=0), "steps must be a whole number >= 1"),
    (dict(steps=10, warmup_steps=11), r"warmup_steps must be in \[0, steps=10\]"),
    (dict(lr=0.0), "peak learning rate must be > 0"),
    (dict(lr=float("nan")), "peak learning rate must be > 0"),
    (dict(min_lr_ratio=1.5), r"min_lr_ratio must be in \[0, 1\]"),
    (dict(decay_frac=0.0), r"decay_frac must be in \(0, 1\]"),
    (dict(decay_shape="cosine"), "unknown decay_shape 'cosine'"),
    (dict(kind="wsd", steps=10, warmup_steps=9), "do not fit in 10 steps"),
    (dict(step=-1), "step must be a whole number >= 0"),
    (dict(step=1.5), "step must be a whole number >= 0"),
])
def test_bad_schedule_inputs(kwargs, message):
    args = dict(kind="cosine", step=0, steps=100, lr=1e-3, warmup_steps=10)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        learning_rate(**args)


@pytest.mark.parametrize("changes, message", [
    (dict(schedule="wsd", steps=10, warmup_steps=9), "do not fit in 10 steps"),
    (dict(decay_frac=1.5), r"decay_frac must be in \(0, 1\]"),
    (dict(decay_shape="sqrt"), "decay_shape must be one of 1-sqrt, linear, got 'sqrt'"),
    (dict(schedule="step"), "schedule must be one of cosine, wsd, linear, constant"),
])
def test_bad_configs_fail_before_training(changes, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**changes)


@pytest.mark.parametrize("kind", ["wsd", "linear"])
def test_command_lists_what_the_trainer_logs(kind, cache_dir, capsys):
    argv = ["schedule", "--kind", kind, "--steps", "10", "--warmup-steps", "2", "--lr", "0.01",
            "--min-lr-ratio", "0", "--decay-frac", "0.3", "--json"]
    assert main(argv) == 0
    listed = json.loads(capsys.readouterr().out)["lr"]
    res = train(TrainConfig(**TINY, tokenizer="bytes", schedule=kind, steps=10, warmup_steps=2,
                            lr=0.01, min_lr_ratio=0.0, decay_frac=0.3, progress=False,
                            log_every=0, cache_dir=cache_dir))
    assert listed == [r["lr"] for r in res.history]  # exactly: the same function


def test_command_table_shows_every_phase_boundary(capsys):
    assert main(["schedule", "--kind", "wsd", "--steps", "1000", "--warmup-steps", "50",
                 "--rows", "3"]) == 0
    out = capsys.readouterr().out
    steps = {int(line.split()[0].replace(",", "")) for line in out.splitlines()
             if line.strip() and line.split()[0].replace(",", "").isdigit()}
    assert {1, 50, 51, 800, 801, 1000} <= steps
    assert "warmup 50, stable 750, decay 200" in out


@pytest.mark.parametrize("argv, message", [
    (["--kind", "step"], "--kind 'step' is not a schedule"),
    (["--decay-shape", "sqrt"], "--decay-shape 'sqrt' is not a decay shape"),
    (["--rows", "1"], "--rows must be >= 2"),
    (["--steps", "0"], "steps must be >= 1"),
    (["--kind", "wsd", "--steps", "10", "--warmup-steps", "9"], "do not fit in 10 steps"),
    (["--decay-frac", "2"], r"decay_frac must be in (0, 1]"),
    (["--lr", "-1"], "need lr > 0"),
])
def test_command_bad_input_is_one_line(argv, message, capsys):
    assert main(["schedule", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err


def test_schedule_lrs_covers_every_step():
    cfg = TrainConfig(schedule="constant", steps=5, warmup_steps=2, lr=1.0)
    assert schedule_lrs(cfg) == [0.5, 1.0, 1.0, 1.0, 1.0]


def test_adam_update_rms_is_one_on_the_first_step_and_matches_torch():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(64, 32))
    opt = torch.optim.AdamW([w], lr=0.1, weight_decay=0.0)
    for step in range(3):
        before = w.detach().clone()
        loss = (w ** 3).sum() if step == 0 else (w.sin() * torch.randn(64, 32)).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        rms = S.adam_update_rms(opt.state_dict())
        moved = ((w.detach() - before) / 0.1).pow(2).mean().sqrt().item()
        assert rms == pytest.approx(moved, rel=1e-4)  # the step torch took, divided by lr
        if step == 0:
            assert rms == pytest.approx(1.0, abs=1e-4)  # sign(g): whatever the gradient scale
    with pytest.raises(ValueError, match="needs an optimizer state_dict"):
        S.adam_update_rms({})
    with pytest.raises(ValueError, match="Adam or AdamW"):
        S.adam_update_rms(torch.optim.SGD([w], lr=0.1).state_dict())
    with pytest.raises(ValueError, match="take a step first"):
        S.adam_update_rms(torch.optim.AdamW([w]).state_dict())


def test_update_rms_trace_reads_every_step(cache_dir):
    trace = S.update_rms_trace(4, **TINY, warmup_steps=0, lr=1e-2, cache_dir=cache_dir)
    assert len(trace) == 4 and trace[0] == pytest.approx(1.0, abs=1e-3) and trace[-1] < 1.0
    with pytest.raises(ValueError, match="steps must be >= 1"):
        S.update_rms_trace(0)


def test_instability_says_why():
    v = 256
    ok = [5.5, 5.0, 4.0, 3.5, 3.2, 3.1, 3.0, 3.0]
    assert S.instability(ok, v) == ""
    assert S.instability([5.5, float("nan"), 3.0], v) == "non-finite loss"
    assert S.instability([5.5, 6.2, 3.0, 3.0], v).startswith("spike: loss rose 0.70")
    assert S.instability([5.5, 5.4, 5.0, 4.9], v).startswith("did not learn")
    assert S.instability([5.5, 6.2, 3.0, 3.0, 3.0, 3.0], v, spike=1.0) == ""
    with pytest.raises(ValueError, match="at least one loss"):
        S.instability([], v)
    with pytest.raises(ValueError, match="vocab_size >= 2"):
        S.instability(ok, 1)


def test_largest_stable_lr_stops_at_the_first_unstable_rate():
    grid = pd.DataFrame({"lr": [0.1, 0.3, 1.0] * 2, "warmup_steps": [0] * 3 + [5] * 3,
                         "stable": [True, False, True, False, True, True]})
    largest = S.largest_stable_lr(grid)
    assert largest[0] == 0.1 and math.isnan(largest[5])
    with pytest.raises(ValueError, match="stability_grid's table"):
        S.largest_stable_lr(pd.DataFrame({"lr": [0.1]}))


def test_stability_grid_and_ablation_shapes(cache_dir):
    grid, losses = S.stability_grid((1e-3, 3.0), (0, 2), 6, **TINY, cache_dir=cache_dir)
    assert len(grid) == 4 and set(losses) == {(1e-3, 0), (3.0, 0), (1e-3, 2), (3.0, 2)}
    assert all(len(x) == 6 for x in losses.values())
    assert grid.set_index(["lr", "warmup_steps"]).loc[(3.0, 0)].peak_loss > math.log(256)
    abl = S.warmup_ablation(0.01, 2, 5, **TINY, cache_dir=cache_dir)
    assert sorted(abl.warmup_steps.unique()) == [0, 2] and len(abl) == 10
    assert abl[abl.warmup_steps == 2].lr.tolist()[:2] == [0.005, 0.01]
    with pytest.raises(ValueError, match="leave no steps at the peak"):
        S.stability_grid((1e-3,), (0, 6), 6)
    with pytest.raises(ValueError, match="at least one learning rate"):
        S.stability_grid((), (0,), 6)
    with pytest.raises(ValueError, match="warmup_steps must be >= 1"):
        S.warmup_ablation(0.01, 0, 5)


def test_wsd_branches_reproduce_from_scratch_wsd_runs(cache_dir):
    """A cooldown branched from the constant run's checkpoint is the WSD run, bit for bit."""
    kw = dict(**TINY, lr=1e-2, warmup_steps=2, min_lr_ratio=0.0, cache_dir=cache_dir)
    table, losses = S.wsd_branches((10, 20), 0.2, ("1-sqrt", "linear"), **kw)
    assert set(table.schedule) == {"stable (constant)", "wsd 1-sqrt", "wsd linear", "cosine"}
    assert table.set_index(["schedule", "steps"]).steps_trained.to_dict() == {
        ("stable (constant)", 16): 16, ("wsd 1-sqrt", 10): 2, ("wsd linear", 10): 2,
        ("cosine", 10): 10, ("wsd 1-sqrt", 20): 4, ("wsd linear", 20): 4, ("cosine", 20): 20}
    for n in (10, 20):
        scratch = S.run(**kw, schedule="wsd", steps=n, decay_frac=0.2, decay_shape="linear")
        assert losses[("wsd linear", n)] == scratch.losses()
    with pytest.raises(ValueError, match="do not fit in 4 steps"):
        S.wsd_branches((4,), 0.5, warmup_steps=3)
    with pytest.raises(ValueError, match="at least one length"):
        S.wsd_branches(())


def test_native_lrs_rejects_bad_input():
    with pytest.raises(ValueError, match="unknown schedule"):
        S.native_lrs("step", 10, 1e-3)


def test_the_experiments_leave_the_thread_count_alone(cache_dir):
    threads = torch.get_num_threads()
    with contextlib.redirect_stdout(io.StringIO()):
        S.run(**TINY, steps=2, warmup_steps=1, cache_dir=cache_dir)
    assert torch.get_num_threads() == threads
