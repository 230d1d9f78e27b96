"""precision/fp8.py, fp8_training.py and bench/fp8_linear.py: the FP8 chapter's package code,
its stored runs against fresh ones, and the GPU measurement's CPU path."""

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from trainbook import configs, hardware
from trainbook.bench import fp8_linear
from trainbook.compute.activations import production_layer_bytes
from trainbook.model import Transformer
from trainbook.precision import fp8, fp8_training, lowp_training
from trainbook.train.config import TrainConfig
from trainbook.train.emulate import EmulatedLinear

DATA = Path(__file__).resolve().parents[1] / "book" / "precision" / "data"


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_snr_and_crest_factor():
    x = torch.randn(1000, generator=_gen())
    assert fp8.snr_db(x, x) == math.inf
    assert math.isclose(fp8.snr_db(x, 0.9 * x), 20.0, rel_tol=1e-6)  # noise 0.1 x: 20 dB
    assert 2.5 < fp8.crest_factor(x) < 5
    y = x.clone()
    y[0] = 1000.0
    assert fp8.crest_factor(y) > 30
    for fn in (lambda: fp8.snr_db(torch.zeros(3), torch.ones(3)),
               lambda: fp8.crest_factor(torch.zeros(3))):
        with pytest.raises(ValueError, match="all zeros"):
            fn()


def test_scaled_mm_agreement_and_its_input_checks():
    df = fp8.scaled_mm_agreement(((32, 64, 48),))
    assert df["operands are FP8 values"].all() and (df["max |diff| / fp32 bound"] < 1).all()
    assert (df["bf16 outputs bit-equal"] > 0.98).all() and list(df.recipe) == ["tensorwise",
                                                                              "rowwise"]
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8.scaled_mm_agreement(((30, 64, 48),))


def test_recipe_errors_unscaled_gradients_vanish_scaled_ones_survive():
    g = torch.randn(256, 256, generator=_gen(1)) * 1e-7  # a gradient's typical scale
    w = torch.randn(256, 256, generator=_gen(2)) * 0.02
    df = fp8.recipe_errors({"gradients": {"g": g}, "weights": {"w": w}},
                           ("unscaled", "tensorwise", "blockwise"))
    gr = df.set_index("kind").loc["gradients"]
    assert gr["flushed: unscaled"] == 1.0 and gr["flushed: tensorwise"] < 1e-3
    assert 30 < gr["snr: tensorwise"] < 33  # E4M3's 3 mantissa bits: about 31.5 dB
    assert 30 < df.set_index("kind").loc["weights", "snr: blockwise"] < 33
    with pytest.raises(ValueError, match="unknown tensor kind 'acts'"):
        fp8.recipe_errors({"acts": {"x": g}})


def test_outliers_planted_and_what_each_recipe_does_with_them():
    x = torch.randn(64, 256, generator=_gen(3))
    ch = fp8.outlier(x, "channel", 10.0, 5)
    assert torch.equal(ch[:, 5], 10 * x[:, 5]) and torch.equal(ch[:, 6], x[:, 6])
    tok = fp8.outlier(x, "token", 10.0, 2)
    assert torch.equal(tok[2], 10 * x[2]) and torch.equal(tok[3], x[3])
    with pytest.raises(ValueError, match="kind must be 'channel' or 'token'"):
        fp8.outlier(x, "row")
    with pytest.raises(ValueError, match="must be 2-D"):
        fp8.outlier(x[0])
    df = fp8.outlier_errors(x, factors=(10.0, 1e5), recipes=("tensorwise", "rowwise",
                                                             "blockwise"))
    f = df.set_index(["outlier", "factor", "recipe"]).flushed
    assert f[("token", 1e5, "tensorwise")] > 0.05 and f[("token", 1e5, "rowwise")] < 0.001
    assert f[("channel", 1e5, "blockwise")] < f[("channel", 1e5, "tensorwise")]
    assert f[("channel", 10.0, "tensorwise")] < 0.001  # E4M3's range absorbs a small one


