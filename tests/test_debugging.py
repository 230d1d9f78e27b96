"""Numerical debugging (book/stability/debugging): the first inf or NaN (train.monitor's
find_nonfinite and NanMonitor), the per-module statistics against Hugging Face's
DebugUnderflowOverflow, anomaly mode, the planted bugs and their fixes, and nan-hunt."""

import contextlib
import io
import json
import math

import pytest
import torch
from torch import nn

from trainbook import configs, formats
from trainbook.__main__ import main
from trainbook.model import Transformer
from trainbook.stability import debugging as D
from trainbook.stability import debugging_bugs as B
from trainbook.train import TrainConfig, train
from trainbook.train.hooks import Hook, StepContext, StopTraining, replace_batches
from trainbook.train.monitor import NanMonitor, find_nonfinite

SMALL = configs.get("tiny-llama").with_(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64,
                                        vocab_size=64, max_seq_len=16)
SHAPE = ["--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--n-kv-heads", "1",
         "--d-ff", "32", "--tokenizer", "bytes", "--seq-len", "16", "--batch-size", "2"]


def small_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, 64, (2, 17), generator=g)
    return t[:, :-1], t[:, 1:]


def tiny_cfg(cache_dir, **kw):
    base = dict(model="tiny-llama", d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32,
                tokenizer="bytes", seq_len=16, batch_size=2, steps=4, warmup_steps=1,
                log_every=0, progress=False, eval_batches=1, cache_dir=cache_dir)
    return TrainConfig(**{**base, **kw})


# ------------------------------------------------------------------------------------------------
# find_nonfinite: every place the first bad value can be
# ------------------------------------------------------------------------------------------------

class Inline(nn.Module):
    """A parent whose own forward code (between its submodules) makes the NaN."""

    def __init__(self, where="forward"):
        super().__init__()
        self.a, self.b, self.where = nn.Linear(4, 4), nn.Linear(4, 4), where

    def forward(self, x, y):
        h = self.a(x)
        if self.where == "forward":
            h = h * torch.tensor(float("nan"))
        elif self.where == "backward":  # sqrt at 0: finite forward, inf * 0 = NaN backward
            h = torch.sqrt(h - h)
        out = self.b(h)
        return out, (out - y).pow(2).mean()


def test_healthy_model_is_none_and_gradients_are_left_alone():
    torch.manual_seed(0)
    model = Transformer(SMALL)
    x, y = small_batch()
    model(x, y)[1].backward()
    before = [p.grad.clone() for p in model.parameters()]
    assert find_nonfinite(model, x, y) is None
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before))


def test_nan_made_between_modules_names_the_parent():
    model, x = Inline("forward"), torch.randn(3, 4)
    hit = find_nonfinite(model, x, torch.zeros(3, 4))
    assert (hit.module, hit.where, hit.phase, hit.kind) == ("b", "input", "forward", "nan")
    assert hit.parent == "" and hit.shape == (3, 4) and hit.nan == 12 and hit.numel == 12
    assert "forward code of the model itself" in str(hit)


def test_backward_nan_from_parent_code_arrives_at_a_module_output():
    model, x = Inline("backward"), torch.randn(3, 4)
    hit = find_nonfinite(model, x, torch.zeros(3, 4))
    assert hit.phase == "backward" and hit.module == "a" and hit.where == "grad_output"
    assert "the gradient arriving at the output of a (Linear)" in str(hit)


def test_bad_weight_is_reported_before_its_output():
    torch.manual_seed(0)
    model = Transformer(SMALL)
    with torch.no_grad():
        model.blocks[1].mlp.up.weight[0, 0] = float("inf")
    hit = find_nonfinite(model, *small_batch())
    assert (hit.module, hit.where, hit.kind, hit.inf) == ("blocks.1.mlp.up", "weight", "inf", 1)
    assert "already bad" in str(hit)


def test_weight_gradient_overflow_and_norm_overflow_from_finite_flows():
    lin = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        lin.weight.fill_(1e-20)

    class M(nn.Module):
        def __init__(self, scale):
            super().__init__()
            self.lin, self.scale = lin, scale

        def forward(self, x, y):
            return None, self.lin(x).sum() * self.scale

    x = torch.full((1, 2), 1e20)  # dW = x * scale: 1e40 overflows; dx = W * scale is finite
    hit = find_nonfinite(M(1e20), x, None)
    assert hit.where == "grad of weight" and hit.module == "lin" and hit.kind == "inf"
    hit = find_nonfinite(M(1e0), x, None)  # dW = 1e20 per element: finite, its norm^2 is not
    assert hit.where == "norm" and "largest |g| 1e+20" in str(hit)


def test_nan_monitor_stops_names_the_micro_batch_and_keeps_it(cache_dir):
    monitor = NanMonitor()
    with contextlib.redirect_stdout(io.StringIO()):
        r = train(tiny_cfg(cache_dir, grad_accum=2), hooks=[B.Plant("div0", step=2), monitor])
    assert r.stopped.startswith("non-finite loss at step 2") and len(r.history) == 1
    assert monitor.step == 2 and monitor.found.micro_batch == 0
    assert "the loss returned by the model" in str(monitor.found)
    x, y = monitor.batch
    assert (y == B.IGNORE).all()


