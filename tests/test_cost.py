"""Time and cost of a training run: arithmetic, published runs, goodput, the `cost` command."""

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import minimize_scalar

from trainbook import configs, hardware
from trainbook.__main__ import main
from trainbook.compute import cost
from trainbook.compute.flops import matmul_params, training_flops_per_token

H100 = hardware.get("h100-sxm").peak_flops("bf16")


# --- arithmetic ------------------------------------------------------------------------------

@pytest.mark.parametrize("text, value", [
    ("15T", 15e12), ("2.0T", 2e12), ("300B", 3e11), ("15e12", 15e12), ("1,000,000", 1e6),
    ("2_000", 2e3), ("10k", 1e4), ("1.5M", 1.5e6), ("1P", 1e15), (7, 7.0), ("4g", 4e9),
])
def test_parse_count(text, value):
    assert cost.parse_count(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["", "T", "15X", "fifteen", "0", "-3", "-1T", "nan", float("inf"),
                                  0])
def test_parse_count_rejects(text):
    with pytest.raises(ValueError):
        cost.parse_count(text)


def test_worked_example_by_hand():
    """llama-3-8b, 15T tokens, 1,024 H100 at 40% MFU: every step of the chain by hand."""
    cfg = configs.get("llama-3-8b")
    est = cost.estimate(cfg, "15T", "h100-sxm", 1024, 0.4, price_per_gpu_hour=2.0)
    flops = training_flops_per_token(cfg, 8192) * 15e12
    seconds = flops / (1024 * 989.4e12 * 0.4)
    assert est.flops == pytest.approx(flops)
    assert est.seconds == pytest.approx(seconds)
    assert est.gpu_hours == pytest.approx(seconds * 1024 / 3600)
    assert est.cost == pytest.approx(2.0 * seconds * 1024 / 3600)
    assert est.days == pytest.approx(seconds / 86400)
    assert 20 < est.days < 30  # about 25 days


def test_plain_6n_uses_matmul_params():
    cfg = configs.get("llama-2-7b")
    assert cost.run_flops(cfg, 1e9, mode="6n") == pytest.approx(6 * matmul_params(cfg) * 1e9)
    assert cost.run_flops(cfg, 1e9, 4096) > cost.run_flops(cfg, 1e9, mode="6n")
    with pytest.raises(ValueError, match="FLOP mode"):
        cost.run_flops(cfg, 1e9, mode="2n")


def test_dtype_selects_the_peak():
    bf16 = cost.estimate("llama-3-8b", "1T", "h100-sxm", 8, 0.4, "bf16")
    fp8 = cost.estimate("llama-3-8b", "1T", "h100-sxm", 8, 0.4, "fp8")
    assert bf16.seconds / fp8.seconds == pytest.approx(1978.9 / 989.4)
    with pytest.raises(ValueError, match="no bf16 peak"):
        cost.estimate("llama-3-8b", "1T", "v100-sxm2-32gb", 8, 0.4, "bf16")


@pytest.mark.parametrize("kwargs, message", [
    (dict(mfu=0.0), "MFU must be in"), (dict(mfu=1.01), "MFU must be in"),
    (dict(mfu=float("nan")), "MFU must be in"), (dict(gpus=0), "GPUs must be an integer"),
    (dict(gpus=2.5), "GPUs must be an integer"), (dict(gpu="h900"), "unknown accelerator"),
    (dict(tokens="0"), "positive"), (dict(price_per_gpu_hour=-1.0), "price per GPU-hour"),
    (dict(model="llama-9"), "unknown model"),
])
def test_estimate_rejects_impossible_input(kwargs, message):
    args = dict(model="llama-3-8b", tokens="1T", gpu="h100-sxm", gpus=8, mfu=0.4) | kwargs
    with pytest.raises(ValueError, match=message):
        cost.estimate(**args)


@settings(deadline=None, max_examples=50)
@given(gpus=st.integers(1, 100_000), k=st.integers(2, 16),
       mfu=st.floats(0.01, 0.5), tokens=st.floats(1e9, 1e14))
