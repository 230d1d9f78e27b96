"""The slow low-precision path: detection, forcing it, and budgeted measurement on either kind."""

import os
import subprocess
import sys

import pytest

from trainbook.bench import lowp, matmul, peak


def test_cpu_class_from_flags():
    assert lowp.cpu_class({"avx2", "amx_bf16", "avx512_bf16"}, env={}) == "AMX+AVX512-BF16"
    assert lowp.cpu_class({"avx2", "fma"}, env={}) == "no native bf16"  # AMD Zen 2
    assert lowp.cpu_class({"asimd", "bf16"}, env={}) == "Arm BF16"
    forced = lowp.cpu_class({"amx_bf16"}, env={"TRAINBOOK_SLOW_LOWP": "1"})
    assert forced.startswith("AMX") and "forced slow path" in forced
    assert not lowp.slow_path_forced({"TRAINBOOK_SLOW_LOWP": "0"})
    assert not lowp.slow_path_forced({})


def test_probe_classifies_and_needs_fp32():
    lp = lowp.LowPrecision("cpu", "test", {"fp32": 0.4, "bf16": 0.0024, "fp16": 0.9})
    assert lp.emulated("bf16") and not lp.emulated("fp16") and lp.fastest == "fp16"
    assert "bf16 emulated" in lp.describe() and "fp16 native" in lp.describe()
    with pytest.raises(ValueError, match="must include fp32"):
        lowp.probe(dtypes=("bf16",))


def test_forced_slow_path_is_detected_in_a_fresh_process():
    """TRAINBOOK_SLOW_LOWP=1 turns oneDNN off on import, and the probe sees bf16 as emulated
    (about 1/150 of fp32; the threshold is 1/4, so a busy machine cannot flip the verdict)."""
    code = ("import torch, trainbook; from trainbook import nb; from trainbook.bench import lowp; "
            "ctx = nb.setup(); lp = lowp.probe(); print(torch.backends.mkldnn.enabled, "
            "lp.emulated('bf16'), ctx.lowp_emulated, ctx.matmul_dtype)")
    env = {**os.environ, "TRAINBOOK_SLOW_LOWP": "1", "TRAINBOOK_SIZE": "small"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert "bf16/fp16 are emulated on this CPU" in out and "forced slow path" in out, out
    assert out.splitlines()[-1].split() == ["False", "True", "True", "fp32"], out


def test_machine_class_is_reported():
    """Printed (pytest -s, or the CI log's report header) so a reader sees which kind ran it."""
    line = lowp.machine_line()
    print(line)
    assert "bf16" in line and "GFLOPS" in line


def test_budgeted_sweep_skips_what_does_not_fit_and_says_so():
    shapes = [(64, 64, 64), (128, 128, 128), (4096, 4096, 4096)]
    s = matmul.sweep(shapes, "fp32", "cpu", repeats=10**6, warmup=1, flush_bytes=0,
                     progress=False, budget_s=1.0)
    # a 4096-cube fp32 matmul is 137 GFLOP: seconds on any CPU, so it cannot fit in 1 s; the
    # 128-cube one must (with a 0.3 s budget a loaded 2-core machine overran the first shape's
    # share and skipped it: the budget is spread over the shapes, not reserved)
    assert (4096, 4096, 4096) in s.skipped and len(s.results) == 2
    assert s.summary()["skipped"] == 1 and s.summary()["measured"] == 2
    assert all(len(r.times_s) < 10**6 for r in s.results)  # repeats were cut by the budget
    with pytest.raises(ValueError, match="budget must be > 0"):
        matmul.sweep(shapes, "fp32", "cpu", budget_s=0)


def test_budgeted_time_matmul_runs_at_least_once():
    r = matmul.time_matmul(256, 256, 256, "fp32", "cpu", repeats=10**6, warmup=0,
                           budget_s=1e-6)
    assert len(r.times_s) == 1
    with pytest.raises(ValueError, match="budget_s must be > 0"):
        matmul.time_matmul(8, 8, 8, budget_s=-1)


def test_peak_measurement_runs_within_a_budget_on_either_kind():
    for dtype in ("fp32", "bf16"):  # bf16 emulated ~150x slower on some CPUs: the budget holds
        assert peak.measure_matmul_tflops(dtype, "cpu", budget_s=0.3) > 0
    with pytest.raises(ValueError, match="budget_s must be > 0"):
        peak.measure_matmul_tflops("fp32", budget_s=0)
