"""FSDP2 in practice (trainbook.parallel.fsdp_practice): accumulation without a sync per
micro-batch, resharding and prefetch, meta-device init, CPU offload traffic, HSDP cost.

One two-rank launch (gloo) runs every measurement; the rest are cost models."""

import pytest

from trainbook import configs, launch
from trainbook.layout import Layout
from trainbook.parallel import fsdp_practice as F
from trainbook.parallel import step_cost

CFG = configs.get("tiny-llama")
BIG = CFG.with_(d_model=256, n_layers=4)
M = 3


@pytest.fixture(scope="module")
def ranks():
    return [r.value for r in launch.run(F.practice_rank, nprocs=2, args=(CFG, M),
                                        kwargs={"big": BIG}, timeout_s=120)]


def test_accumulation_without_sync_same_parameters_one_reduce_scatter_per_unit(ranks):
    for r in ranks:
        assert r["accumulation_param_diff"] < 1e-6
        assert r["sync_each"]["reduce_scatter"] == M * r["units"]
        assert r["sync_last"]["reduce_scatter"] == r["units"]
        # skipping the sync keeps every unit's unsharded gradient until the last backward:
        # as the last micro-batch's forward reaches the third block, all of them are live
        assert r["sync_last"]["at_block"]["grads"] == r["param_bytes"]
        # a sync per micro-batch holds the reduced shards only: 1/N_d of them
        shards = r["sync_each"]["at_block"]["grads"]
        assert shards == pytest.approx(r["param_bytes"] / len(ranks), rel=1e-3)
        assert 0 < r["sync_last"]["grads"] <= r["param_bytes"]  # where the peak falls varies
        assert r["sync_last"]["peak"] > r["sync_each"]["peak"]


def test_no_reshard_gathers_less_and_holds_more(ranks):
    for r in ranks:
        units = r["units"]
        assert r["reshard"]["all_gather"] == 2 * (units - 1) + 1  # root stays gathered
        assert r["no_reshard"]["all_gather"] == units
        assert r["no_reshard"]["peak"] > r["reshard"]["peak"]


def _held(r: dict, name: str) -> float:
    """Blocks held beyond resharding's as the third block's forward starts."""
    extra = r[name]["at_block"]["total"] - r["reshard"]["at_block"]["total"]
    return extra / r["block_bytes"]


def test_prefetch_same_gathers_one_more_block_held(ranks):
    for r in ranks:
        assert r["prefetch_1"]["all_gather"] == r["prefetch_2"]["all_gather"] \
            == r["reshard"]["all_gather"]
        # the peak's position depends on when asynchronous gathers complete (CI measured -0.3
        # to 1.3 blocks); the bytes live as a block starts do not
        assert _held(r, "prefetch_1") == pytest.approx(1, abs=0.01)
        assert _held(r, "prefetch_2") == pytest.approx(2, abs=0.01)
        assert _held(r, "no_reshard") == pytest.approx(2, abs=0.01)  # blocks 0 and 1 kept


def test_meta_init_matches_and_saves_host_memory(ranks):
    for r in ranks:
        assert r["meta_exact_diff"] == 0.0 and r["meta_rope_ok"]
        assert r["meta_naive_diff"] > 1e-2 and r["meta_naive_halves_equal"]
        assert r["meta_build_peak"] < 0.7 * r["whole_build_peak"]
        assert r["whole_build_peak"] >= r["big_param_bytes"]


def test_hsdp_beats_fsdp_across_nodes_and_matches_planner():
    out = F.hsdp_comm("llama-3-8b", gpus=64, shard_size=8)
    assert out["hsdp"]["total"] < 0.5 * out["fsdp"]["total"]
    assert out["states_gib"]["hsdp"] == pytest.approx(8 * out["states_gib"]["fsdp"])
    job = step_cost.Job(configs.get("llama-3-8b"), 64 * 8192, 8192)
    planner = step_cost.step_time(Layout(dp=64, zero=3), job, step_cost.Cluster(gpus=64))
    assert out["fsdp"]["total"] == pytest.approx(planner["dp_total"], rel=1e-12)


def test_offload_traffic():
    out = F.offload_traffic("llama-3-8b", gpus=8)
    assert F.PCIE5_X16_GBPS == 64
    assert out["h2d_bytes"] == pytest.approx(2 * 4 * out["params"] / 8)
    assert out["d2h_bytes"] == pytest.approx(4 * out["params"] / 8)
    assert out["h2d_s"] + out["d2h_s"] < out["compute_s"]


@pytest.mark.parametrize("call, match", [
    (lambda: F.practice_rank(CFG, micro_batches=1), "micro_batches must be >= 2"),
    (lambda: F.practice_rank(CFG, seq_len=10**6), "exceeds the model's max_seq_len"),
    (lambda: F.practice_rank(CFG), "inside a process group"),
    (lambda: F.shard(None, None, prefetch=-1), "prefetch must be"),
    (lambda: F.hsdp_comm(gpus=64, shard_size=3), "positive divisor"),
    (lambda: F.offload_traffic(gpus=0), "gpus must be"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()