def test_time_inverse_in_gpus_and_mfu_cost_independent_of_gpus(gpus, k, mfu, tokens):
    base = cost.estimate("llama-2-7b", tokens, "a100-80gb", gpus, mfu, price_per_gpu_hour=1.5)
    more = cost.estimate("llama-2-7b", tokens, "a100-80gb", gpus * k, mfu, price_per_gpu_hour=1.5)
    better = cost.estimate("llama-2-7b", tokens, "a100-80gb", gpus, min(1.0, 2 * mfu),
                           price_per_gpu_hour=1.5)
    assert base.seconds / more.seconds == pytest.approx(k)
    assert base.seconds / better.seconds == pytest.approx(min(1.0, 2 * mfu) / mfu)
    assert more.cost == pytest.approx(base.cost)  # same GPU-hours at fixed MFU
    assert more.gpu_hours == pytest.approx(base.gpu_hours)


@settings(deadline=None, max_examples=50)
@given(mfu=st.floats(0.05, 1.0), tokens=st.floats(1e9, 1e14), gpus=st.integers(1, 20_000))
def test_implied_mfu_inverts_estimate(mfu, tokens, gpus):
    est = cost.estimate("llama-3-70b", tokens, "h100-sxm", gpus, mfu)
    assert cost.implied_mfu("llama-3-70b", tokens, est.gpu_hours, "h100-sxm") == pytest.approx(mfu)


# --- published runs --------------------------------------------------------------------------

# Touvron et al. 2023, Table 2 (and the released MODEL_CARD.md): A100-80GB GPU-hours, 2.0T tokens.
LLAMA2 = {"llama-2-7b": 184_320, "llama-2-13b": 368_640, "llama-2-70b": 1_720_320}


@pytest.mark.parametrize("name, gpu_hours", LLAMA2.items())
def test_llama2_implied_mfu(name, gpu_hours):
    """Llama 2 does not report MFU; its GPU-hours imply roughly 40-47% of the A100's 312 TFLOPS
    bf16 (6N + attention at 4,096 tokens), and a few points less with plain 6N."""
    full = cost.implied_mfu(name, "2.0T", gpu_hours, "a100-80gb", seq_len=4096)
    plain = cost.implied_mfu(name, "2.0T", gpu_hours, "a100-80gb", flop_mode="6n")
    assert 0.40 < full < 0.47
    assert 0.35 < plain < full


def test_llama2_13b_is_twice_7b():
    assert LLAMA2["llama-2-13b"] == 2 * LLAMA2["llama-2-7b"]  # the table's own numbers
    assert sum(LLAMA2.values()) + 1_038_336 == 3_311_616  # with 34B: the table's total


def test_llama3_405b_implied_mfu_is_below_the_reported_step_mfu():
    """Llama 3 405B: 30.84M H100 GPU-hours (model card), 15.6T tokens (Dubey et al. 2024).
    Table 4 reports 38-43% BF16 MFU for the training steps. GPU-hours also pay for failures,
    restarts, checkpoints, evaluation and the long-context stage, so the implied MFU is lower;
    its ratio to the step MFU (~0.9) matches the paper's '>90% effective training time'."""
    implied = cost.implied_mfu("llama-3-405b", "15.6T", 30.84e6, "h100-sxm", seq_len=8192)
    plain = cost.implied_mfu("llama-3-405b", "15.6T", 30.84e6, "h100-sxm", flop_mode="6n")
    assert 0.33 < implied < 0.38
    assert 0.32 < plain < implied
    assert 0.85 < implied / 0.41 < 0.95
    # the paper's 3.8e25 FLOPs is 6 N D with N = 405B
    assert 6 * 405e9 * 15.6e12 == pytest.approx(3.8e25, rel=0.01)
    assert cost.run_flops("llama-3-405b", "15.6T", mode="6n") == pytest.approx(3.8e25, rel=0.01)


@pytest.mark.parametrize("tflops_per_gpu, printed_mfu", [(430, 0.43), (400, 0.41), (380, 0.38)])
def test_llama3_table4_mfu_from_tflops(tflops_per_gpu, printed_mfu):
    """Table 4 prints TFLOPs/GPU and BF16 MFU; against the 989.4 TFLOPS dense bf16 peak they agree
    to within a point (400/989.4 = 40.4% is printed 41%: the TFLOPs column is rounded)."""
    assert tflops_per_gpu * 1e12 / H100 == pytest.approx(printed_mfu, abs=0.01)


# --- goodput ---------------------------------------------------------------------------------

def test_llama3_failure_rate():
    mtbf = cost.mtbf_from_incidents(419, 54, 16384)
    assert mtbf == pytest.approx(54 * 24 * 16384 / 419)
    assert cost.cluster_mtbf_hours(16384, mtbf) == pytest.approx(3.09, abs=0.01)  # "every 3 hours"