def test_nan_monitor_leaves_fp16_scaler_overflow_alone():
    model = nn.Linear(2, 2)
    ctx = StepContext(3, model, torch.optim.SGD(model.parameters(), lr=0.1), [], 1.0, math.inf,
                      contextlib.nullcontext)
    NanMonitor(fp16_scaling=True).before_update(ctx)  # no StopTraining
    with pytest.raises(StopTraining, match="non-finite gradient norm at step 3"):
        NanMonitor().before_update(ctx)


def test_on_batches_seam_runs_hooks_in_order():
    class Add(Hook):
        def __init__(self, k):
            self.k = k

        def on_batches(self, step, batches):
            return [(x + self.k, y) for x, y in batches]

    batch = [(torch.zeros(1), torch.zeros(1))]
    out = replace_batches([Add(1), Hook(), Add(2)], 1, batch)
    assert out[0][0].item() == 3 and batch[0][0].item() == 0


# ------------------------------------------------------------------------------------------------
# The planted bugs: found where they are, fixed by their fixes
# ------------------------------------------------------------------------------------------------

WHERE = {"log0": "mask", "div0": "loss", "fp16-softmax": "softmax", "sqrt-neg": "norm"}


@pytest.mark.parametrize("bug", B.BUGS)
def test_each_bug_is_found_in_its_module_and_its_fix_removes_it(bug):
    r = B.hunt(bug)
    assert r["found"].module == WHERE[bug] and r["found"].phase == "forward"
    assert not (r["loss_finite"] and r["grads_finite"])
    fixed = B.hunt(bug, B.FIXES[bug][-1])
    assert fixed["loss_finite"] and fixed["grads_finite"]
    assert fixed["found"] is None and fixed["anomaly"] is None


def test_what_anomaly_mode_sees_of_each_bug():
    log0 = B.hunt("log0")
    assert log0["loss_finite"] and not log0["grads_finite"]
    assert log0["anomaly"].op == "LogBackward0" and "torch.log(" in log0["anomaly"].frame
    div0 = B.hunt("div0")
    assert not div0["loss_finite"] and div0["grads_finite"] and div0["anomaly"] is None
    for bug in ("fp16-softmax", "sqrt-neg"):  # made in forward: blamed at the loss
        a = B.hunt(bug)["anomaly"]
        assert a.op == "LogSoftmaxBackward0" and "cross_entropy" in a.frame


def test_fill_with_minus_inf_keeps_inf_for_a_later_zero_times_inf():
    r = B.hunt("log0", "fill-inf")
    assert r["grads_finite"] and r["found"].kind == "inf"
    model, x, y = B.make("log0", "fill-inf")
    logp = model(x, y)[0]
    assert (logp.exp() * logp).isnan().any()


def test_fp16_exp_limit_and_eps_only_hides_small_values():
    assert torch.tensor(B.FP16_EXP_LIMIT - 0.005).half().exp().isfinite()
    assert torch.tensor(B.FP16_EXP_LIMIT + 0.005).half().exp().isinf()
    assert math.exp(B.FP16_EXP_LIMIT) == pytest.approx(formats.get("fp16").max)
    assert B.hunt("sqrt-neg", "eps", pad_value=0.1)["loss_finite"]
    assert not B.hunt("sqrt-neg", "eps", pad_value=1000.1)["loss_finite"]
    assert B.hunt("sqrt-neg", "two-pass", pad_value=1000.1)["loss_finite"]


