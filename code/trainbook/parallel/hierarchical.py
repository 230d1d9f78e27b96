"""Hierarchical all-reduce from scratch, its alpha-beta cost, and the network facts around it.

A cluster has two networks: NVLink inside a node (or an NVL72 rack), hundreds of GB/s per GPU,
and the scale-out NICs between nodes, a few tens. The hierarchical all-reduce spends the slow
network only on what must cross it: (1) reduce-scatter inside each node, so local rank i holds
the node's partial sum of chunk i (S/g bytes for g GPUs per node); (2) all-reduce of that chunk
across the nodes, among the ranks with the same local index (one per node: a *rail*); (3)
all-gather inside each node. Every NIC carries an all-reduce of S/g bytes instead of S.

`hierarchical_all_reduce` runs it on torch.distributed subgroups built by `build_groups` from an
explicit `Grid` (nodes x gpus_per_node, node-major ranks, as torchrun numbers them). It is
checked against `dist.all_reduce` (`compare_with_native`). Note on gloo: torch 2.13's gloo
implements the tensor reduce-scatter as an all-reduce of a copy followed by taking this rank's
chunk (ProcessGroupGloo::reduce_scatter_tensor_coalesced), so on CPU the result is right but
the wire bytes are not those of a real reduce-scatter: time it on NCCL, not here.

`hierarchical_time` prices it with `collectives.collective_time` and the planner's links
(`step_cost.link`: the hardware table's NVLink bus bandwidth inside a domain, the NIC across),
against two rings over all N GPUs: `flat_ring_time`, topology-unaware (every step waits on a NIC
hop), and `node_aware_ring_time`, NCCL's pattern (one ring per NIC, NVLink hops inside a node).

Chapter: book/parallelism/networks.
"""

from __future__ import annotations

import mmap
import statistics
import time
from dataclasses import dataclass
from numbers import Integral, Real
from pathlib import Path

import torch
import torch.distributed as dist

from .. import compat
from ..launch import rank_device
from .collectives import collective_time
from .step_cost import Cluster, link

# Payload fraction of NCCL's three protocols (NCCL src/include/device.h): LL sends 8-byte lines
# of 4 data bytes + a 4-byte flag (ncclLLFifoLine); LL128 128-byte lines of which 8 bytes are
# the flag (NCCL_LL128_DATAELEMS = NCCL_LL128_LINEELEMS - 1); Simple sends raw data and
# synchronises with memory fences per chunk.
NCCL_PROTOCOL_PAYLOAD = {"LL": 4 / 8, "LL128": 120 / 128, "Simple": 1.0}

# PyTorch ProcessGroupNCCL / flight recorder variables the chapter tells operators to set.
TORCH_ENV_VARS = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT",
                  "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE",
                  "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_DUMP_TEMP_FILE",
                  "TORCH_NCCL_ENABLE_MONITORING", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC")

SCHEMES = ("flat", "hierarchical", "node_aware_ring")