@pytest.mark.parametrize("ckpt_s, mtbf_s, restart_s", [
    (60, 11_135, 600), (120, 11_135, 0), (600, 3_600, 300), (30, 86_400, 1_800)])
def test_young_minimises_first_order_waste_and_daly_the_exact_time(ckpt_s, mtbf_s, restart_s):
    young = cost.young_interval(ckpt_s, mtbf_s)
    best = minimize_scalar(lambda t: cost.first_order_waste(t, ckpt_s, mtbf_s, restart_s),
                           bounds=(1, 20 * mtbf_s), method="bounded", options={"xatol": 1e-6}).x
    assert young == pytest.approx(best, rel=1e-4)
    work = 1000 * mtbf_s
    exact = minimize_scalar(lambda t: cost.expected_wall_seconds(work, t, ckpt_s, mtbf_s,
                                                                 restart_s),
                            bounds=(1, 5 * mtbf_s), method="bounded", options={"xatol": 1e-3}).x
    daly = cost.daly_interval(ckpt_s, mtbf_s)
    assert daly == pytest.approx(exact, rel=0.01)
    assert abs(daly - exact) <= abs(young - exact)
    # and the optimum is flat: Young's interval costs almost nothing over the exact optimum
    at = lambda t: cost.expected_wall_seconds(work, t, ckpt_s, mtbf_s, restart_s)  # noqa: E731
    assert at(young) / at(exact) - 1 < 0.02  # 1% even at delta/M = 1/6


def test_expected_time_reduces_to_first_order_for_rare_failures():
    w, tau, d, m, r = 100 * 3600.0, 1800.0, 30.0, 1e7, 600.0
    exact = cost.expected_wall_seconds(w, tau, d, m, r)
    first = w * (1 + cost.first_order_waste(tau, d, m, r) + d / (2 * m))
    assert exact == pytest.approx(first, rel=1e-4)
    assert cost.expected_wall_seconds(w, tau, 0.0, 1e15) == pytest.approx(w)  # no waste


@pytest.mark.parametrize("work_h, tau, d, m, r", [
    (100, 1635.0, 120.0, 11_135.0, 600.0), (20, 3600.0, 300.0, 7_200.0, 1_800.0),
    (3.3, 1000.0, 0.0, 3_000.0, 0.0)])
def test_monte_carlo_agrees_with_the_analytic_expectation(work_h, tau, d, m, r):
    walls = cost.simulate_wall_seconds(work_h * 3600, tau, d, m, r, runs=2000, seed=1)
    exact = cost.expected_wall_seconds(work_h * 3600, tau, d, m, r)
    stderr = walls.std() / math.sqrt(walls.size)
    assert abs(walls.mean() - exact) < 4 * stderr
    assert abs(walls.mean() / exact - 1) < 0.02
    assert (walls >= work_h * 3600).all()


def test_simulation_is_seeded():
    a = cost.simulate_wall_seconds(36_000, 1000, 10, 5000, 100, runs=50, seed=3)
    b = cost.simulate_wall_seconds(36_000, 1000, 10, 5000, 100, runs=50, seed=3)
    assert np.array_equal(a, b)


def test_goodput_for_a_16k_cluster():
    mtbf = cost.mtbf_from_incidents(419, 54, 16384)
    g = cost.goodput(1000, 16384, mtbf, ckpt_minutes=1, restart_minutes=10)
    young = cost.young_interval(60, g.cluster_mtbf_hours * 3600)
    assert g.interval_minutes == pytest.approx(young / 60)
    assert 0.8 < g.goodput < 0.9
    assert g.failures == pytest.approx(g.wall_hours / g.cluster_mtbf_hours)
    waste = g.ckpt_share + g.rework_share + g.restart_share
    assert 1 / (1 + waste) == pytest.approx(g.goodput, abs=0.02)  # first order vs exact


@settings(deadline=None, max_examples=40)
@given(gpus=st.integers(1, 50_000), ckpt=st.floats(0.1, 10), restart=st.floats(0, 30))
def test_goodput_properties(gpus, ckpt, restart):
    g = cost.goodput(100, gpus, 50_000, ckpt, restart)
    assert 0 < g.goodput < 1
    bigger = cost.goodput(100, gpus * 2, 50_000, ckpt, restart)
    assert bigger.goodput < g.goodput  # more GPUs, more failures per hour
    assert bigger.interval_minutes < g.interval_minutes
    slower = cost.goodput(100, gpus, 50_000, ckpt, restart + 5)
    assert slower.wall_hours > g.wall_hours


