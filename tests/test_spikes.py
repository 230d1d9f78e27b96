"""Loss spikes (book/stability/loss-spikes): the attention-logit and output-logit probes against
direct computations, the LR-sensitivity metric, Adam's update size near epsilon, the spike
detector (online = replayed), the planted bad-data corpus against the trainer's loader,
restart-and-skip (the spike recurs without the skip and is gone with it), and the stored sweep
and detector trial against fresh runs."""

import dataclasses
import math
from pathlib import Path

import pandas as pd
import pytest
import torch

from trainbook import configs
from trainbook.data import ByteTokenizer, ShardedLoader, build_dataset
from trainbook.model import Transformer
from trainbook.pretrain.schedules import adam_update_rms
from trainbook.stability import instability as I
from trainbook.stability import spikes as S
from trainbook.train.monitor import SpikeMonitor, replay

DATA = Path(__file__).resolve().parents[1] / "book" / "stability" / "data"
FAST = dict(steps=40, warmup_steps=4)


# ---------------------------------------------------------------------------------------------
# Probes
# ---------------------------------------------------------------------------------------------

def test_attention_logit_max_is_the_causal_maximum_of_scaled_qk():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 6, 8, generator=g), torch.randn(2, 2, 6, 8, generator=g)
    k_full = k.repeat_interleave(2, dim=1)
    s = q @ k_full.transpose(-1, -2) / math.sqrt(8)
    brute = max(s[b, h, i, j].item() for b in range(2) for h in range(4) for i in range(6)
                for j in range(i + 1))
    assert I.attention_logit_max(q, k) == pytest.approx(brute, rel=1e-6)
    q[..., 0, :] = 100.0  # the first query sees only the first key: masking must hold
    k[..., 1:, :] = 100.0
    assert I.attention_logit_max(q, k, 0.5) < 100 * 100 * 8 * 0.5
    with pytest.raises(ValueError, match="H_kv dividing H"):
        I.attention_logit_max(q, torch.randn(2, 3, 6, 8))


def test_probe_records_training_steps_and_matches_a_direct_computation():
    probe = I.LogitProbe()
    res = I.probed_run(I.proxy_config(steps=3, warmup_steps=1), probe)
    rows = res.history
    assert len(rows) == 3 and all({"attn_logit_max", "log_z", "logit_mean"} <= set(r)
                                  for r in rows)
    assert len(rows[0]["attn_logit_max_layers"]) == res.model_config.n_layers
    assert rows[0]["attn_logit_max"] == max(rows[0]["attn_logit_max_layers"])
    # at initialisation the logits are near zero: log Z is close to ln V
    assert rows[0]["log_z"] == pytest.approx(math.log(256), abs=0.05)
    assert probe.optimizer is not None and probe._out == []  # eval passes were not recorded
    # the probe does not change the run
    plain = S.monitored_run(I.proxy_config(steps=3, warmup_steps=1))
    assert [r["loss"] for r in rows] == [r["loss"] for r in plain.history]


def test_probe_log_z_is_the_logsumexp_of_the_heads_output():
    cfg = configs.get("tiny-llama").with_(vocab_size=64, n_layers=1, d_model=32, n_heads=2,
                                          n_kv_heads=2, d_ff=64, max_seq_len=16)
    model = Transformer(cfg)
    probe = I.LogitProbe()
    probe.on_model(model)
    x = torch.randint(0, 64, (2, 16))
    logits, _ = model(x, x)
    z, mean = probe._out[0]
    assert z == pytest.approx(logits.logsumexp(-1).mean().item(), rel=1e-6)
    assert mean == pytest.approx(logits.mean().item(), abs=1e-6)
    q = model.blocks[0].attn.q
    assert probe._attn[0] > 0 and q.weight.grad is None


def test_variants_and_proxy_options():
    cfg = I.proxy_config(steps=50, warmup_steps=20, d_model=64)
    assert I.variant_options("warmup x4", cfg) == {"warmup_steps": 50}  # capped at the run
    assert I.variant_options("embed scale", cfg) == {"embed_scale": 8.0}
    assert I.variant_options("qk-norm", cfg) == {"qk_norm": True}
    with pytest.raises(ValueError, match="unknown variant 'layernorm'"):
        I.variant_options("layernorm", cfg)
    with pytest.raises(ValueError, match=r"\['lr_peak'\] are not trainer options"):
        I.proxy_config(lr_peak=1.0)
    with pytest.raises(ValueError, match="unknown variant"):
        I.lr_sweep(["baseline", "nope"], [1e-3])
    with pytest.raises(ValueError, match="positive learning rates"):
        I.lr_sweep(["baseline"], [0.0])


