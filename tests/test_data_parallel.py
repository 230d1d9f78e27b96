import dataclasses

import pytest

from trainbook import launch
from trainbook.parallel import data_parallel as dp
from trainbook.parallel import harness


@pytest.fixture(scope="module")
def setup_and_ref():
    s = harness.Setup()
    return s, harness.reference(s)


def test_two_ranks_match_single_process(setup_and_ref):
    s, ref = setup_and_ref
    variants = {f"{k} x{a}": dp.DataParallelRun(kind=k, accumulation=a, bucket_mb=0.05)
                for k in dp.KINDS for a in (1, 2)}
    for r in launch.run(harness.sweep, 2, args=(s, variants), timeout_s=180):
        assert list(r.value) == list(variants)
        for name, out in r.value.items():
            assert out.name == name
            d = harness.max_differences(out.trace, ref)
            assert d["loss"] < 1e-5 and d["grad"] < 1e-6 and d["param"] < 1e-6, (name, d)  # exact
        # the first step's collectives, as CommDebugMode sees them: DDP all-reduces in backward
        assert r.value["ddp x1"].calls["forward_backward"].get("all_reduce", 0) >= 1
        assert not r.value["ddp x1"].calls["optimizer"]


def test_buckets_and_communication_counters(setup_and_ref):
    s, _ = setup_and_ref
    n_params = sum(p.numel() for p in harness.build_model(s).parameters())
    variants = {"small": dp.DataParallelRun(bucket_mb=0.05),
                "one": dp.DataParallelRun(bucket_mb=100),
                "accumulated": dp.DataParallelRun(bucket_mb=0.05, accumulation=4)}
    out = launch.run(harness.sweep, 2, args=(s, variants), timeout_s=180)[0].value
    small, one, accumulated = out["small"], out["one"], out["accumulated"]
    assert one["buckets"] == 1 and small["buckets"] > 3
    # Every step all-reduces every gradient exactly once, whatever the bucketing.
    assert small["allreduce_bytes"] == one["allreduce_bytes"] == s.steps * 4 * n_params
    assert small["allreduce_calls"] == s.steps * small["buckets"]
    # no_sync: four micro-batches per step, still one all-reduce per bucket.
    assert accumulated["allreduce_calls"] == small["allreduce_calls"]


def test_adamw_and_gpt2_flavour_match_within_fp32_tolerance():
    s = harness.Setup(flavour="gpt2", n_kv_heads=4, optimizer="adamw")
    ref = harness.reference(s)
    out = launch.run(harness.run, 2, args=(s, dp.DataParallelRun()), timeout_s=120)[0].value
    d = harness.max_differences(out.trace, ref)
    assert d["grad"] < 1e-6 and d["param"] < 1e-4, d  # Adam magnifies 1-ulp gradient differences


def test_errors():
    with pytest.raises(ValueError, match="needs a process group"):
        dp.DataParallel(harness.build_model(harness.Setup()))
    with pytest.raises(ValueError, match="optimizer must be sgd or adamw"):
        harness.Setup(optimizer="lion")
    with pytest.raises(ValueError, match="not divisible by 3 data-parallel ranks"):
        harness.shard(harness.global_batches(harness.Setup())[0], 0, 3)
    with pytest.raises(ValueError, match="kind must be 'scratch' or 'ddp'"):
        dp.DataParallelRun(kind="zero")
    with pytest.raises(ValueError, match="accumulation must be >= 1"):
        dp.DataParallelRun(accumulation=0)
    with pytest.raises(ValueError, match="runs inside a process group"):
        harness.run(harness.Setup(), dp.DataParallelRun())
    with pytest.raises(ValueError, match="variants must be a non-empty dict"):
        harness.sweep(harness.Setup(), [dp.DataParallelRun()])
    with pytest.raises(ValueError, match="give a Technique or a callable"):
        harness.sweep(harness.Setup(), {"x": 3})
    with pytest.raises(RuntimeError, match="do not split into 3 micro-batches"):
        launch.run(harness.run, 2, args=(harness.Setup(), dp.DataParallelRun(accumulation=3)),
                   timeout_s=60)


def test_per_rank_memory_matches_the_estimator():
    from trainbook.compute import memory

    s = harness.Setup(optimizer="adamw", d_model=128, n_layers=4, d_ff=256, global_batch=8,
                      seq_len=64)
    variants = {k: dp.DataParallelRun(kind=k, measure_memory=True) for k in dp.KINDS}
    per_rank = launch.run(harness.sweep, 2, args=(dataclasses.replace(s, steps=1), variants),
                          timeout_s=180)
    predicted = memory.estimate(memory.MemoryInputs(model=s.model_config(), dtype="fp32",
                                                    optimizer="adamw", dp=2, micro_batch=4,
                                                    seq_len=64, activations="reference")).peak
    grads = 4 * sum(p.numel() for p in harness.build_model(s).parameters())
    for r in per_rank:
        scratch, ddp = r.value["scratch"].memory, r.value["ddp"].memory
        assert abs(predicted / scratch["peak"] - 1) < 0.05
        assert abs((ddp["peak"] - scratch["peak"]) / grads - 1) < 0.05  # DDP's persistent buckets
