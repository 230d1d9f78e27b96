"""Memory estimator: the ZeRO paper's example, Korthikanti Table 2, measurement, CLI, properties."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainbook import configs, hardware
from trainbook.__main__ import main
from trainbook.bench import memory_measure as mm
from trainbook.compute import memory as M
from trainbook.launch import run

TINY = configs.get("tiny-llama").with_(vocab_size=1024)
B, S = 8, 64


# --- ZeRO, Rajbhandari et al. 2020, Figure 1: Psi = 7.5B, Nd = 64, K = 12 (decimal GB) ---------

@pytest.mark.parametrize("zero,paper", [(0, "120"), (1, "31.4"), (2, "16.6"), (3, "1.9")])
def test_zero_paper_figure_1(zero, paper):
    """As Figure 1 prints them; P_os+g+p is exactly 1.875 GB, printed 1.9."""
    got = M.zero_model_states(7.5e9, 64, zero) / 1e9 if zero else 16 * 7.5e9 / 1e9
    decimals = len(paper.split(".")[1]) if "." in paper else 0
    assert f"{got:.{decimals}f}" == paper
    if zero == 3:
        assert got == 1.875 and round(got, 1) == 1.9


def test_zero_via_estimate_and_cli(capsys):
    b = M.estimate(M.MemoryInputs(params=7_500_000_000, dp=64, zero=2))
    assert round(b.peak / 1e9, 1) == 16.6 and b.activations == 0
    assert main(["memory", "--params", "7.5e9", "--dp", "64", "--zero", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert round(out["bytes"]["model_states"] / 1e9, 1) == 31.4


def test_bytes_per_param_table():
    assert sum(M.state_bytes_per_param("fp32", "adamw").values()) == 16
    mixed = M.state_bytes_per_param("bf16", "adamw")
    assert (mixed["weights"], mixed["grads"], mixed["optimizer"]) == (2, 2, 12)  # ZeRO's K = 12
    assert sum(M.state_bytes_per_param("bf16", "sgd").values()) == 12
    assert 10 < sum(M.state_bytes_per_param("bf16", "adam8bit").values()) < 10.01
    assert sum(M.state_bytes_per_param("fp32", "adafactor").values()) == 8


def test_adafactor_state_is_tiny_with_shapes():
    cfg = configs.get("llama-2-7b")
    ada = M.estimate(M.MemoryInputs(model=cfg, dtype="fp32", optimizer="adafactor", seq_len=128))
    n = configs.param_counts(cfg)["total"]
    assert 0 < ada.optimizer < 0.001 * 4 * n


# --- Korthikanti et al. 2022, Table 2 -----------------------------------------------------------

def test_korthikanti_table_2():
    s, b, h, a, t = 2048, 1, 12288, 96, 8  # the paper's 175B (GPT-3) configuration
    sbh, k = s * b * h, M.korthikanti_layer_bytes
    approx = pytest.approx
    assert k(s, b, h, a) == approx(sbh * (34 + 5 * a * s / h))
    assert k(s, b, h, a, t) == approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert k(s, b, h, a, t, sp=True) == approx(sbh / t * (34 + 5 * a * s / h))
    assert k(s, b, h, a, t, recompute="selective") == approx(sbh * (10 + 24 / t))
    assert k(s, b, h, a, t, True, "selective") == approx(34 * sbh / t)
    assert k(s, b, h, a, t, True, "full") == 2 * sbh
    # the paper: selective recompute saves 70% of the activations for GPT-3 (5as/h = 80) and
    # 65% for MT-NLG 530B (a = 128, h = 20480, 5as/h = 64)
    for a_, h_, printed in [(96, 12288, "70"), (128, 20480, "65")]:
        saved = 1 - k(s, b, h_, a_, t, True, "selective") / k(s, b, h_, a_, t, True)
        assert f"{100 * saved:.0f}" == printed


# --- estimate vs MemTracker measurement (CPU, fp32) ----------------------------------------------

@pytest.mark.parametrize("name,recompute", [("tiny-llama", "none"), ("tiny-llama", "full"),
                                            ("tiny-gpt2", "none")])
def test_estimate_matches_measurement_single_process(name, recompute):
    cfg = configs.get(name).with_(vocab_size=1024)
    measured = mm.measure_step(cfg, B, S, recompute=recompute)
    est = M.estimate(M.MemoryInputs(model=cfg, dtype="fp32", micro_batch=B, seq_len=S,
                                    recompute=recompute, activations="reference"))
    assert abs(est.peak / measured["peak"] - 1) < 0.10
    assert measured["optimizer"] == pytest.approx(est.optimizer, rel=0.01)
    if recompute == "none":  # the step is activation-dominated, so the test means something
        assert measured["activations"] > 2 * measured["weights"]


def test_bf16_activations_match_measurement():
    measured = mm.measure_step(TINY, B, S, dtype="bf16")
    est = M.estimate(M.MemoryInputs(model=TINY, dtype="bf16", micro_batch=B, seq_len=S,
                                    activations="reference"))
    # the peak is at the loss's backward: no gradients yet, so activations + temporaries are
    # exactly the saved activations and the logit buffers
    assert measured["grads"] == 0
    got = measured["activations"] + measured["temporaries"]
    assert abs((est.activations + est.logits) / got - 1) < 0.10


def test_estimate_matches_measurement_fsdp2_two_ranks():
    ranks = run(mm.measure_fsdp_rank, 2, args=(TINY, B, S), timeout_s=90)
    est = M.estimate(M.MemoryInputs(model=TINY, dtype="fp32", micro_batch=B, seq_len=S, dp=2,
                                    zero=3, activations="reference"))
    for r in ranks:
        assert abs(est.peak / r.value["peak"] - 1) < 0.10
        assert r.value["optimizer"] == pytest.approx(est.optimizer, rel=0.01)  # sharded in half


def test_measure_rejects_bad_input():
    with pytest.raises(ValueError, match="max_seq_len"):
        mm.measure_step(TINY, 1, 10_000)
    with pytest.raises(ValueError, match="dtype 'fp16'"):
        mm.measure_step(TINY, 1, 8, dtype="fp16")
    with pytest.raises(ValueError, match="process group"):
        mm.measure_fsdp_rank(TINY, 1, 8)


# --- what parallelism divides --------------------------------------------------------------------

def test_tp_pp_ep_cp_divide():
    cfg = configs.get("llama-3-8b")
    base = M.estimate(M.MemoryInputs(model=cfg, seq_len=4096))
    tp = M.estimate(M.MemoryInputs(model=cfg, seq_len=4096, tp=4))
    assert tp.weights < base.weights / 3.5 and tp.activations < base.activations / 3.5
    cp = M.estimate(M.MemoryInputs(model=cfg, seq_len=4096, cp=2))
    assert cp.weights == base.weights and cp.activations < base.activations
    pp = M.estimate(M.MemoryInputs(model=cfg, seq_len=4096, pp=4))
    assert pp.weights < base.weights / 2
    # 1F1B: the first stage holds pp micro-batches of L/pp layers, about L layers of activations
    layer = M.production_layer_bytes(cfg, 1, 4096, "bf16")
    one = M.estimate(M.MemoryInputs(model=cfg, seq_len=4096, pp=4, microbatches=1))
    first = M.estimate(M.MemoryInputs(model=cfg, seq_len=4096, pp=4, microbatches=8))
    assert first.stage == "first" and first.activations == pytest.approx(32 * layer)
    assert one.activations < first.activations
    inter = M.estimate(M.MemoryInputs(model=cfg, seq_len=4096, pp=4, microbatches=8, interleave=2))
    assert inter.activations == pytest.approx(32 * layer * (1 + 3 / 8))
    moe = configs.get("mixtral-8x7b")
    ep = M.estimate(M.MemoryInputs(model=moe, seq_len=1024, dp=8, ep=8))
    assert ep.weights < M.estimate(M.MemoryInputs(model=moe, seq_len=1024, dp=8)).weights / 4


def test_recompute_shrinks_activations():
    cfg = configs.get("llama-2-7b")
    acts = [M.estimate(M.MemoryInputs(model=cfg, seq_len=4096, recompute=r)).activations
            for r in ("none", "selective", "full")]
    assert acts[0] > acts[1] > acts[2]


@pytest.mark.parametrize("kw,msg", [
    (dict(tp=3), "tp 3 does not divide 32 heads"),
    (dict(pp=5), "pp 5 does not divide 32 layers"),
    (dict(zero=3), "--zero 3 .* needs --dp > 1"),
    (dict(dp=8, ep=2), "needs a mixture-of-experts model"),
    (dict(cp=3, seq_len=4096), "cp 3 does not divide the sequence length 4096"),
    (dict(dtype="fp64"), "dtype 'fp64' is unknown"),
    (dict(micro_batch=0), "--micro-batch must be a positive integer"),
])
def test_bad_inputs(kw, msg):
    with pytest.raises(ValueError, match=msg):
        M.MemoryInputs(model=configs.get("llama-2-7b"), **kw)


def test_needs_model_or_params():
    with pytest.raises(ValueError, match="either a model config or a bare parameter count"):
        M.MemoryInputs()
    with pytest.raises(ValueError, match="unknown accelerator"):
        M.fits(M.estimate(M.MemoryInputs(params=10)), "tpu-v9")


# --- properties ----------------------------------------------------------------------------------

@settings(deadline=None, max_examples=50)
@given(params=st.integers(1, 10**12), dp=st.integers(2, 4096),
       dtype=st.sampled_from(M.PRECISIONS), opt=st.sampled_from(M.OPTIMIZERS))
def test_zero_stages_monotone_and_stage3_divides(params, dp, dtype, opt):
    states = [M.zero_model_states(params, dp, z, dtype, opt) for z in range(4)]
    assert all(a >= b for a, b in zip(states, states[1:]))
    assert states[3] == pytest.approx(states[0] / dp)


@settings(deadline=None, max_examples=30)
@given(tp=st.sampled_from([1, 2, 4, 8]), zero=st.integers(0, 3), dp=st.sampled_from([2, 8, 64]),
       mb=st.integers(1, 4), rc=st.sampled_from(M.RECOMPUTE))
def test_estimate_positive_and_more_dp_never_costs(tp, zero, dp, mb, rc):
    cfg = configs.get("llama-2-7b")
    kw = dict(model=cfg, seq_len=2048, tp=tp, zero=zero, micro_batch=mb, recompute=rc)
    a = M.estimate(M.MemoryInputs(dp=dp, **kw))
    b = M.estimate(M.MemoryInputs(dp=2 * dp, **kw))
    assert 0 < b.peak <= a.peak <= a.upper_bound


# --- CLI -----------------------------------------------------------------------------------------

def test_cli_help_lists_every_option(capsys):
    with pytest.raises(SystemExit) as e:
        main(["memory", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for opt in ("--model", "--params", "--dp", "--zero", "--tp", "--pp", "--cp", "--ep",
                "--micro-batch", "--seq-len", "--recompute", "--dtype", "--optimizer", "--gpu",
                "--json"):
        assert opt in out


def test_cli_table_and_json(capsys):
    assert main(["memory", "--model", "llama-3-8b", "--seq-len", "8192", "--gpu", "h100-sxm"]) == 0
    out = capsys.readouterr().out
    assert "activations" in out and "h100-sxm" in out
    assert main(["memory", "--model", "llama-3-8b", "--tp", "2", "--pp", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["bytes"]["peak"] > data["bytes"]["model_states"] > 0
    assert data["fit"]["gpu"] == "h100-sxm" and isinstance(data["fit"]["fits"], bool)


@pytest.mark.parametrize("argv,msg", [
    (["--model", "llama-3-8b", "--tp", "3"], "tp 3 does not divide 32 heads"),
    (["--model", "llama-3-8b", "--pp", "5"], "pp 5 does not divide 32 layers"),
    (["--params", "1e9", "--zero", "3"], "needs --dp > 1"),
    (["--params", "-5"], "--params must be a positive whole number"),
    (["--params", "1e9", "--gpu", "a9000"], "unknown accelerator"),
    (["--model", "no-such-model"], "unknown model"),
    (["--params", "1e9", "--dtype", "fp32", "--grad-dtype", "bf16"],
     "--grad-dtype bf16 with --dtype fp32"),
])
def test_cli_bad_input(argv, msg, capsys):
    assert main(["memory", *argv]) == 2
    assert msg in capsys.readouterr().err


def test_memory_command_rejects_an_infinite_parameter_count(capsys):
    from trainbook.__main__ import main
    assert main(["memory", "--params", "inf"]) == 2
    assert "--params must be a positive whole number" in capsys.readouterr().err


# --- the production activation model, gradient precision, the fit verdict ----------------------

def test_production_layer_counts_fused_kernels_by_hand():
    cfg = configs.get("llama-3-8b")
    d, q, kv, ff, heads = 4096, 32 * 128, 8 * 128, 14336, 32
    per_token = (2 * (2 * d + 4) + 2 * 2 * d  # two norms (input, fp32 rstd), two matmul inputs
                 + 2 * (2 * q + 2 * kv) + 4 * heads  # q, out; k, v (kv heads only); fp32 LSE
                 + 2 * 3 * ff)  # gate, up, down's input
    assert M.production_layer_bytes(cfg, 2, 1024) == 2 * 1024 * per_token
    # sequence parallelism divides every term by t; context parallelism keeps only local k, v
    assert M.production_layer_bytes(cfg, 1, 1024, tp=4, sp=True) == pytest.approx(
        M.production_layer_bytes(cfg, 1, 1024) / 4)
    assert M.production_layer_bytes(cfg, 1, 1024, cp=4) == M.production_layer_bytes(cfg, 1, 256)
    # selective recompute of the attention core saves only the log-sum-exp under fused attention
    none, sel = (M.production_layer_bytes(cfg, 1, 1024, recompute=r) for r in ("none", "selective"))
    assert none - sel == 1024 * 4 * heads
    assert M.production_layer_bytes(cfg, 1, 1024, recompute="full") == 1024 * d * 2
    # grouped-query attention: 8 kv heads instead of 32 save 2 x 24 x 128 x 2 bytes per token
    mha = cfg.with_(n_kv_heads=32)
    assert (M.production_layer_bytes(mha, 1, 1) - M.production_layer_bytes(cfg, 1, 1)
            == 2 * 24 * 128 * 2)


def test_production_is_close_to_korthikanti_selective_for_llama_and_far_below_reference():
    for name in ("llama-3-8b", "llama-3-70b", "llama-3-405b"):
        cfg = configs.get(name)
        prod = M.production_layer_bytes(cfg, 1, 8192)
        kor = M.korthikanti_layer_bytes(8192, 1, cfg.d_model, cfg.n_heads, recompute="selective")
        ref = M.reference_layer_bytes(cfg, 1, 8192, "bf16")
        assert 0.9 < prod / kor < 1.01 and ref > 1.4 * prod


def test_fp32_gradients_are_megatrons_18_bytes():
    assert sum(M.state_bytes_per_param("bf16", "adamw", "fp32").values()) == 18
    assert M.zero_model_states(1e9, 8, 1, grad_dtype="fp32") == 1e9 * (2 + 4 + 12 / 8)
    cfg = configs.get("llama-3-8b")
    bf, f32 = (M.estimate(M.MemoryInputs(model=cfg, seq_len=4096, dp=8, zero=3, grad_dtype=g))
               for g in (None, "fp32"))
    assert f32.grads == pytest.approx(2 * bf.grads) and f32.transient > bf.transient
    with pytest.raises(ValueError, match="grad-dtype bf16 with --dtype fp32"):
        M.MemoryInputs(model=cfg, dtype="fp32", grad_dtype="bf16")
    with pytest.raises(ValueError, match="grad dtype 'fp8' is unknown"):
        M.state_bytes_per_param("bf16", "adamw", "fp8")


def test_fit_verdict_respects_the_estimates_margin():
    cap = hardware.get("h100-sxm").capacity_gib * M.GiB
    def verdict(peak):
        b = M.MemoryBreakdown(0, 0, 0, 0, 0, 0, peak, peak, 0, "all")
        return M.fits(b, "h100-sxm")
    assert verdict(0.85 * cap)["verdict"] == "fits"
    assert verdict(0.97 * cap)["verdict"] == "too close to call" and verdict(0.97 * cap)["fits"]
    assert verdict(1.05 * cap)["verdict"] == "too close to call"
    assert verdict(1.2 * cap)["verdict"] == "does not fit"
    assert verdict(0.97 * cap)["capacity_gib"] == pytest.approx(81559 / 1024)
    with pytest.raises(ValueError, match="margin"):
        M.fits(M.MemoryBreakdown(0, 0, 0, 0, 0, 0, 1, 1, 0, "all"), margin=-0.1)


def test_memory_command_gives_the_verdict_and_takes_grad_dtype(capsys):
    argv = ["memory", "--model", "llama-3-8b", "--seq-len", "8192", "--dp", "8", "--zero", "1"]
    assert main([*argv, "--json"]) == 0
    bf = json.loads(capsys.readouterr().out)
    assert main([*argv, "--grad-dtype", "fp32", "--json"]) == 0
    f32 = json.loads(capsys.readouterr().out)
    assert f32["bytes"]["grads"] == 2 * bf["bytes"]["grads"]
    assert f32["setup"]["activations"] == "production" and f32["setup"]["grad_dtype"] == "fp32"
    assert bf["fit"]["verdict"] in ("fits", "too close to call", "does not fit")
    assert main(argv) == 0
    assert "GiB reported" in capsys.readouterr().out