def test_lr_sensitivity_caps_diverged_runs_at_the_initial_loss():
    t = pd.DataFrame({"variant": ["a"] * 3 + ["b"] * 3, "lr": [1e-3, 1e-2, 1e-1] * 2,
                      "val_loss": [3.0, 2.0, math.inf, 2.5, 2.0, 2.5],
                      "first_loss": [5.0] * 6})
    s = I.lr_sensitivity(t)
    assert s["a"] == pytest.approx((1.0 + 0.0 + 3.0) / 3)  # inf counts as L0 - L* = 3
    assert s["b"] == pytest.approx(1.0 / 3)
    with pytest.raises(ValueError, match="lr_sweep's table"):
        I.lr_sensitivity(t.drop(columns="first_loss"))


def test_a_high_learning_rate_grows_the_attention_logits_and_qk_norm_bounds_them():
    table, hist = I.lr_sweep(["baseline", "qk-norm"], [3e-3, 0.3], steps=60)
    t = table.set_index(["variant", "lr"])
    assert t.loc[("baseline", 0.3), "attn_logit_max"] > 50 * t.loc[("baseline", 3e-3),
                                                                    "attn_logit_max"]
    assert t.loc[("qk-norm", 0.3), "attn_logit_max"] < t.loc[("baseline", 0.3),
                                                             "attn_logit_max"] / 20
    assert t.loc[("qk-norm", 0.3), "val_loss"] < t.loc[("baseline", 0.3), "val_loss"]
    assert len(hist[("baseline", 0.3)]) == 60


# ---------------------------------------------------------------------------------------------
# Adam's epsilon, embedding scale
# ---------------------------------------------------------------------------------------------

