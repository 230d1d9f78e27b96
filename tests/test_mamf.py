
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainbook import hardware
from trainbook.__main__ import main
from trainbook.bench import matmul, memory, timing
from trainbook.compute import roofline
from trainbook.launch import resolve_device

SMALL = dict(repeats=3, warmup=1, flush_bytes=2**20, progress=False)


def test_ranges_are_inclusive_and_bad_ranges_are_refused():
    assert matmul.parse_range(256, 1024, 256) == [256, 512, 768, 1024]
    assert matmul.parse_range(100, 120, 15) == [100, 115]  # STOP off the grid: not included
    assert matmul.parse_range(64, 64, 1) == [64]
    with pytest.raises(ValueError, match="STEP must be > 0"):
        matmul.parse_range(1, 10, 0)
    with pytest.raises(ValueError, match="empty"):
        matmul.parse_range(10, 1, 1)
    with pytest.raises(ValueError, match="START must be >= 1"):
        matmul.parse_range(0, 1024, 256)
    assert matmul.make_shapes([1, 2], [3], [4, 5]) == [(1, 3, 4), (1, 3, 5), (2, 3, 4), (2, 3, 5)]
    with pytest.raises(ValueError, match="no values for n"):
        matmul.make_shapes([1], [], [1])


def test_dtypes_a_cpu_cannot_do_are_refused():
    cpu = torch.device("cpu")
    assert matmul.check_dtype("bfloat16", cpu) == "bf16"
    for bad in ("fp8", "tf32"):
        with pytest.raises(ValueError, match="need a GPU"):
            matmul.check_dtype(bad, cpu)
    with pytest.raises(ValueError, match="unknown dtype"):
        matmul.check_dtype("int3", cpu)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no GPU is visible"):
            resolve_device("cuda")
    with pytest.raises(ValueError, match="unknown device"):
        resolve_device("tpu9")


def test_sweep_stats_are_consistent_and_written_as_they_go(tmp_path):
    out = tmp_path / "mamf.jsonl"
    shapes = [(64, 64, 64), (128, 96, 64), (96, 128, 160)]
    s = matmul.sweep(shapes, "fp32", "cpu", output=out, command="test", **SMALL)
    assert not s.interrupted and len(s.results) == 3
    for r in s.results:
        assert len(r.times_s) == 3 and all(t > 0 for t in r.times_s)
        assert r.max_tflops >= r.median_tflops >= r.min_tflops
        assert r.max_tflops >= r.mean_tflops >= r.min_tflops
        assert r.flops == 2 * r.m * r.n * r.k
    for stat in ("mean", "median", "max"):
        best = s.best(stat)
        assert (best.m, best.n, best.k) in shapes
        key = f"{stat}_tflops"
        assert getattr(best, key) == max(getattr(r, key) for r in s.results)
    meta, rows = matmul.read_results(out)
    assert meta["command"] == "test" and meta["dtype"] == "fp32"
    assert meta["torch"] == torch.__version__
    assert [(r["m"], r["n"], r["k"]) for r in rows] == shapes
    assert rows[1]["max_tflops"] == pytest.approx(s.results[1].max_tflops)
    summary = s.summary()
    assert summary["measured"] == summary["planned"] == 3
    assert summary["best_max"]["shape"] == s.best("max").shape


def test_interrupt_keeps_what_was_measured(tmp_path, monkeypatch):
    real = matmul.time_matmul
    calls = []

    def flaky(*a, **k):  # Ctrl-C arrives while the third shape is being timed
        calls.append(a[:3])
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(matmul, "time_matmul", flaky)
    out = tmp_path / "partial.jsonl"
    s = matmul.sweep([(32, 32, 32 * i) for i in range(1, 6)], "fp32", "cpu", output=out, **SMALL)
    assert s.interrupted and len(s.results) == 2 and s.planned == 5
    assert len(matmul.read_results(out)[1]) == 2
    assert s.summary()["best_max"]["shape"] in ("32x32x32", "32x32x64")


