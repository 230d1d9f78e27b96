"""The teaching loop runs any layout (`mesh.ComposedRun`) and matches one process on 4 ranks."""

import dataclasses

import pytest

from trainbook import launch
from trainbook.compute import memory
from trainbook.layout import Layout
from trainbook.parallel import harness, mesh

LAYOUTS = {
    "fsdp_x_tp": Layout(dp=2, zero=3, tp=2),
    "hsdp": Layout(dp=4, zero=3, dp_replicate=2),
    "pp_x_fsdp": Layout(dp=2, zero=3, pp=2, pp_schedule="gpipe", micro_batch=2),
    "pp_x_tp": Layout(tp=2, pp=2, pp_schedule="1f1b", micro_batch=2),
}


def test_layouts_match_single_process_and_hsdp_memory_on_4_ranks():
    s = harness.Setup()
    ref = harness.reference(s)
    mem_setup = harness.Setup(d_model=128, n_layers=4, d_ff=352, seq_len=64, global_batch=8,
                              optimizer="adamw", steps=1)
    variants = {name: mesh.ComposedRun(layout=lay) for name, lay in LAYOUTS.items()}
    one_micro_batch = dataclasses.replace(LAYOUTS["hsdp"], micro_batch=2)  # MemTracker: 1 call
    variants["hsdp memory"] = mesh.ComposedRun(layout=one_micro_batch, setup=mem_setup,
                                               measure_memory=True)
    results = launch.run(harness.sweep, 4, args=(s, variants), timeout_s=300)
    cfg = mem_setup.model_config()
    est = {dp: memory.estimate(memory.MemoryInputs(model=cfg, dtype="fp32", optimizer="adamw",
                                                   dp=dp, zero=3, micro_batch=2, seq_len=64,
                                                   activations="reference"))
           for dp in (2, 4)}
    for r in results:
        measured = r.value.pop("hsdp memory").memory
        # HSDP shards model states over the "dp_shard" pair only: ZeRO-3 over 2 ranks, not 4
        assert measured["optimizer"] == pytest.approx(est[2].optimizer, rel=0.01)
        assert measured["peak"] == pytest.approx(est[2].peak, rel=0.15)
        assert measured["optimizer"] > 1.9 * est[4].optimizer  # not a quarter
        for name, out in r.value.items():
            d = harness.max_differences(out.trace, ref)
            assert d["loss"] < 1e-5 and d["grad"] < 1e-6 and d["param"] < 1e-6, (name, r.rank, d)
        # FSDP gathers in forward and reduce-scatters in backward; TP all-reduces (or SP
        # all-gathers/reduce-scatters) inside the step; pipelines send and receive
        assert r.value["hsdp"].calls["forward_backward"]["reduce_scatter"] >= 1
        assert r.value["pp_x_tp"].calls["forward_backward"].keys() & {"send", "recv"}


def test_errors():
    with pytest.raises(ValueError, match="layout must be a trainbook.layout.Layout"):
        mesh.ComposedRun(layout="dp=2")
    with pytest.raises(ValueError, match="use cp=1 and ep=1"):
        mesh.ComposedRun(layout=Layout(cp=2))
    with pytest.raises(ValueError, match="runs inside a process group"):
        harness.run(harness.Setup(), mesh.ComposedRun(layout=Layout()))
    with pytest.raises(RuntimeError, match="needs 4 ranks, got 2"):
        launch.run(harness.run, 2, args=(harness.Setup(), mesh.ComposedRun(layout=LAYOUTS["hsdp"])),
                   timeout_s=60)
    with pytest.raises(RuntimeError, match="3 layers do not split into 2 equal stages"):
        launch.run(harness.run, 2, timeout_s=60, args=(
            dataclasses.replace(harness.Setup(), n_layers=3),
            mesh.ComposedRun(layout=Layout(pp=2, micro_batch=2))))