def adam_state(scale=1.0):
    p = torch.nn.Parameter(torch.zeros(64, 32))
    opt = torch.optim.AdamW([p], lr=1e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        p.grad = scale * (torch.randn(p.shape, generator=g) + 0.5)
        opt.step()
    return opt.state_dict()


def test_update_rms_collapses_when_gradients_near_epsilon():
    state = adam_state()
    t = I.update_rms_vs_gradient_scale(state, [1.0, 1e-6, 1e-8]).set_index(
        ["eps", "gradient_scale"]).update_rms
    assert t[(1e-8, 1.0)] == pytest.approx(adam_update_rms(state), rel=1e-6)
    assert t[(1e-8, 1e-8)] < 0.6 * t[(1e-8, 1.0)] and t[(1e-8, 1e-6)] > 0.95 * t[(1e-8, 1.0)]
    assert t[(1e-15, 1e-8)] == pytest.approx(t[(1e-15, 1.0)], rel=1e-5)
    # the same as scaling the gradients for real
    small = adam_state(scale=1e-8)
    assert adam_update_rms(small) == pytest.approx(t[(1e-8, 1e-8)], rel=1e-3)
    rms = I.gradient_rms(state)
    assert 0.9 < rms.iloc[0] < 1.3
    with pytest.raises(ValueError, match="positive"):
        I.update_rms_vs_gradient_scale(state, [0.0])
    with pytest.raises(ValueError, match="state_dict"):
        I.update_rms_vs_gradient_scale({}, [1.0])
    with pytest.raises(ValueError, match="after at least one step"):
        I.gradient_rms({"param_groups": [], "state": {}})


def test_a_larger_embedding_scale_shrinks_the_blocks_gradients():
    cfg = configs.get("tiny-llama").with_(vocab_size=256, n_layers=2, d_model=64, n_heads=2,
                                          n_kv_heads=2, d_ff=176)
    t = I.embedding_scale_gradients([1.0, 8.0, 50.0], cfg).set_index("embed_scale")
    assert t.residual_rms[8.0] == pytest.approx(8 * t.residual_rms[1.0], rel=1e-5)
    assert t.blocks_grad_norm[1.0] > 3 * t.blocks_grad_norm[8.0] > 3 * t.blocks_grad_norm[50.0]
    with pytest.raises(ValueError, match="positive multipliers"):
        I.embedding_scale_gradients([0.0], cfg)


def test_logits_by_token_counts_targets():
    data = build_dataset(ByteTokenizer(), 16)
    cfg = configs.get("tiny-llama").with_(vocab_size=256, n_layers=1, max_seq_len=16)
    t = I.logits_by_token(Transformer(cfg), data.val, data.train[:50])
    assert len(t) == 256 and t.train_count.sum() == 50 * 16
    assert t.mean_logprob.max() < 0
    with pytest.raises(ValueError, match="packed blocks"):
        I.logits_by_token(Transformer(cfg), data.val[0], data.train)


# ---------------------------------------------------------------------------------------------
# The detector
# ---------------------------------------------------------------------------------------------

def test_replay_flags_what_the_monitor_flagged_online(tmp_path):
    cfg = I.proxy_config(**FAST)
    bad = S.planted_corpus(tmp_path / "bad.txt", 25, 27, cfg.seq_len, cfg.batch_size)
    mon = SpikeMonitor(threshold=2.0, warmup=5, min_history=5, window=20)
    res = S.monitored_run(dataclasses.replace(cfg, corpus=str(bad)), mon)
    online = [r["step"] for r in res.history if r["spike"]]
    assert online == mon.spikes and 25 in online
    assert replay(res.history, threshold=2.0, warmup=5, min_history=5, window=20) == online
    with pytest.raises(ValueError, match="update_norm"):
        replay([{"step": 1, "loss": 2.0}])


def test_prime_rebuilds_the_window_of_a_resumed_run():
    rows = [{"step": s, "loss": 2.0 + 0.01 * (s % 3), "update_norm": 1e-3} for s in range(1, 40)]
    a = SpikeMonitor(warmup=5)
    a.prime(rows)
    b = SpikeMonitor(warmup=5)
    for r in rows:
        b.score(r["step"], r["loss"], r["update_norm"])
    assert list(a.loss) == list(b.loss) and a.score(40, 5.0, 1e-3)[2]


def test_detector_table_counts_alarms_and_detections():
    def run(spike_at=None):
        return [{"step": s, "loss": 2.0 + 0.01 * (s % 5) + (3.0 if s == spike_at else 0.0),
                 "update_norm": 1e-3 * (1 + 0.01 * (s % 7))} for s in range(1, 101)]
    trial = {"healthy": {0: run(), 1: run(spike_at=70)}, "planted": {0: run(spike_at=52)}}
    t = S.detector_table(trial, 50, 55, [6.0]).iloc[0]
    assert t.healthy_alarms == 1 and t.detected == 1.0 and t.median_delay == 2
    assert t.false_alarms_per_1k == pytest.approx(1000 / 160)  # steps 21..100 of two runs
    with pytest.raises(ValueError, match="thresholds must be positive"):
        S.detector_table(trial, 50, 55, [])


# ---------------------------------------------------------------------------------------------
# The planted corpus and restart-and-skip
# ---------------------------------------------------------------------------------------------

def test_planted_blocks_are_the_ones_the_loader_serves(tmp_path):
    seq, batch, seed = 64, 8, 3
    clean = build_dataset(ByteTokenizer(), seq)
    path = S.planted_corpus(tmp_path / "bad.txt", 5, 7, seq, batch, seed, "repeat", per_step=2)
    bad = build_dataset(ByteTokenizer(), seq, str(path))
    assert torch.equal(bad.val, clean.val) and bad.train.shape == clean.train.shape
    # packed blocks share their edge tokens, so a neighbour of a junk block changes in one
    changed = ((bad.train != clean.train).sum(1) > 1).nonzero().flatten().tolist()
    chosen = S.blocks_at_steps(5, 7, len(clean.train), batch, seed, per_step=2)
    assert sorted(changed) == sorted(chosen) and len(chosen) == 6
    loader = ShardedLoader(bad.train, batch, seed=seed)
    for step in range(1, 9):  # the first two sequences of steps 5, 6 and 7 are the junk
        x, _ = loader.next_batch()
        junk = [r for r in range(batch) if len(set(x[r].tolist())) <= 8]  # one 8-char unit
        assert junk == ([0, 1] if 5 <= step <= 7 else [])
    with pytest.raises(ValueError, match="must lie in the first epoch"):
        S.blocks_at_steps(0, 3, 100, 8, 0)
    with pytest.raises(ValueError, match="per_step must be in"):
        S.blocks_at_steps(1, 3, 100, 8, 0, per_step=9)
    with pytest.raises(ValueError, match="junk kind"):
        S.junk_text("zeros", 10, __import__("random").Random(0))
    nonascii = tmp_path / "u.txt"
    nonascii.write_text("héllo wörld " * 2000, encoding="utf-8")
    with pytest.raises(ValueError, match="not ASCII"):
        S.planted_corpus(tmp_path / "x.txt", 1, 2, 16, 4, corpus=str(nonascii))


def test_restart_and_skip_avoids_the_spike_and_no_skip_repeats_it(tmp_path):
    cfg = I.proxy_config(steps=100, warmup_steps=5)
    bad = S.planted_corpus(tmp_path / "bad.txt", 70, 74, cfg.seq_len, cfg.batch_size)
    planted = dataclasses.replace(cfg, corpus=str(bad))
    again = S.restart_and_skip(planted, ckpt_every=5, rewind=5, skip=0, max_restarts=1)
    first, second = again.attempts
    assert again.restarts[0].spike_step == 70 and again.restarts[0].checkpoint_step == 65
    assert second[69]["loss"] == first[69]["loss"] and second[69]["spike"]  # bit for bit
    assert again.steps_computed == 70 + 35 and again.restarts[0].skipped is None
    skipped = S.restart_and_skip(planted, ckpt_every=5, rewind=5, skip=12, max_restarts=2)
    r = skipped.restarts
    assert len(r) == 1 and r[0].skipped == (66, 77) and skipped.result.stopped is None
    losses = [row["loss"] for row in skipped.result.history]
    assert len(losses) == 100 and max(losses[65:]) < first[69]["loss"] - 1.0
    assert not any(row["spike"] for row in skipped.result.history[65:])
    assert skipped.result.val_loss < again.result.val_loss
    with pytest.raises(ValueError, match="ckpt_every >= 1"):
        S.restart_and_skip(cfg, ckpt_every=0)


# ---------------------------------------------------------------------------------------------
# Stored results against fresh runs
# ---------------------------------------------------------------------------------------------

@pytest.mark.records
def test_stored_sweep_agrees_with_a_fresh_run_of_one_point():
    record, table, hist = I.read_sweep(DATA / "spikes-sweep.json")
    assert record["command"].startswith('python -c "from trainbook.stability import instability')
    assert {"date_utc", "versions", "device"} <= set(record)
    assert set(table.variant) == set(I.VARIANTS) and len(table) == len(I.VARIANTS) * 7
    cfg = record["config"]
    keep = {k: cfg[k] for k in ("d_model", "n_heads", "n_kv_heads", "d_ff", "batch_size",
                                "steps", "warmup_steps")}
    fresh, _ = I.lr_sweep(["baseline"], [3e-3], **keep)
    stored = table[(table.variant == "baseline") & (table.lr == 3e-3)].iloc[0]
    assert fresh.val_loss[0] == pytest.approx(stored.val_loss, abs=0.02)
    assert fresh.attn_logit_max[0] == pytest.approx(stored.attn_logit_max, rel=0.05)
    h = hist[("baseline", 3e-3)]
    assert h.step.iloc[-1] == cfg["steps"] and (h.step.iloc[:-1] % 5 == 0).all()
    with pytest.raises(ValueError, match="not a spikes-sweep record"):
        I.read_sweep(DATA / "spikes-detector.json")


@pytest.mark.records
def test_stored_detector_trial_agrees_with_a_fresh_run():
    record, trial = S.read_detector(DATA / "spikes-detector.json")
    assert set(trial) == {"healthy", "planted"} and len(trial["healthy"]) == len(record["seeds"])
    assert record["monitor_defaults"] == S.MONITOR_DEFAULTS
    cfg = I.proxy_config(steps=record["config"]["steps"], seed=0, stop_after=30)
    fresh = S.monitored_run(cfg).history
    stored = trial["healthy"][0][:30]
    assert [r["loss"] for r in fresh] == pytest.approx([r["loss"] for r in stored], rel=1e-4)
    with pytest.raises(ValueError, match="cannot read"):
        S.read_detector(DATA / "missing.json")