@pytest.mark.parametrize("call, message", [
    (lambda: B.make("log1"), "unknown bug 'log1'"),
    (lambda: B.make("div0", "eps"), "div0 has fixes bug, clamp"),
    (lambda: B.Plant("nan"), "unknown plant 'nan'"),
    (lambda: B.Plant("log0", step=0), "step must be >= 1"),
    (lambda: D.risky(D.module_stats(Transformer(SMALL), *small_batch()), "fp8_e4m3"),
     "module_stats counts fp16, bf16"),
    (lambda: D.risky(D.module_stats(Transformer(SMALL), *small_batch()), headroom=-1),
     "headroom >= 0"),
    (lambda: D.step_cost(Transformer(SMALL), *small_batch(), repeats=0), "repeats must be >= 1"),
])
def test_bad_input_says_what_to_do(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ------------------------------------------------------------------------------------------------
# Statistics: DebugUnderflowOverflow's numbers, exact format counts
# ------------------------------------------------------------------------------------------------

def test_frames_match_debug_underflow_overflow_line_for_line():
    from transformers.debug_utils import DebugUnderflowOverflow

    torch.manual_seed(0)
    model = Transformer(SMALL.with_(n_layers=1))
    x, y = small_batch()
    ours = D.hf_frames(D.module_stats(model, x, y)).splitlines()
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        DebugUnderflowOverflow(model, trace_batch_nums=[0])
        model(x, y)
    theirs = [line for line in buf.getvalue().splitlines()
              if line.strip() and "***" not in line and not line.startswith("abs min")]
    assert ours == theirs and len(ours) > 30


def test_format_counts_agree_with_formats_quantize():
    g = torch.Generator().manual_seed(0)
    t = torch.randn(4096, generator=g) * torch.logspace(-12, 6, 4096)
    t[:3] = torch.tensor([float("nan"), float("inf"), 0.0])
    s = D.tensor_stats(t)
    finite = t[torch.isfinite(t)].abs()
    for name in D.LIMIT_FORMATS:
        fmt = formats.get(name)
        q = formats.quantize(finite, fmt).abs()
        assert s[f"{name}_over"] == int(torch.isinf(q).sum())
        assert s[f"{name}_flush"] == int(((q == 0) & (finite > 0)).sum())
        assert s[f"{name}_subnormal"] == int(((q > 0) & (q < fmt.min_normal)).sum())
    assert s["nonfinite"] == 2 and math.isnan(s["abs_max"]) and s["max_finite"] > 1e5
    assert s["fp16_over"] > 0 and s["bf16_over"] == 0 and s["fp16_flush"] > 0


def test_risky_flags_fp16_gradient_underflow_not_bf16():
    torch.manual_seed(0)
    stats = D.module_stats(Transformer(SMALL), *small_batch())
    assert set(stats.phase) == {"forward", "backward"}
    assert any(t.startswith("grad of") for t in stats.tensor)
    r16 = D.risky(stats, "fp16")
    assert (r16.reason == "underflow").any() and len(D.risky(stats, "bf16")) == 0
    big = D.module_stats(B.make("fp16-softmax")[0], *B.make("fp16-softmax")[1:])
    assert (D.risky(big, "fp16").reason == "inf/nan").any()


def test_step_cost_rows():
    torch.manual_seed(0)
    cost = D.step_cost(Transformer(SMALL), *small_batch(), repeats=1)
    assert list(cost.index) == ["plain", "NaN detector hooks", "statistics hooks",
                                "detect_anomaly"]
    assert (cost.seconds > 0).all() and cost.loc["plain", "x plain"] == 1


# ------------------------------------------------------------------------------------------------
# nan-hunt
# ------------------------------------------------------------------------------------------------

def hunt(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(["nan-hunt", *argv])
    return status, out.getvalue(), err.getvalue()


def test_nan_hunt_finds_a_planted_bug_and_reports_json(cache_dir):
    status, out, _ = hunt("--plant", "log0", "--steps", "3", "--cache-dir", cache_dir,
                          "--stats", "3", "--json", *SHAPE)
    r = json.loads(out)
    assert status == 1 and r["step"] == 1 and r["found"]["module"] == "head"
    assert r["anomaly"]["op"] == "LogBackward0" and 0 < len(r["stats"]) <= 3


def test_nan_hunt_all_finite_exits_zero(cache_dir):
    status, out, _ = hunt("--steps", "2", "--cache-dir", cache_dir, *SHAPE)
    assert status == 0 and "2 steps from step 1, every loss and gradient norm finite" in out


def test_nan_hunt_replays_from_a_checkpoint(cache_dir, tmp_path):
    with contextlib.redirect_stdout(io.StringIO()):
        main(["train", *SHAPE, "--steps", "6", "--warmup-steps", "1", "--stop-after", "3",
              "--ckpt-dir", str(tmp_path), "--cache-dir", cache_dir, "--no-progress",
              "--log-every", "0"])
    ckpt = str(tmp_path / "step-000003.pt")
    status, out, _ = hunt("--resume-from", ckpt, "--steps", "2", "--plant", "div0",
                          "--plant-step", "5")
    assert status == 1 and "resumed from" in out and "non-finite loss at step 5" in out
    status, out, _ = hunt("--resume-from", ckpt, "--steps", "9")  # runs to the run's end
    assert status == 0 and "3 steps from step 4" in out


def test_nan_hunt_bad_checkpoints_are_one_line(cache_dir, tmp_path):
    junk = tmp_path / "junk.pt"
    junk.write_text("not a checkpoint")
    done = tmp_path / "done"
    with contextlib.redirect_stdout(io.StringIO()):
        main(["train", *SHAPE, "--steps", "2", "--warmup-steps", "1", "--ckpt-dir", str(done),
              "--cache-dir", cache_dir, "--no-progress", "--log-every", "0"])
    for path, message in ((str(tmp_path / "nope.pt"), "no such checkpoint"),
                          (str(junk), "cannot read it as a trainbook checkpoint"),
                          (str(done / "step-000002.pt"), "at the end of its run")):
        status, _, err = hunt("--resume-from", path)
        assert status == 2 and message in err and err.count("\n") == 1, err