def test_interrupt_prints_a_summary_from_the_command(monkeypatch, capsys):
    real = matmul.time_matmul
    n = {"calls": 0}

    def flaky(*a, **k):
        n["calls"] += 1
        if n["calls"] == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(matmul, "time_matmul", flaky)
    rc = main(["mamf", "--m-range", "32", "128", "32", "--n", "32", "--k", "32", "--device",
               "cpu", "--dtype", "fp32", "--quick", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 130
    assert "interrupted: 1 of 4 shapes measured" in out and "32x32x32" in out


def test_timer_and_flusher_on_cpu():
    timer = timing.Timer(torch.device("cpu"))
    assert timer(lambda: sum(range(1000))) > 0
    flush = timing.CacheFlusher(torch.device("cpu"), 2**20)
    flush()
    assert flush.buffer.numel() == 2**20 and int(flush.buffer.max()) == 0
    with pytest.raises(ValueError, match="flush size"):
        timing.CacheFlusher(torch.device("cpu"), -1)
    assert timing.default_flush_bytes(torch.device("cpu"), small=True) == 32 * 2**20
    assert 0 < timing.default_flush_bytes(torch.device("cpu")) <= timing.CPU_FLUSH_CAP


def test_bf16_matmul_is_what_a_bf16_sweep_times(monkeypatch):
    seen = []
    real = torch.matmul

    def spy(a, b, **k):
        seen.append(a.dtype)
        return real(a, b, **k)

    monkeypatch.setattr(torch, "matmul", spy)
    matmul.time_matmul(16, 16, 16, "bf16", "cpu", repeats=2, warmup=1)
    assert seen and set(seen) == {torch.bfloat16}


def test_peak_tflops_finds_a_peak_on_this_cpu():
    s = matmul.peak_tflops("fp32", "cpu", sizes=[128, 256], repeats=3)
    assert s.best("max").max_tflops > 0.001  # a 2-core CPU manages >= 1 GFLOPS fp32
    with pytest.raises(ValueError, match="nothing was measured"):
        matmul.Sweep([], 1, "fp32", "cpu", "cpu").best()
    with pytest.raises(ValueError, match="stat must be"):
        s.best("p99")


# ---- roofline --------------------------------------------------------------------------------

def test_h100_bf16_ridge_point_and_square_intensity():
    h100 = hardware.get("h100-sxm")
    assert h100.ridge_point("bf16") == pytest.approx(989.4e12 / 3350e9)  # ~295 FLOP/byte
    assert round(h100.ridge_point("bf16")) == 295
    assert roofline.matmul_intensity(4096, 4096, 4096, "bf16") == pytest.approx(4096 / 3)
    assert roofline.matmul_intensity(4096, 4096, 4096, "fp32") == pytest.approx(4096 / 6)
    # n/3 >= 295.34 from n = 887 on: smaller squares cannot reach the bf16 roof of an H100
    assert roofline.min_square_for_compute_bound(h100, "bf16") == 887
    assert roofline.matmul_bound(887, 887, 887, "bf16", h100) == "compute"
    assert roofline.matmul_bound(886, 886, 886, "bf16", h100) == "memory"
    # a decode-time matvec (batch 1) is memory-bound everywhere: intensity ~1 FLOP/byte in bf16
    assert roofline.matmul_intensity(1, 4096, 4096, "bf16") == pytest.approx(1, rel=1e-3)
    assert roofline.matmul_bound(1, 4096, 4096, "bf16", h100) == "memory"
    # an elementwise add in bf16: 1 FLOP per 6 bytes
    assert roofline.elementwise_intensity(1, 3, "bf16") == pytest.approx(1 / 6)


@settings(deadline=None, max_examples=50)
@given(st.integers(1, 20000), st.integers(1, 20000), st.integers(1, 20000),
       st.sampled_from(["fp32", "bf16", "fp8"]))
def test_intensity_properties(m, n, k, dtype):
    i = roofline.matmul_intensity(m, n, k, dtype)
    # bounded by the smallest dimension: 2mnk / (b (mk + kn + mn)) <= 2 min(m, n, k) / b
    assert 0 < i <= 2 * min(m, n, k) / roofline.bytes_per_element(dtype) + 1e-9
    assert roofline.matmul_intensity(n, m, k, dtype) == pytest.approx(i)  # symmetric in m, n
    spec = hardware.get("a100-80gb")
    if dtype != "fp8":
        roof = roofline.attainable_flops(i, spec.peak_flops(dtype), spec.hbm_gbps * 1e9)
        assert roof <= spec.peak_flops(dtype)
        assert (roof == spec.peak_flops(dtype)) == (roofline.matmul_bound(m, n, k, dtype, spec)
                                                    == "compute")


def test_roofline_bad_input():
    with pytest.raises(ValueError, match="dimension k must be >= 1"):
        roofline.matmul_intensity(1, 1, 0, "bf16")
    with pytest.raises(ValueError, match="must all be > 0"):
        roofline.attainable_flops(1.0, 0.0, 1.0)
    with pytest.raises(ValueError, match="has no fp8 peak"):
        roofline.matmul_bound(4096, 4096, 4096, "fp8", hardware.get("a100-80gb"))


def test_copy_bandwidth_is_measured():
    gbps = memory.copy_bandwidth_gbps(8 * 2**20, "cpu", repeats=2)
    assert gbps > 0.1
    with pytest.raises(ValueError, match="nbytes >= 1 MiB"):
        memory.copy_bandwidth_gbps(100, "cpu")


# ---- utilisation -----------------------------------------------------------------------------

def test_executed_flops_match_6n_plus_attention():
    from trainbook import configs
    from trainbook.compute.flops import measure_flops, training_flops_per_token, utilization
    from trainbook.model import Transformer

    cfg = configs.get("tiny-llama").with_(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                          d_ff=128, vocab_size=256, max_seq_len=32)
    torch.manual_seed(0)
    model = Transformer(cfg)
    x = torch.randint(0, 256, (2, 32))
    executed = measure_flops(model, x)["total"] / x.numel()
    model_flops = training_flops_per_token(cfg, 32)
    # the counter sees matmuls only; 6N also counts norm weights (a few hundred parameters)
    assert executed == pytest.approx(model_flops, rel=0.02)
    assert utilization(1000 * model_flops, 1.0, 1e12) == pytest.approx(1000 * model_flops / 1e12)


def test_counted_flops_reproduce_korthikanti_with_and_without_recompute():
    """GPT flavour (4h MLP, multi-head): the FLOP counter on the real model gives exactly
    72 B s l h^2 (1 + s/6h + V/12lh) for B sequences (Korthikanti et al. 2022, Appendix A), and
    96 B s l h^2 (1 + s/6h + V/16lh) with full activation recomputation (Narayanan et al. 2021,
    SC21, eq. 3)."""
    from trainbook import configs
    from trainbook.compute.flops import measure_flops, megatron_flops
    from trainbook.model import Transformer

    L, h, s, V = 2, 64, 32, 300
    cfg = configs.get("gpt2").with_(d_model=h, n_layers=L, n_heads=4, d_ff=4 * h, vocab_size=V,
                                    max_seq_len=s)
    model = Transformer(cfg)
    x = torch.randint(0, V, (2, s))
    plain = measure_flops(model, x)["total"]
    full = measure_flops(model, x, recompute="full")["total"]
    assert plain == megatron_flops(2, s, L, h, V, recompute="none")
    assert full == megatron_flops(2, s, L, h, V, recompute="full")
    assert 1 < full / plain < 4 / 3  # 4/3 for the layers; the logits are not recomputed
    assert isinstance(model.blocks[0], type(model.blocks[1]))
    assert not hasattr(model.blocks[0], "block")


@settings(deadline=None, max_examples=50)
@given(st.integers(1, 5000), st.integers(0, 5000), st.integers(1, 700))
def test_parse_range_properties(start, length, step):
    values = matmul.parse_range(start, start + length, step)
    assert values[0] == start and values[-1] <= start + length < values[-1] + step
    assert all(b - a == step for a, b in zip(values, values[1:]))
