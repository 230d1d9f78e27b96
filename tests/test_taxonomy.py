"""The taxonomy of training failures (book/stability/taxonomy): every record points at an
existing chapter and an existing package function, the checks catch what they should, the
planted silent data corruption and the loss-scale collapse behave as described, and the small
signature runs show the signatures the chapter teaches."""

import math

import pytest
import torch

from trainbook.stability import taxonomy as T
from trainbook.train.hooks import StepContext


def test_every_record_points_at_an_existing_chapter_and_function():
    assert T.check_records() == []
    reproduced = [f for f in T.FAILURES if f.chapter]
    assert len(reproduced) >= 14 and len(reproduced) == len(T.FAILURES)
    for f in T.FAILURES:
        assert f.name and f.signature and f.cause and f.fix


def test_check_records_catches_a_missing_chapter_function_and_duplicate(tmp_path):
    bad = [T.Failure("a", "s", "c", "f", "stability/nowhere", "trainbook.stability.spikes.replay"),
           T.Failure("b", "s", "c", "f", "stability/loss-spikes",
                     "trainbook.stability.spikes.no_such_function"),
           T.Failure("b", "s", "c", "f", future="Part 6")]
    problems = T.check_records(bad)
    assert any("a: no chapter book/stability/nowhere" in p for p in problems)
    assert any("has no 'no_such_function'" in p for p in problems)
    assert any("b: listed twice" in p for p in problems)
    assert T.check_records(bad[:1], book=tmp_path)[0].startswith("a: no chapter")


def test_records_need_a_reproduction_or_a_future():
    with pytest.raises(ValueError, match="both a chapter and a function"):
        T.Failure("x", "s", "c", "f", chapter="stability/loss-spikes")
    with pytest.raises(ValueError, match="says where it will be"):
        T.Failure("x", "s", "c", "f")
    assert T.resolve("trainbook.stability.spikes.restart_and_skip").__name__ == "restart_and_skip"
    assert T.resolve("trainbook.train.monitor.SpikeMonitor.score").__name__ == "score"
    with pytest.raises(ValueError, match="no module of the package"):
        T.resolve("nothing.at.all")


def test_tables_have_a_row_per_record():
    t = T.failure_table()
    assert list(t.index) == [f.name for f in T.FAILURES]
    assert t.loc["hangs and desynchronisation", "reproduced in"] == "failures/hangs: plant"
    assert t.loc["lingering spike", "reproduced in"] == "stability/loss-spikes: restart_and_skip"
    d = T.decision_table()
    assert list(d.columns) == ["first check", "tool", "fix"] and len(d) == len(T.DECISIONS)


def test_bitflip_flips_one_bit_once():
    model = torch.nn.Linear(4, 4)
    with torch.no_grad():
        model.weight.fill_(0.5)
    flip = T.BitFlip("weight", step=3)
    ctx = StepContext(3, model, None, [], 1.0, 1.0, None)
    before = model.weight.detach().clone()
    flip.after_update(ctx)
    changed = (model.weight != before).nonzero()
    assert len(changed) == 1 and flip.done == (0.5, 0.5 * 2.0**128)
    flip.after_update(ctx)  # once only
    assert (model.weight != before).sum() == 1
    with pytest.raises(ValueError, match="no parameter 'nope'"):
        T.BitFlip("nope", 3).after_update(ctx)
    with pytest.raises(ValueError, match="0 <= bit <= 31"):
        T.BitFlip("weight", 3, bit=32)


def test_scale_collapse_halves_the_scale_at_every_step_after_the_overflow():
    d = T.scale_collapse(steps=40, overflow_from=25, growth_interval=5)
    before, after = d[d.step < 25], d[d.step >= 25]
    assert not before.skipped.any() and after.skipped.all()
    assert before.loss_scale.iloc[-1] == 2.0**16 * 2**4  # grew every 5 good steps
    ratios = (after.loss_scale.shift(-1) / after.loss_scale).dropna()
    assert (ratios == 0.5).all() and not math.isfinite(after.loss.iloc[0])
    with pytest.raises(ValueError, match="1 < overflow_from <= steps"):
        T.scale_collapse(steps=10, overflow_from=20)


def test_signature_runs_show_the_signatures():
    runs = T.signature_runs(steps=80, spike_at=60)
    healthy, attn, div = runs["healthy"], runs["attention logits"], runs["divergence"]
    assert attn.attn_logit_max.max() > 30 * healthy.attn_logit_max.max()
    assert div.loss.tail(10).mean() > math.log(256) > healthy.loss.tail(10).mean()
    spike = runs["data spike"].set_index("step")
    assert spike.loss[60] > healthy.set_index("step").loss[60] + 2  # flagged later in a run
    rep = runs["repeated string"].set_index("step")
    assert rep.loss[60] > healthy.set_index("step").loss[60] + 2 and rep.loss[65] < spike.loss[65]
    sdc = runs["SDC"]
    first, replay = sdc[sdc.attempt == 0], sdc[sdc.attempt == 1]
    assert first.spike.iloc[-1] and first.step.iloc[-1] == 61  # the step after the flip
    assert first.grad_norm.iloc[-1] == 0 and first.loss.iloc[-1] == pytest.approx(math.log(256),
                                                                                  abs=0.01)
    assert list(replay.loss) == list(healthy.loss)  # the replay is the healthy run
    assert runs["fp16"].loss_scale.eq(1.0).all() and runs["fp16 + loss scaling"].skipped.any()
    assert runs["fp16"].loss.tail(10).mean() > runs["fp16 + loss scaling"].loss.tail(10).mean()
    with pytest.raises(ValueError, match="spike_at must leave room"):
        T.signature_runs(steps=30, spike_at=25)
