"""Activation checkpointing policies on the reference model (trainbook.train.recompute): the
gradients of every policy equal those without recomputation, the memory and FLOP orderings the
chapter states hold, the recomputed FLOPs match the count from compute.flops exactly, and bad
input fails before any work."""

import pytest

from trainbook import configs
from trainbook.train import recompute as R

CFG = configs.get("tiny-llama")
B, S = 4, 64  # at 4 x 32 the model states set the peak for every policy


@pytest.fixture(scope="module")
def rows():
    return {r["policy"]: r for r in R.compare_policies(CFG, B, S)}  # raises if grads differ


def test_gradients_equal_none(rows):
    assert set(rows) == {"none", "full", "every-2", "selective", "offload"}
    for r in rows.values():
        assert r["max_grad_diff"] <= R.GRAD_ATOL


def test_memory_ordering(rows):
    peak = {p: r["peak"] for p, r in rows.items()}
    assert peak["full"] < peak["every-2"] < peak["none"]
    assert peak["selective"] < peak["none"]
    assert peak["offload"] == peak["none"]  # on CPU save_on_cpu moves nothing


def test_flop_ordering_and_prediction(rows):
    extra = {p: r["extra_flops"] for p, r in rows.items()}
    assert extra["none"] == extra["offload"] == 0
    assert 0 < extra["selective"] < extra["every-2"] < extra["full"]
    assert extra["every-2"] * 2 == extra["full"]  # 2 of 4 blocks
    for r in rows.values():
        assert r["extra_flops"] == r["predicted_extra"]


def test_checkpointed_blocks():
    assert R.checkpointed_blocks(5, "every-k", 2) == [0, 2, 4]
    assert R.checkpointed_blocks(4, "every-k", 1) == [0, 1, 2, 3]
    assert R.checkpointed_blocks(4, "none") == []


def test_offload_bytes_and_threshold():
    b = R.offload_bytes(CFG, B, S)
    assert b["weights"] > 0 and b["activations"] > 0
    assert b["total"] == b["weights"] + b["activations"]
    t = R.offload_threshold()
    assert R.PCIE5_X16_GBPS == 64 and t["threshold_gbps"] > R.PCIE5_X16_GBPS
    assert R.offload_threshold(mfu=0.5)["threshold_gbps"] == pytest.approx(
        t["threshold_gbps"] / 2)


@pytest.mark.parametrize("call, match", [
    (lambda: R.check_policy("sometimes"), "unknown; use one of"),
    (lambda: R.check_policy("every-k", 0), "k must be"),
    (lambda: R.check_policy("every-k", 1.5), "k must be"),
    (lambda: R.check_policy("every-k", True), "k must be"),
    (lambda: R.compare_policies(CFG, B, S, policies=("none", "bogus")), "unknown"),
    (lambda: R.measure_policy(CFG, "full", B, 10**6), "max_seq_len"),
    (lambda: R.offload_threshold(mfu=0), "mfu"),
    (lambda: R.predicted_extra_flops(configs.get("tiny-mixtral"), 1, 8, "full"), "dense"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()
