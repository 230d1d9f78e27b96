import dataclasses
import math

import pytest
import torch

from trainbook.train import (
    TrainConfig,
    latest_checkpoint,
    load_checkpoint,
    lr_at,
    model_config,
    train,
)


def tiny(cache_dir, **kw):
    base = dict(model="tiny-llama", d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64,
                vocab_size=384, seq_len=32, batch_size=8, steps=24, warmup_steps=4, lr=3e-3,
                log_every=0, progress=False, eval_batches=2, cache_dir=cache_dir)
    base.update(kw)
    return TrainConfig(**base)


def test_lr_schedule_warmup_then_cosine():
    cfg = TrainConfig(steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1)
    lrs = [lr_at(s, cfg) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a <= b for a, b in zip(lrs[:10], lrs[1:10]))  # warmup rises
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))  # cosine falls
    assert lr_at(55, cfg) == pytest.approx(0.55)  # half-way: midpoint of peak and floor
    assert lr_at(100, cfg) == pytest.approx(0.1)


def test_loss_falls_and_metrics_are_logged(cache_dir):
    r = train(tiny(cache_dir, steps=40))
    losses = r.losses()
    assert len(losses) == 40
    assert losses[0] > math.log(384) - 0.3
    assert sum(losses[-5:]) / 5 < losses[0] - 0.7
    rec = r.history[-1]
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "step_time_s"} <= set(rec)
    assert 0 < rec["mfu"] < 1 and rec["tokens_per_s"] > 0
    assert r.val_loss < losses[0]
    assert r.flops_per_token > 6 * 32 * 32  # at least the matmuls of one layer


def test_resume_reproduces_the_uninterrupted_run_bit_for_bit(cache_dir, tmp_path):
    full = train(tiny(cache_dir, ckpt_dir=str(tmp_path / "full")))
    part = tiny(cache_dir, ckpt_dir=str(tmp_path / "part"), stop_after=11)
    first = train(part)
    assert len(first.history) == 11
    ckpt = latest_checkpoint(tmp_path / "part")
    assert ckpt.name == "step-000011.pt"
    assert not list((tmp_path / "part").glob("*.tmp"))  # atomic write left nothing behind
    resumed = train(dataclasses.replace(part, stop_after=None, resume=True))
    assert resumed.losses() == full.losses()  # exact equality, every step
    for a, b in zip(resumed.model.parameters(), full.model.parameters()):
        assert torch.equal(a, b)


def test_checkpoint_loads_with_weights_only(cache_dir, tmp_path):
    train(tiny(cache_dir, steps=3, warmup_steps=1, ckpt_dir=str(tmp_path)))
    state = load_checkpoint(tmp_path / "step-000003.pt")  # weights_only=True inside
    assert state["step"] == 3 and "optimizer" in state and "rng" in state and "loader" in state


def test_resume_refuses_a_different_model(cache_dir, tmp_path):
    train(tiny(cache_dir, steps=2, warmup_steps=1, ckpt_dir=str(tmp_path)))
    with pytest.raises(ValueError, match="holds a different model"):
        train(tiny(cache_dir, steps=4, warmup_steps=1, d_model=64, ckpt_dir=str(tmp_path),
                   resume=True))
    with pytest.raises(ValueError, match="no checkpoint at"):
        train(tiny(cache_dir, resume_from=str(tmp_path / "nope.pt")))


def test_gradient_accumulation_equals_a_bigger_batch(cache_dir):
    big = train(tiny(cache_dir, steps=6, batch_size=8))
    acc = train(tiny(cache_dir, steps=6, batch_size=4, grad_accum=2))
    # Same 8 sequences per step (the loader hands them out in order); only summation order differs.
    torch.testing.assert_close(torch.tensor(acc.losses()), torch.tensor(big.losses()), rtol=0,
                               atol=1e-4)


def test_bf16_autocast_trains(cache_dir):
    r = train(tiny(cache_dir, steps=12, dtype="bf16"))
    assert r.losses()[-1] < r.losses()[0]


def test_fp16_autocast_trains_with_a_grad_scaler_and_resumes_bit_for_bit(cache_dir, tmp_path):
    """`train --dtype fp16`: autocast fp16 with torch.amp.GradScaler; the scaler's state is in the
    checkpoint, so a resumed run takes the same steps (and skips) as the uninterrupted one."""
    full = train(tiny(cache_dir, steps=8, dtype="fp16", ckpt_dir=str(tmp_path / "full")))
    losses = full.losses()
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    state = load_checkpoint(tmp_path / "full" / "step-000008.pt")
    assert state["scaler"]["scale"] > 1 and state["scaler"]["_growth_tracker"] >= 0
    part = tiny(cache_dir, steps=8, dtype="fp16", ckpt_dir=str(tmp_path / "part"), stop_after=5)
    train(part)
    resumed = train(dataclasses.replace(part, stop_after=None, resume=True))
    assert resumed.losses() == losses


def test_model_config_overrides(cache_dir):
    cfg = model_config(tiny(cache_dir), 384)
    assert (cfg.d_model, cfg.n_layers, cfg.vocab_size, cfg.max_seq_len) == (32, 2, 384, 32)


@pytest.mark.parametrize("changes, message", [
    (dict(steps=0), "steps must be >= 1"),
    (dict(warmup_steps=500), "warmup_steps must be in"),
    (dict(dtype="fp8"), "dtype must be one of fp32, bf16, fp16, fp8-emulated"),
    (dict(lr=-1.0), "need lr > 0"),
    (dict(resume=True), "need ckpt_dir"),
    (dict(device="tpu"), "unknown device 'tpu': device must be auto, cpu, cuda or cuda:N"),
    (dict(model="llama-9"), "unknown model 'llama-9'"),
    (dict(n_heads=3), "not divisible by 3 heads"),
    (dict(eval_every=-1), "eval_every must be >= 0"),
    (dict(stop_after=0), "stop_after must be >= 1"),
    (dict(device="cuda:x"), "device must be auto, cpu, cuda or cuda:N"),
])
def test_bad_training_configs(cache_dir, changes, message):
    with pytest.raises(ValueError, match=message):
        train(tiny(cache_dir, **changes))