def test_delayed_trace_saturates_on_a_jump_and_remembers_it_for_the_history():
    x = torch.randn(32, 64, generator=_gen(4))
    xs = [x.clone() for _ in range(12)]
    xs[4] = fp8.outlier(x, "token", 50.0, 0)  # step 5
    tr = fp8.delayed_trace(xs, history=3)
    assert tr.loc[5, "saturated (delayed)"] > 0 and tr.loc[5, "saturated (current)"] == 0
    assert tr.loc[5, "snr (delayed)"] < tr.loc[5, "snr (current)"] - 20
    big = tr.loc[5, "amax"]
    assert list(tr.loc[6:9, "amax used (delayed)"] == big) == [True, True, True, False]
    assert tr.loc[1, "amax used (delayed)"] == tr.loc[1, "amax"]  # the first step: its own
    with pytest.raises(ValueError, match="at least one tensor"):
        fp8.delayed_trace([])


def test_convert_head_and_run_names():
    assert {"fp32", "mxfp8", "tensorwise+head"} <= set(fp8_training.run_names())
    with pytest.raises(ValueError, match="unknown recipe 'fp4'"):
        fp8_training.ConvertHead("fp4")
    model = Transformer(configs.get("tiny-llama").with_(vocab_size=64, n_layers=1))
    fp8_training.ConvertHead("rowwise").on_model(model)
    assert isinstance(model.head, EmulatedLinear) and model.head.recipe.name == "rowwise"
    with pytest.raises(ValueError, match="unknown run 'fp8'"):
        fp8_training.train_fp8("fp8", fp8_training.CONFIG)
    with pytest.raises(ValueError, match="unknown run 'int4'"):
        fp8_training.write_fp8_runs("x.json", ["int4"], fp8_training.CONFIG, [0], "c")


def test_activation_saving_is_the_fp8_cached_inputs():
    cfg = configs.get("llama-3-8b")
    a = fp8_training.activation_saving(cfg, 2, 1024)
    assert a["bf16"] == production_layer_bytes(cfg, 2, 1024, "bf16")
    assert a["bf16"] - a["fp8 inputs"] == 2 * 1024 * (2 * cfg.d_model + cfg.d_ff)
    assert 0 < a["saving"] < 0.5


def test_speedup_model():
    cfg = configs.get("llama-3-8b")
    base = fp8_training.speedup_model(cfg, 8192)
    fused = fp8_training.speedup_model(cfg, 8192, fused_casts=True)
    other = fp8_training.speedup_model(cfg, 8192, other_share=0.3, fused_casts=True)
    head = fp8_training.speedup_model(cfg, 8192, head=True)
    square = fp8_training.speedup_model(cfg, 8192, causal=False)
    assert 1 < base["speed-up"] < fused["speed-up"] < fused["Amdahl limit"] < 2
    assert other["speed-up"] < fused["speed-up"] and other["Amdahl limit"] < fused["Amdahl limit"]
    assert head["fp8 share of matmul FLOPs"] > base["fp8 share of matmul FLOPs"]
    assert square["fp8 share of matmul FLOPs"] < base["fp8 share of matmul FLOPs"]
    # no other work and free casts: Amdahl's law with a part r = 1978.9 / 989.4 times faster
    f, h100 = fused["fp8 share of matmul FLOPs"], hardware.get("h100-sxm")
    r = h100.peak_flops("fp8") / h100.peak_flops("bf16")
    assert math.isclose(fused["Amdahl limit"], 1 / (1 - f + f / r), rel_tol=1e-12)
    with pytest.raises(ValueError, match="other_share is a share"):
        fp8_training.speedup_model(cfg, 8192, other_share=1.0)
    with pytest.raises(ValueError, match="no fp8 peak"):
        fp8_training.speedup_model(cfg, 8192, gpu="a100-80gb")


def test_gpu_records(tmp_path):
    assert fp8_training.gpu_fp8_records(tmp_path).empty
    rec = {"status": "measured", "device": {"name": "NVIDIA H100 80GB HBM3"},
           "date_utc": "2026-01-01T00:00:00+00:00", "versions": {"torch": "2.13.0"},
           "result": {"rows": [{"m": 8192, "k": 4096, "n": 4096, "bf16 ms": 1.0}]}}
    (tmp_path / "h100").mkdir()
    (tmp_path / "h100" / "fp8-linear.json").write_text(json.dumps(rec))
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "fp8-linear.json").write_text(json.dumps(rec | {"status": "refused"}))
    df = fp8_training.gpu_fp8_records(tmp_path)
    assert len(df) == 1 and df.loc[0, "device"] == "NVIDIA H100 80GB HBM3"


