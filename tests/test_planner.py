import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainbook import configs, hardware
from trainbook.__main__ import main
from trainbook.compute import memory as M
from trainbook.layout import stage_layers
from trainbook.parallel import planner as P
from trainbook.parallel import step_cost as C

L3 = P.LLAMA3_405B


@pytest.fixture(scope="module")
def llama3():
    job = P.Job(configs.get("llama-3-405b"), L3["global_batch_tokens"], L3["seq_len"])
    cluster = P.Cluster(gpus=L3["gpus"])
    return job, cluster, P.rank(job, cluster, margin=M.ESTIMATE_MARGIN)


def test_llama3_405b_published_layout_is_feasible_and_near_the_top(llama3):
    job, cluster, plans = llama3
    assert job.global_batch_tokens == 2**24 and job.sequences == 2048  # "16M" tokens
    shapes = P.best_per_shape(plans)
    hit = P.find(shapes, tp=8, pp=16, dp=128, cp=1)
    assert hit is not None
    pos, plan = hit
    assert plan.feasible and plan.memory_gib <= cluster.usable_gib
    # "near the top": among the 3 fastest shapes, within 10% of the fastest estimated step
    assert pos < 3 and plan.step_s <= 1.1 * shapes[0].step_s
    # Meta's setting (FSDP keeping weights gathered = ZeRO 2, no recomputation, no
    # interleaving) fits too; with ZeRO 1 it does not, and the explanation says which term
    assert "feasible; peak memory" in P.explain(P.Layout(128, 8, 16, 1, 1, 2, 1, "none"),
                                                 job, cluster)
    text = P.explain(P.Layout(128, 8, 16, 1, 1, 1, 1, "none"), job, cluster)
    assert "infeasible" in text and "largest term: activations" in text and "exceeds" in text


def test_shapes_that_beat_the_published_one_only_without_a_memory_margin(llama3):
    job, cluster, _ = llama3
    bare = P.best_per_shape(P.rank(job, cluster))
    pos, _ = P.find(bare, tp=8, pp=16, dp=128, cp=1)
    assert pos > 0  # the shapes ahead fill the memory the estimate cannot vouch for
    assert all(0 <= p.memory_margin < M.ESTIMATE_MARGIN for p in bare[:pos])
    with pytest.raises(ValueError, match="margin"):
        P.rank(job, cluster, margin=1.5)


@pytest.mark.parametrize("row", P.NARAYANAN_TABLE1, ids=[f"{r[0]}B" for r in P.NARAYANAN_TABLE1])
def test_narayanan_table1_layouts_fit_on_a100_80gb(row):
    billions, heads, hidden, layers, t, p, n, B, tflops = row
    plan = P.narayanan_check(row)
    assert plan.feasible, plan.reasons
    assert plan.layout.gpus == n and (plan.layout.tp, plan.layout.pp) == (t, p)
    assert plan.memory_gib < 80
    # estimated hardware utilization in the paper's ballpark (they report 43-52% of peak)
    assert 0.3 < plan.hfu < 0.6


def test_explanations_name_the_rule(llama3):
    job, cluster, _ = llama3
    assert "tp 16 exceeds the 8 GPUs of one NVLink domain" in P.explain("tp=16,pp=8", job, cluster)
    assert "pp 5 does not divide 126 layers" in P.explain("tp=8,pp=5,dp=4", job, cluster)
    assert "= 160 GPUs, not the 16384" in P.explain("tp=8,pp=5,dp=4", job, cluster)
    assert "cp 3 does not divide the sequence length" in P.explain("cp=3", job, cluster)
    assert "chunks of 4096, under 8192" in P.explain("cp=2,tp=8,pp=16", job, cluster)
    assert "micro-batch(es) per replica cannot fill" in P.explain(
        "tp=8,pp=64,dp=32,micro_batch=64", job, cluster)
    assert "needs a mixture-of-experts" in P.explain("tp=8,pp=16,dp=128,ep=2", job, cluster)
    assert "feasible; peak memory" in P.explain("tp=8,pp=16,zero=2,recompute=full", job, cluster)
    assert "largest term: optimizer" in P.explain("tp=8,pp=8,recompute=full", job, cluster)


