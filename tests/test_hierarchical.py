"""The hierarchical all-reduce against dist.all_reduce on gloo, its cost model, its error messages,
and the PyTorch environment variables the networks chapter tells operators to set."""

import json
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from trainbook import launch
from trainbook.parallel import hierarchical as h
from trainbook.parallel.step_cost import Cluster

ROOT = Path(__file__).resolve().parents[1]
GRIDS = [(2, 2), (4, 1), (1, 4)]
ODD = [1, 3, 7, 1001]  # none of 7 and 1001 divisible by 2 or 4: the padding path
TOL = 1e-5  # fp32 sums of 4 standard normals in a different order: a few ulps of ~2


@pytest.fixture(scope="module")
def rows():
    """One 4-rank gloo job for every grid and size (one start-up instead of twelve)."""
    res = launch.run(h.compare_with_native, nprocs=4, timeout_s=120,
                     kwargs=dict(grids=GRIDS, numels=ODD, iters=1))
    return [row for r in res for row in r.value]


def test_matches_native_all_reduce_on_every_grid_and_odd_size(rows):
    assert len(rows) == 4 * len(GRIDS) * len(ODD)
    assert max(r["max_abs_diff"] for r in rows) < TOL
    assert max(r["max_abs_diff_int"] for r in rows) == 0  # integer-valued floats: exact


def test_groups_follow_the_grid(rows):
    for r in rows:
        nodes, g = map(int, r["grid"].split("x"))
        grid = h.Grid(nodes, g)
        assert r["node"] == grid.intra_groups()[r["rank"] // g]
        assert r["rail"] == grid.rails()[r["rank"] % g]


def test_grid_lists_nodes_and_rails():
    grid = h.Grid(2, 4)
    assert grid.world == 8
    assert grid.intra_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert grid.rails() == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize("nodes, g, what", [(0, 2, "nodes"), (2, -1, "gpus_per_node"),
                                            (2.5, 2, "nodes"), (True, 2, "nodes")])
def test_grid_rejects_non_positive_or_fractional_sizes(nodes, g, what):
    with pytest.raises(ValueError, match=f"{what} must be a positive whole number"):
        h.Grid(nodes, g)


def test_build_groups_needs_a_matching_process_group():
    with pytest.raises(ValueError, match="needs a process group"):
        h.build_groups(h.Grid(1, 1))
    with pytest.raises(ValueError, match="must be a Grid"):
        h.build_groups((2, 2))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="2 nodes x 2 GPUs = 4 ranks, but the process "
                                             "group has 1; use a grid whose product is 1"):
            h.build_groups(h.Grid(2, 2))
        groups = h.build_groups(h.Grid(1, 1))
        x = torch.arange(6.0).view(2, 3)
        assert torch.equal(h.hierarchical_all_reduce(x, groups), x)
        with pytest.raises(ValueError, match="tensor is empty"):
            h.hierarchical_all_reduce(torch.empty(0), groups)
        with pytest.raises(ValueError, match="must be a torch.Tensor"):
            h.hierarchical_all_reduce([1.0, 2.0], groups)
        with pytest.raises(ValueError, match="must come from build_groups"):
            h.hierarchical_all_reduce(x, None)
    finally:
        dist.destroy_process_group()


def test_compare_with_native_rejects_bad_arguments():
    with pytest.raises(ValueError, match="at least one grid"):
        h.compare_with_native([], [4])
    with pytest.raises(ValueError, match="numel must be a positive whole number"):
        h.compare_with_native([(1, 1)], [0])
    with pytest.raises(ValueError, match=r"each grid is a pair \(nodes, gpus_per_node\)"):
        h.compare_with_native([(2, 2, 1)], [4])
    with pytest.raises(ValueError, match="needs a process group"):
        h.compare_with_native([(1, 1)], [4])  # checked before any group is made


def h100(nodes: int) -> Cluster:
    return Cluster(gpu="h100-sxm", gpus=8 * nodes)


@pytest.mark.parametrize("nbytes", [1.0, 1e6, 1e9])
def test_one_node_hierarchy_is_the_nvlink_ring(nbytes):
    c = h100(1)
    t = h.hierarchical_time(nbytes, c)
    assert t["inter_all_reduce"] == 0
    assert t["total"] == pytest.approx(h.flat_ring_time(nbytes, c), rel=1e-12)
    assert h.node_aware_ring_time(nbytes, c) == h.flat_ring_time(nbytes, c)