def _whole(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
        raise ValueError(f"{name} must be a positive whole number, got {value!r}")
    return int(value)


def _positive_bytes(nbytes: object) -> float:
    if isinstance(nbytes, bool) or not isinstance(nbytes, Real) or not nbytes > 0:
        raise ValueError(f"nbytes must be a positive number of bytes, got {nbytes!r}")
    return float(nbytes)


@dataclass(frozen=True)
class Grid:
    """nodes x gpus_per_node ranks, node-major (rank = node * gpus_per_node + local): the shape
    the hierarchy follows, given explicitly so a test can play 2 nodes on one machine."""

    nodes: int
    gpus_per_node: int

    def __post_init__(self):
        _whole("nodes", self.nodes)
        _whole("gpus_per_node", self.gpus_per_node)

    @property
    def world(self) -> int:
        """Ranks in the grid."""
        return self.nodes * self.gpus_per_node

    def intra_groups(self) -> list[list[int]]:
        """The ranks of each node (NVLink neighbours), node by node."""
        g = self.gpus_per_node
        return [list(range(n * g, (n + 1) * g)) for n in range(self.nodes)]

    def rails(self) -> list[list[int]]:
        """Local rank i of every node: the ranks whose NICs share rail i's leaf switch."""
        g = self.gpus_per_node
        return [[n * g + i for n in range(self.nodes)] for i in range(g)]


@dataclass
class HierarchicalGroups:
    """This rank's two subgroups (its node, its rail) and the grid they came from."""

    grid: Grid
    intra: dist.ProcessGroup
    inter: dist.ProcessGroup


def _check_world(grid: Grid) -> None:
    if not isinstance(grid, Grid):
        raise ValueError(f"grid must be a Grid(nodes, gpus_per_node), got {grid!r}")
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("build_groups needs a process group: run under torchrun or "
                         "trainbook.launch.run")
    world = dist.get_world_size()
    if grid.world != world:
        raise ValueError(f"grid {grid.nodes} nodes x {grid.gpus_per_node} GPUs = {grid.world} "
                         f"ranks, but the process group has {world}; use a grid whose product "
                         f"is {world}")


def build_groups(grid: Grid) -> HierarchicalGroups:
    """Create every node group, then every rail group, on every rank in the same order (which
    `dist.new_group` requires), and keep the two this rank belongs to."""
    _check_world(grid)
    rank = dist.get_rank()
    mine = {}
    for kind, lists in (("intra", grid.intra_groups()), ("inter", grid.rails())):
        for ranks in lists:
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[kind] = group
    return HierarchicalGroups(grid, mine["intra"], mine["inter"])


def hierarchical_all_reduce(tensor: torch.Tensor, groups: HierarchicalGroups) -> torch.Tensor:
    """Sum over all ranks in three steps: reduce-scatter in the node, all-reduce of this rank's
    1/g chunk across the nodes (its rail), all-gather in the node. Returns a new tensor.

    A size that g does not divide is zero-padded to the next multiple of g (zeros add nothing
    to a sum) and the padding dropped at the end."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.numel() == 0:
        raise ValueError("tensor is empty: there is nothing to all-reduce")
    if not isinstance(groups, HierarchicalGroups):
        raise ValueError("groups must come from build_groups(grid)")
    g = groups.grid.gpus_per_node
    flat = tensor.detach().reshape(-1)
    chunk = -(-flat.numel() // g)  # ceil
    buf = torch.zeros(chunk * g, dtype=flat.dtype, device=flat.device)
    buf[:flat.numel()] = flat  # a contiguous copy: gloo is wrong on strided views
    part = buf  # one GPU per node: nothing to scatter, the rail all-reduce is everything
    if g > 1:
        part = torch.empty(chunk, dtype=buf.dtype, device=buf.device)
        # 1. the node's partial sum of chunk `local`
        compat.reduce_scatter_single(part, buf, group=groups.intra)
    if groups.grid.nodes > 1:
        dist.all_reduce(part, group=groups.inter)  # 2. across the nodes, S/g bytes
    if g > 1:
        # 3. every chunk back to every GPU of the node
        compat.all_gather_single(buf, part, group=groups.intra)
    return buf[:flat.numel()].view_as(tensor)


def compare_with_native(grids: list[tuple[int, int]], numels: list[int], seed: int = 0,
                        iters: int = 3) -> list[dict]:
    """On every rank: for each grid and size, max |hierarchical - dist.all_reduce| on random
    data, the same on integer-valued data (exact), this rank's node and rail as built, and
    median seconds per call of each (for show: gloo's times say nothing about NCCL's)."""
    if not grids or not numels:
        raise ValueError("give at least one grid (nodes, gpus_per_node) and one size")
    if not all(isinstance(g, (tuple, list)) and len(g) == 2 for g in grids):
        raise ValueError(f"each grid is a pair (nodes, gpus_per_node), got {grids!r}")
    for n in numels:
        _whole("numel", n)
    _whole("iters", iters)
    checked = [Grid(*g) for g in grids]
    for grid in checked:  # every grid fits the world before any group is made
        _check_world(grid)
    built = [build_groups(grid) for grid in checked]  # all groups first, same order everywhere
    rank, dev = dist.get_rank(), rank_device()
    gen = torch.Generator().manual_seed(seed + rank)
    rows = []
    for groups in built:
        for numel in numels:
            x = torch.randn(numel, generator=gen).to(dev)
            ints = torch.randint(-1000, 1000, (numel,), generator=gen).float().to(dev)
            out, seconds = {}, {}
            for name, fn in (("hierarchical", lambda t, gr=groups: hierarchical_all_reduce(t, gr)),
                             ("native", _native)):
                times = []
                for _ in range(iters):
                    t0 = time.perf_counter()
                    out[name] = fn(x)
                    if dev.type == "cuda":  # NCCL returns before the kernel ends
                        torch.cuda.synchronize(dev)
                    times.append(time.perf_counter() - t0)
                seconds[name] = statistics.median(times)
            exact = (hierarchical_all_reduce(ints, groups) - _native(ints)).abs().max().item()
            rows.append({"grid": f"{groups.grid.nodes}x{groups.grid.gpus_per_node}",
                         "numel": numel, "rank": rank,
                         "node": dist.get_process_group_ranks(groups.intra),
                         "rail": dist.get_process_group_ranks(groups.inter),
                         "max_abs_diff": (out["hierarchical"] - out["native"]).abs().max().item(),
                         "max_abs_diff_int": exact,
                         "hierarchical_s": seconds["hierarchical"],
                         "native_s": seconds["native"]})
    return rows


def _native(t: torch.Tensor) -> torch.Tensor:
    y = t.clone()
    dist.all_reduce(y)
    return y


def _domains(cluster: Cluster) -> tuple[int, int]:
    """(nodes, gpus per node) of a cluster: its NVLink domains, or one smaller group."""
    if not isinstance(cluster, Cluster):
        raise ValueError(f"cluster must be a step_cost.Cluster, got {cluster!r}")
    g = min(cluster.domain_gpus, cluster.gpus)
    if cluster.gpus % g:
        raise ValueError(f"{cluster.gpus} GPUs are not a whole number of {g}-GPU NVLink "
                         f"domains; use a multiple of {g}")
    return cluster.gpus // g, g


def hierarchical_time(nbytes: float, cluster: Cluster) -> dict[str, float]:
    """Seconds of each step and the total for an all-reduce of nbytes over the cluster:
    ring reduce-scatter over g GPUs on NVLink, ring all-reduce of nbytes / g over the nodes on
    the NIC, ring all-gather on NVLink. One node: the NVLink ring, exactly."""
    S = _positive_bytes(nbytes)
    nodes, g = _domains(cluster)
    a_in, bw_rs = link(1, g, cluster, "reduce_scatter")
    _, bw_ag = link(1, g, cluster, "all_gather")
    a_out, bw_net = link(g, nodes, cluster, "all_reduce")
    t = {"intra_reduce_scatter": collective_time("reduce_scatter", g, S, a_in, bw_rs * 1e9),
         "inter_all_reduce": collective_time("all_reduce", nodes, S / g, a_out, bw_net * 1e9),
         "intra_all_gather": collective_time("all_gather", g, S, a_in, bw_ag * 1e9)}
    return {**t, "total": sum(t.values()), "inter_bytes": S / g}


def flat_ring_time(nbytes: float, cluster: Cluster) -> float:
    """Seconds of one ring all-reduce over all GPUs, unaware of nodes: inside one NVLink domain
    at the ring bus bandwidth; across domains every one of its 2(N-1) steps waits on the NIC
    (bandwidth and latency alpha_net), the slowest link of the ring."""
    S = _positive_bytes(nbytes)
    _domains(cluster)
    alpha, gbps = link(1, cluster.gpus, cluster, "ring_all_reduce")
    return collective_time("all_reduce", cluster.gpus, S, alpha, gbps * 1e9)


def node_aware_ring_time(nbytes: float, cluster: Cluster) -> float:
    """Seconds of the all-reduce as g rings over all N GPUs, one per NIC, each visiting a
    node's GPUs over NVLink before leaving through its NIC (NCCL's ring pattern). Each GPU
    sends 2(N-1)/N x S in all: (g-1)/g of it over NVLink, 1/g through its NIC, both at once,
    so the slower of the two sets the bandwidth term. Latency as NCCL's own tuner counts it
    (src/graph/tuning.cc): 2(n-1) of the 2(N-1) steps cross the network (alpha_net), the rest
    are NVLink hops (alpha_domain). One node: the NVLink ring, exactly."""
    S = _positive_bytes(nbytes)
    nodes, g = _domains(cluster)
    if nodes == 1:
        return flat_ring_time(S, cluster)
    N = cluster.gpus
    a_in, nvlink = link(1, g, cluster, "ring_all_reduce")
    a_out, nic = link(1, N, cluster, "all_reduce")
    per_byte = max((g - 1) / g / (nvlink * 1e9), 1 / (g * nic * 1e9))
    latency = 2 * (N - nodes) * a_in + 2 * (nodes - 1) * a_out
    return latency + 2 * (N - 1) / N * S * per_byte


def nic_bytes_per_gpu(scheme: str, nbytes: float, nodes: int, gpus_per_node: int) -> float:
    """Bytes each GPU's NIC sends for one all-reduce of nbytes.

    flat: a ring where every hop crosses the network, 2(N-1)/N x S; hierarchical: the rail
    all-reduce of S/g, 2(n-1)/n x S/g; node_aware_ring: g node-major rings, one per NIC, each
    carrying S/g and leaving every node once, 2(N-1)/N x S/g (NCCL's inter-node ring pattern:
    NET -> GPU a -> ... -> GPU x -> NET, one channel per NIC)."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; use one of {', '.join(SCHEMES)}")
    S = _positive_bytes(nbytes)
    n, g = _whole("nodes", nodes), _whole("gpus_per_node", gpus_per_node)
    N = n * g
    if n == 1:
        return 0.0
    if scheme == "flat":
        return 2 * (N - 1) / N * S
    if scheme == "hierarchical":
        return 2 * (n - 1) / n * S / g
    return 2 * (N - 1) / N * S / g