@pytest.mark.parametrize("kwargs, message", [
    (dict(gpus=0), "GPUs"), (dict(mtbf_gpu_hours=0), "MTBF"),
    (dict(ckpt_minutes=-1), "checkpoint time"),
    (dict(restart_minutes=-1), "restart"), (dict(interval_minutes=0), "interval"),
    (dict(ckpt_minutes=0), "free checkpoints"), (dict(ideal_hours=0), "ideal compute"),
    (dict(gpus=100_000, mtbf_gpu_hours=1000, interval_minutes=1e5), "never finish"),
])
def test_goodput_rejects_impossible_input(kwargs, message):
    args = dict(ideal_hours=100, gpus=1024, mtbf_gpu_hours=50_000, ckpt_minutes=1,
                restart_minutes=10) | kwargs
    with pytest.raises(ValueError, match=message):
        cost.goodput(**args)


# --- the command -----------------------------------------------------------------------------

def test_cost_help_documents_every_option(capsys):
    with pytest.raises(SystemExit) as e:
        main(["cost", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--model", "--tokens", "--seq-len", "--gpu ", "--gpus", "--mfu", "--dtype",
                 "--price-per-gpu-hour", "--ckpt-minutes", "--ckpt-interval-minutes",
                 "--mtbf-gpu-hours", "--failures-per-million-gpu-hours", "--restart-minutes",
                 "--json"):
        assert flag in out


def test_cost_json(capsys):
    assert main(["cost", "--model", "llama-3-8b", "--tokens", "15T", "--gpu", "h100-sxm",
                 "--gpus", "1024", "--mfu", "0.4", "--price-per-gpu-hour", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    est = cost.estimate("llama-3-8b", 15e12, "h100-sxm", 1024, 0.4, price_per_gpu_hour=2.0)
    assert out["ideal"]["gpu_hours"] == pytest.approx(est.gpu_hours)
    assert out["ideal"]["cost"] == pytest.approx(est.cost)
    assert out["with_failures"]["gpu_hours"] > est.gpu_hours
    assert out["goodput"]["mtbf_gpu_hours"] == pytest.approx(54 * 24 * 16384 / 419)


def test_cost_table_and_failure_rate_options(capsys):
    assert main(["cost", "--model", "llama-2-7b", "--tokens", "2T", "--gpu", "a100-80gb",
                 "--gpus", "2048", "--failures-per-million-gpu-hours", "20",
                 "--ckpt-interval-minutes", "30"]) == 0
    out = capsys.readouterr().out
    assert "ideal (compute only)" in out and "goodput" in out and "every 30 min" in out
    assert "cluster MTBF 24.4 h" in out  # 1e6 / 20 / 2048


@pytest.mark.parametrize("argv, message", [
    (["--gpus", "0"], "GPUs must be an integer >= 1"),
    (["--mfu", "1.5"], "MFU must be in (0, 1]"),
    (["--mfu", "0"], "MFU must be in (0, 1]"),
    (["--tokens", "0"], "token count must be a positive"),
    (["--tokens=-2T"], "token count must be a positive"),
    (["--tokens", "lots"], "cannot read 'lots'"),
    (["--gpu", "h900"], "unknown accelerator 'h900'"),
    (["--dtype", "fp64"], "unknown dtype"),
    (["--mtbf-gpu-hours", "-5"], "--mtbf-gpu-hours must be > 0"),
    (["--failures-per-million-gpu-hours", "0"], "must be > 0"),
    (["--ckpt-interval-minutes", "often"], "must be a number of minutes or 'auto'"),
    (["--price-per-gpu-hour", "-1"], "price per GPU-hour"),
    (["--seq-len", "0"], "seq_len must be >= 1"),
])
def test_cost_bad_input_is_one_clear_line(argv, message, capsys):
    base = ["cost", "--model", "llama-3-8b", "--tokens", "1T", "--gpus", "8"]
    argv = base[:3] + argv + base[5:] if argv[0].startswith("--tokens") else base + argv
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_gpt2_cannot_be_priced_past_its_learned_positions():
    with pytest.raises(ValueError, match="exceeds gpt2's 1024 learned positions"):
        cost.estimate("gpt2", "1B", seq_len=8192)