def test_uneven_stages():
    assert stage_layers(126, 16) == 8  # Llama 3: first and last stages one block short
    assert stage_layers(126, 5) is None and stage_layers(128, 16) == 8
    assert stage_layers(126, 128) is None  # stages of one block minus two: no


@settings(deadline=None, max_examples=25)
@given(gpus=st.sampled_from([8, 16, 24, 32, 48, 64, 96]),
       model=st.sampled_from(["llama-3-8b", "gpt2-xl", "mixtral-8x7b", "llama-2-13b"]),
       seqs=st.sampled_from([64, 96, 128, 256]))
def test_every_enumerated_layout_obeys_the_rules(gpus, model, seqs):
    cfg = configs.get(model)
    job = P.Job(cfg, seqs * 1024, 1024)
    cluster = P.Cluster(gpus=gpus, min_cp_tokens=256)
    for lay in P.enumerate_layouts(job, cluster, recompute=("none",), micro_batches=(1, 2)):
        assert lay.dp * lay.tp * lay.pp * lay.cp == gpus
        assert lay.tp <= 8 and cfg.n_heads % lay.tp == 0 and cfg.n_kv_heads % lay.tp == 0
        assert cfg.d_ff % lay.tp == 0 and 1024 % lay.cp == 0
        assert stage_layers(cfg.n_layers, lay.pp * lay.interleave) is not None
        assert cfg.n_experts % lay.ep == 0 and lay.dp % lay.ep == 0
        m, rest = divmod(seqs, lay.dp * lay.micro_batch)
        assert rest == 0 and (lay.pp == 1 or m >= lay.pp)


def test_time_model_responds_to_its_assumptions(llama3):
    job, cluster, _ = llama3
    lay = P.Layout(128, 8, 16, 1, 1, 2, 1, "full", 2)
    base = C.step_time(lay, job, cluster)
    assert base["total"] == pytest.approx(sum(base[k] for k in (
        "compute", "tp", "cp", "ep", "pp_p2p", "bubble", "dp_exposed")))
    # the bubble is (p - 1) / v stage-times
    stage = (base["total"] - base["bubble"] - base["dp_exposed"]) / 16
    assert base["bubble"] == pytest.approx(15 / 2 * stage)
    faster = C.step_time(lay, job, P.Cluster(gpus=16384, mfu_matmul=0.6))
    assert faster["compute"] == pytest.approx(base["compute"] * 0.5 / 0.6)
    slow_net = P.Cluster(gpus=16384, nic_gbps=5.0)
    assert C.step_time(P.Layout(2048, 8, 1, 1, 1, 3, 1, "full"), job, slow_net)["dp_exposed"] > \
        C.step_time(P.Layout(2048, 8, 1, 1, 1, 3, 1, "full"), job, cluster)["dp_exposed"]


def test_bad_input():
    cfg = configs.get("llama-3-8b")
    with pytest.raises(ValueError, match="not a whole number of 4,096-token sequences"):
        P.Job(cfg, 10_000, 4096)
    with pytest.raises(ValueError, match="GPU count must be a positive whole number"):
        P.Cluster(gpus=0)
    with pytest.raises(ValueError, match="unknown accelerator"):
        P.Cluster(gpu="tpu", gpus=8)
    with pytest.raises(ValueError, match="cannot read 'tp8'"):
        P.Layout.parse("tp8")
    with pytest.raises(ValueError, match="tp must be a whole number"):
        P.Layout.parse("tp=x")
    with pytest.raises(ValueError, match="no 2.0B model"):
        P.narayanan_model(2.0)