@pytest.mark.records
def test_stored_fp8_runs_are_what_the_code_makes():
    doc, runs = lowp_training.read_runs(DATA / "fp8-training.json")
    assert doc["names"] == fp8_training.NAMES and doc["seeds"] == fp8_training.SEEDS
    # fields added to TrainConfig after the file was written take their defaults
    assert TrainConfig(**doc["config"]) == replace(fp8_training.CONFIG, cache_dir=None)
    assert "fp8_training import write_stored" in doc["command"]
    assert len(runs) == len(fp8_training.NAMES) * len(fp8_training.SEEDS)
    assert all(len(r["loss"]) == fp8_training.CONFIG.steps and math.isfinite(r["val_loss"])
               for r in runs)
    again = fp8_training.train_fp8("tensorwise+head", replace(fp8_training.CONFIG,
                                                              stop_after=5))
    stored = next(r for r in runs if r["variant"] == "tensorwise+head" and r["seed"] == 0)
    assert again["loss"] == pytest.approx(stored["loss"][:5], rel=1e-4)


def test_write_fp8_runs(tmp_path):
    cfg = replace(fp8_training.CONFIG, d_model=32, n_heads=2, n_kv_heads=2, d_ff=64, n_layers=1,
                  steps=2, warmup_steps=1, eval_batches=1)
    path = fp8_training.write_fp8_runs(tmp_path / "f.json", ["fp32", "bf16+head"], cfg, [0],
                                       "cmd")
    doc, runs = lowp_training.read_runs(path)
    assert doc["names"] == ["fp32", "bf16+head"] and [r["variant"] for r in runs] == \
        ["fp32", "bf16+head"]
    assert runs[0]["loss"] != runs[1]["loss"]  # the head's bf16 rounding changes the run


# ---- the GPU measurement's code, on the CPU's reference _scaled_mm ------------------------------

@pytest.mark.parametrize("recipe, tol", [("tensorwise", 0.1), ("rowwise", 0.06)])
def test_fp8_linear_step_is_the_three_matmuls(recipe, tol):
    x = torch.randn(64, 128, generator=_gen(5)).bfloat16()
    w = (torch.randn(96, 128, generator=_gen(6)) * 0.02).bfloat16()
    g = (torch.randn(64, 96, generator=_gen(7)) * 1e-3).bfloat16()
    y, dx, dw = fp8_linear.step(x, w, g, recipe)
    ref = (x.float() @ w.float().t(), g.float() @ w.float(), g.float().t() @ x.float())
    for ours, r in zip((y, dx, dw), ref):
        assert ours.dtype == torch.bfloat16 and ours.shape == r.shape
        assert ((ours.float() - r).norm() / r.norm()).item() < tol
    with pytest.raises(ValueError, match="recipe must be one of tensorwise, rowwise"):
        fp8_linear.step(x, w, g, "delayed")


def test_fp8_linear_casts_are_in_scaled_mms_layout():
    t = torch.randn(32, 48, generator=_gen(8))
    q, inv = fp8_linear.cast(t, torch.float8_e4m3fn, rowwise=True)
    assert q.dtype == torch.float8_e4m3fn and q.is_contiguous() and inv.shape == (32, 1)
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((32,), 448.0))
    q, inv = fp8_linear.cast(t, torch.float8_e5m2, rowwise=False)
    assert inv.dim() == 0 and q.float().abs().max() == 57344


def test_fp8_linear_timing_runs_here_and_checks_shapes():
    row = fp8_linear.time_step(32, 64, 48, torch.device("cpu"), repeats=1, warmup=0,
                               budget_s=5.0)
    assert row["bf16 ms"] > 0 and row["speed-up: fp8 tensorwise"] > 0
    assert {"fp8 rowwise ms", "fp8 matmuls only ms", "bf16 TFLOPS"} <= set(row)
    with pytest.raises(ValueError, match="multiple of 16"):
        fp8_linear.time_step(30, 64, 48, torch.device("cpu"))
    ao = fp8_linear.torchao_times(32, 64, 48, torch.device("cpu"), repeats=1, warmup=0)
    try:
        import torchao  # noqa: F401
    except ImportError:
        assert "not installed" in ao["torchao"]
    else:
        assert "bf16 ms" in ao