@settings(max_examples=40, deadline=None)
@given(nbytes=st.floats(1e3, 1e10), nodes=st.integers(2, 256))
def test_hierarchy_beats_the_topology_unaware_ring_and_scales_linearly(nbytes, nodes):
    c = h100(nodes)
    t = h.hierarchical_time(nbytes, c)
    assert t["inter_bytes"] == pytest.approx(nbytes / 8)  # the rail all-reduce moves S/g
    assert t["total"] < h.flat_ring_time(nbytes, c)
    assert h.hierarchical_time(2 * nbytes, c)["total"] > t["total"]  # monotonic in size
    assert h.node_aware_ring_time(2 * nbytes, c) > h.node_aware_ring_time(nbytes, c)
    hier = h.nic_bytes_per_gpu("hierarchical", nbytes, nodes, 8)
    assert hier <= h.nic_bytes_per_gpu("flat", nbytes, nodes, 8) / 8
    assert hier <= h.nic_bytes_per_gpu("node_aware_ring", nbytes, nodes, 8)


def test_node_aware_ring_wins_large_messages_and_loses_small_ones_at_scale():
    assert h.node_aware_ring_time(1e9, h100(2)) < h.hierarchical_time(1e9, h100(2))["total"]
    assert h.node_aware_ring_time(1e6, h100(128)) > h.hierarchical_time(1e6, h100(128))["total"]


@pytest.mark.parametrize("call, match", [
    (lambda: h.hierarchical_time(0, h100(2)), "nbytes must be a positive number"),
    (lambda: h.hierarchical_time(-5, h100(2)), "nbytes must be a positive number"),
    (lambda: h.flat_ring_time(float("nan"), h100(2)), "nbytes must be a positive number"),
    (lambda: h.hierarchical_time(1e6, "h100"), "cluster must be a step_cost.Cluster"),
    (lambda: h.hierarchical_time(1e6, Cluster(gpu="h100-sxm", gpus=12)),
     "12 GPUs are not a whole number of 8-GPU NVLink domains; use a multiple of 8"),
    (lambda: h.node_aware_ring_time(1e6, Cluster(gpu="h100-sxm", gpus=20)), "multiple of 8"),
    (lambda: h.nic_bytes_per_gpu("tree", 1e6, 2, 8), "unknown scheme 'tree'"),
    (lambda: h.nic_bytes_per_gpu("flat", 1e6, 0, 8), "nodes must be a positive whole number"),
    (lambda: h.per_gpu_network_gbps(0), "nic_gbps must be a positive bandwidth"),
    (lambda: h.per_gpu_network_gbps(50, 0.5), "oversubscription must be >= 1"),
    (lambda: h.per_gpu_network_gbps(50, 2, 1.5), r"cross_rail_fraction must be in \[0, 1\]"),
    (lambda: h.missing_from_torch(()), "non-empty tuple"),
    (lambda: h.missing_from_torch("TORCH_X"), "non-empty tuple"),
])
def test_bad_input_is_refused_with_a_clear_message(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_oversubscription_halves_cross_rail_traffic_only():
    assert h.per_gpu_network_gbps(50, 2.0, 1.0) == 25
    assert h.per_gpu_network_gbps(50, 2.0, 0.0) == 50  # rail-local: never touches the spine
    assert h.per_gpu_network_gbps(50, 1.0, 1.0) == 50  # non-blocking


def test_protocol_payload_fractions_follow_nccls_line_formats():
    assert h.NCCL_PROTOCOL_PAYLOAD == {"LL": 0.5, "LL128": 0.9375, "Simple": 1.0}


def test_torch_environment_variables_exist_in_the_installed_torch():
    """A rename in PyTorch fails here, not silently in someone's job script."""
    names = set(h.TORCH_ENV_VARS)
    nb = json.loads((ROOT / "book" / "parallelism" / "networks.ipynb").read_text())
    prose = "".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    names |= set(re.findall(r"\bTORCH_(?:NCCL|FR)_[A-Z_]+[A-Z]\b", prose))
    assert h.missing_from_torch(tuple(sorted(names))) == []
    assert h.missing_from_torch(("TORCH_NCCL_NO_SUCH_VARIABLE_X",)) == [
        "TORCH_NCCL_NO_SUCH_VARIABLE_X"]