def per_gpu_network_gbps(nic_gbps: float, oversubscription: float = 1.0,
                         cross_rail_fraction: float = 1.0) -> float:
    """What a GPU can push when every GPU sends at once and `cross_rail_fraction` of the traffic
    leaves its rail's leaf switch through uplinks tapered `oversubscription`:1 (2.0 = half as
    much uplink as downlink): min(NIC, NIC / (fraction x taper)). Rail-local traffic (what PXN
    arranges) never touches the uplinks."""
    if isinstance(nic_gbps, bool) or not isinstance(nic_gbps, Real) or not nic_gbps > 0:
        raise ValueError(f"nic_gbps must be a positive bandwidth in GB/s, got {nic_gbps!r}")
    if not isinstance(oversubscription, Real) or not oversubscription >= 1:
        raise ValueError(f"oversubscription must be >= 1 (1 = non-blocking, 2 = 2:1 taper), "
                         f"got {oversubscription!r}")
    if not isinstance(cross_rail_fraction, Real) or not 0 <= cross_rail_fraction <= 1:
        raise ValueError(f"cross_rail_fraction must be in [0, 1], got {cross_rail_fraction!r}")
    demand = cross_rail_fraction * oversubscription
    return float(nic_gbps) if demand <= 1 else nic_gbps / demand


def missing_from_torch(names: tuple[str, ...] = TORCH_ENV_VARS) -> list[str]:
    """The names, of those given, that the installed torch does not mention in its Python
    sources, its c10d headers or its libraries: a renamed environment variable shows up here
    before a job silently ignores it."""
    if isinstance(names, str) or not names or not all(
            isinstance(n, str) and n.strip() for n in names):
        raise ValueError("names must be a non-empty tuple of environment variable names")
    root = Path(torch.__file__).parent
    left = set(names)
    texts = [*sorted((root / "distributed").rglob("*.py")),
             *sorted((root / "include" / "torch" / "csrc" / "distributed").rglob("*.hpp"))]
    for path in texts:
        text = path.read_text(errors="ignore")
        left -= {n for n in left if n in text}
        if not left:
            return []
    for lib in sorted((root / "lib").glob("*.so*")):  # names read only in C++ sources
        if lib.stat().st_size == 0:
            continue
        with open(lib, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            left -= {n for n in left if m.find(n.encode()) != -1}
        if not left:
            return []
    return [n for n in names if n in left]