def test_cli(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--help"])
    assert e.value.code == 0
    args = ["plan", "--model", "llama-3-70b", "--gpus", "64", "--global-batch-tokens",
            str(64 * 8192), "--seq-len", "8192"]
    capsys.readouterr()
    assert main(args + ["--top", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["feasible_layouts"] > 0 and len(out["layouts"]) == 3
    steps = [r["step s"] for r in out["layouts"]]
    assert steps == sorted(steps)
    assert all(r["dp"] * r["tp"] * r["pp"] * r["cp"] == 64 for r in out["layouts"])
    assert main(args + ["--top", "2"]) == 0
    assert "feasible layouts" in capsys.readouterr().out
    assert main(args + ["--explain", "tp=16,pp=4"]) == 0
    assert "tp 16 exceeds the 8 GPUs of one NVLink domain" in capsys.readouterr().out
    assert main(args[:4] + ["0"] + args[5:]) == 2
    assert "--gpus must be a positive integer" in capsys.readouterr().err
    assert main(args[:-1] + ["8000"]) == 2
    assert "not a whole number of 8,000-token sequences" in capsys.readouterr().err
    assert main(args + ["--gpu", "tpu-v9"]) == 2
    assert "unknown accelerator" in capsys.readouterr().err


def test_dtypes_map_to_honest_peaks():
    from trainbook import hardware
    from trainbook.compute import flops
    cfg = configs.get("llama-3-8b")
    with pytest.raises(ValueError, match="dtype 'fp8' is unknown"):
        P.Job(cfg, 1024 * 4096, 4096, dtype="fp8")
    h100, v100 = P.Cluster(gpus=64), P.Cluster(gpu="v100-sxm2-32gb", gpus=64)
    fp32, bf16 = P.Job(cfg, 1024 * 4096, 4096, dtype="fp32"), P.Job(cfg, 1024 * 4096, 4096)
    assert C.matmul_dtype(fp32, h100) == "tf32" and C.matmul_dtype(bf16, h100) == "bf16"
    assert C.matmul_dtype(fp32, v100) == "fp32"  # no TF32 before Ampere
    assert C.peak_flops(fp32, h100) == hardware.get("h100-sxm").peak_flops("tf32")
    lay = P.Layout(dp=8, tp=8, zero=1, recompute="full")
    plan = P.evaluate(lay, fp32, h100)
    model_flops = flops.training_flops(cfg, 4096)["total"] * fp32.sequences
    assert plan.mfu == pytest.approx(
        flops.utilization(model_flops, plan.step_s, C.peak_flops(fp32, h100), 64))
    # fp32 moves twice the bytes of bf16 on the wire (the latency term stays), and computes at
    # the TF32 peak, half the bf16 one
    assert C.step_time(lay, bf16, h100)["tp"] < C.step_time(lay, fp32, h100)["tp"] < \
        2 * C.step_time(lay, bf16, h100)["tp"]
    assert C.step_time(lay, fp32, h100)["compute"] == pytest.approx(
        2 * C.step_time(lay, bf16, h100)["compute"])


def test_the_nvlink_domain_comes_from_the_hardware_table():
    """TP is bounded by the NVLink domain, not by a node: 72 GPUs on a GB200 NVL72; links inside
    the domain run at the table's achievable bus bandwidth, not at half the bidirectional rate."""
    cfg = configs.get("llama-3-70b")
    job = P.Job(cfg, 1024 * 8192, 8192)
    hgx, nvl72 = P.Cluster(gpus=144), P.Cluster(gpu="gb200-nvl72", gpus=144)
    assert (hgx.domain_gpus, nvl72.domain_gpus) == (8, 72) and hgx.nic_gbps == 50.0
    wide_tp = P.Layout(9, 16, 1, 1, 1, 1, 1, "full")
    assert any("NVLink domain" in r for r in P.check_rules(wide_tp, job, hgx))
    assert not any("NVLink domain" in r for r in P.check_rules(wide_tp, job, nvl72))
    lay = P.Layout(18, 8, 1, 1, 1, 1, 1, "full")
    h100 = hardware.get("h100-sxm")
    inside = C.step_time(lay, job, hgx)["tp"]
    faster = C.step_time(lay, job, P.Cluster(gpus=144, alpha_domain_s=0.0))["tp"]
    # the bandwidth term at 480 GB/s (NVLS all-reduce), not at 450 (half of 900)
    act = 1 * 8192 * cfg.d_model * 2
    ring = 2 * 7 / 8 * act / (h100.busbw_gbps("all_reduce") * 1e9)
    layers, n_ar, m = cfg.n_layers, 6, job.sequences // (lay.dp * lay.micro_batch)
    assert faster == pytest.approx(m * layers * n_ar * ring, rel=1e-9) and inside > faster
    with pytest.raises(ValueError, match="has no scale-out network"):
        P.Cluster(gpu="t4", gpus=16)
    assert P.Cluster(gpu="t4", gpus=16, nic_gbps=12.5).nic_gbps == 12.5
