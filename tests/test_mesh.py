import pytest

from trainbook import configs, launch
from trainbook.compute import memory
from trainbook.parallel import harness, mesh


def test_three_2d_meshes_match_single_process_on_4_ranks():
    s = harness.Setup()
    ref = harness.reference(s)
    cfg = configs.get("tiny-llama").with_(vocab_size=256)
    mem = dict(cfg=cfg, micro_batch=2, seq_len=64)
    results = launch.run(mesh.sweep, 4, args=(s,), kwargs=dict(memory=mem), timeout_s=240)
    for r in results:
        measured = r.value.pop("hsdp_memory")
        assert set(r.value) == set(mesh.KINDS)
        # HSDP shards model states over the "shard" pair only: ZeRO-3 over 2 ranks, not 4
        est = {dp: memory.estimate(memory.MemoryInputs(model=cfg, dtype="fp32", optimizer="adamw",
                                                       dp=dp, zero=3, micro_batch=2, seq_len=64))
               for dp in (2, 4)}
        assert measured["optimizer"] == pytest.approx(est[2].optimizer, rel=0.01)
        assert measured["peak"] == pytest.approx(est[2].peak, rel=0.15)
        assert measured["optimizer"] > 1.9 * est[4].optimizer  # not a quarter
        for kind, trace in r.value.items():
            d = harness.max_differences(trace, ref)
            assert d["loss"] < 1e-5 and d["grad"] < 1e-6 and d["param"] < 1e-6, (kind, r.rank, d)


def test_errors():
    with pytest.raises(ValueError, match="need a process group"):
        mesh.run_hsdp(harness.Setup())
    with pytest.raises(ValueError, match="do not split into 3 equal stages"):
        mesh.split_model(harness.build_model(harness.Setup()), 3, 0)
    with pytest.raises(RuntimeError, match="the 2 x 2 meshes need 4 ranks, got 2"):
        launch.run(mesh.run, 2, args=(harness.Setup(), "hsdp"), timeout_s=60)
