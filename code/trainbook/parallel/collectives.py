"""The collectives from scratch, out of point-to-point messages: ring and tree all-reduce.

These exist to teach what NCCL and gloo do inside `dist.all_reduce`, and are checked against it.
The ring sends 2(n-1) messages of S/n bytes per rank (a reduce-scatter, then an all-gather): its
bandwidth term does not grow with n, its latency term does. The binomial tree sends log2(n)
messages of the full S up and log2(n) down: few hops, but every hop carries everything.
Run them inside a process group (torchrun, or `trainbook.launch.run`).

Chapter: book/parallelism/collectives.
"""

from __future__ import annotations

import math
from numbers import Integral

import torch
import torch.distributed as dist

from .. import compat
from ..bench.collectives import bus_factor


def _exchange(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int) -> None:
    """Send to dst and receive from src at once (isend/irecv: no rank waits on a blocked peer)."""
    reqs = [dist.isend(send.contiguous(), dst), dist.irecv(recv, src)]
    for r in reqs:
        r.wait()


def ring_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over ranks with a ring: n-1 reduce-scatter steps, then n-1 all-gather steps."""
    n, rank = dist.get_world_size(), dist.get_rank()
    if tensor.numel() % n:
        raise ValueError(f"ring all-reduce splits the tensor into {n} chunks: {tensor.numel()} "
                         f"elements are not divisible by {n}; pad it")
    chunks = list(tensor.detach().clone().flatten().chunk(n))
    right, left = (rank + 1) % n, (rank - 1) % n
    incoming = torch.empty_like(chunks[0])
    for step in range(n - 1):  # reduce-scatter: after it, rank r owns the sum of chunk (r+1) % n
        send_i, recv_i = (rank - step) % n, (rank - step - 1) % n
        _exchange(chunks[send_i], right, incoming, left)
        chunks[recv_i] = chunks[recv_i] + incoming
    for step in range(n - 1):  # all-gather: pass the finished chunks around the ring
        send_i, recv_i = (rank + 1 - step) % n, (rank - step) % n
        _exchange(chunks[send_i], right, incoming, left)
        chunks[recv_i] = incoming.clone()
    return torch.cat(chunks).view_as(tensor)


def tree_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over ranks with a binomial tree: reduce to rank 0 in log2(n) rounds, then broadcast
    back."""
    n, rank = dist.get_world_size(), dist.get_rank()
    out = tensor.detach().clone().contiguous()
    buf = torch.empty_like(out)
    rounds = math.ceil(math.log2(n)) if n > 1 else 0
    for k in range(rounds):  # reduce: in round k, ranks that are odd multiples of 2^k send down
        bit = 1 << k
        if rank % (2 * bit) == bit:
            dist.send(out, rank - bit)
        elif rank % (2 * bit) == 0 and rank + bit < n:
            dist.recv(buf, rank + bit)
            out += buf
    for k in reversed(range(rounds)):  # broadcast: the same tree, edges reversed
        bit = 1 << k
        if rank % (2 * bit) == 0 and rank + bit < n:
            dist.send(out, rank + bit)
        elif rank % (2 * bit) == bit:
            dist.recv(out, rank - bit)
    return out


# Ring steps of each collective on n ranks: the latency term of `collective_time`.
# all-reduce = reduce-scatter (n - 1 steps) + all-gather (n - 1 steps); all-gather and
# reduce-scatter pass n - 1 chunks of S/n around the ring; all-to-all is n - 1 pairwise
# exchanges of S/n; broadcast is a pipelined chain, n - 1 hops deep (the pipeline's chunks add
# steps that the model leaves out).
RING_STEPS = {"all_reduce": lambda n: 2 * (n - 1), "all_gather": lambda n: n - 1,
              "reduce_scatter": lambda n: n - 1, "all_to_all": lambda n: n - 1,
              "broadcast": lambda n: n - 1}


def _check_model(n, bandwidth_Bps) -> None:
    if isinstance(n, bool) or not isinstance(n, Integral) or n < 1:
        raise ValueError(f"the rank count n must be a whole number >= 1, got {n!r}")
    if not bandwidth_Bps > 0:
        raise ValueError(f"bandwidth must be positive (bytes/s), got {bandwidth_Bps!r}")


def collective_time(op: str, n: int, nbytes: float, alpha_s: float, bandwidth_Bps: float) -> float:
    """alpha-beta time of one ring collective on n ranks: steps x alpha + bus factor x S / B.

    S = nbytes is the full buffer in the nccl-tests convention (`bench.collectives`: the
    all-gather's output, the reduce-scatter's input); `bench.collectives.bus_factor` is the
    fraction of S each rank sends, B the per-rank link bandwidth in bytes/s, alpha the latency of
    one ring step; steps per op are in `RING_STEPS`. One rank moves nothing: 0 s.
    """
    _check_model(n, bandwidth_Bps)
    factor = bus_factor(op, n)  # validates op
    if n == 1:
        return 0.0
    return RING_STEPS[op](n) * alpha_s + factor * nbytes / bandwidth_Bps


def ring_time(n: int, nbytes: float, alpha_s: float, bandwidth_Bps: float) -> float:
    """alpha-beta model of the ring all-reduce: 2(n-1) steps, each alpha plus (S/n)/B."""
    return collective_time("all_reduce", n, nbytes, alpha_s, bandwidth_Bps)


def tree_time(n: int, nbytes: float, alpha_s: float, bandwidth_Bps: float) -> float:
    """alpha-beta model of the binomial tree (no pipelining): 2*ceil(log2 n) steps of the full S."""
    _check_model(n, bandwidth_Bps)
    return 2 * math.ceil(math.log2(n)) * (alpha_s + nbytes / bandwidth_Bps)


def what_each_collective_does() -> dict[str, tuple[list, list]]:
    """Run each collective on tiny integer tensors: {op: (this rank's input, its output)}.

    Rank r starts with [10r, 10r + 1, ..., 10r + n - 1], so every output shows where its numbers
    came from.
    """
    n, r = dist.get_world_size(), dist.get_rank()
    x = torch.arange(n, dtype=torch.float32) + 10 * r
    shown = {}
    y = x.clone()
    dist.all_reduce(y)
    shown["all_reduce"] = (x.tolist(), y.tolist())
    y = x.clone()
    dist.broadcast(y, src=0)
    shown["broadcast (from rank 0)"] = (x.tolist(), y.tolist())
    mine = x[:1].clone()
    gathered = torch.empty(n)
    compat.all_gather_single(gathered, mine)
    shown["all_gather"] = (mine.tolist(), gathered.tolist())
    part = torch.empty(1)
    compat.reduce_scatter_single(part, x.clone())
    shown["reduce_scatter"] = (x.tolist(), part.tolist())
    y = torch.empty(n)
    dist.all_to_all_single(y, x.clone())
    shown["all_to_all"] = (x.tolist(), y.tolist())
    return shown


def scratch_vs_native(numel: int = 1 << 12, seed: int = 0) -> dict[str, float]:
    """Max |difference| of the from-scratch all-reduces against dist.all_reduce on random data."""
    g = torch.Generator().manual_seed(seed + dist.get_rank())
    x = torch.randn(numel, generator=g)
    native = x.clone()
    dist.all_reduce(native)
    return {"ring": (ring_all_reduce(x) - native).abs().max().item(),
            "tree": (tree_all_reduce(x) - native).abs().max().item()}


def strided_all_reduce(contiguous: bool) -> float:
    """The gloo pitfall: all_reduce of a strided view (x[:, ::2]). Returns the max error."""
    n, r = dist.get_world_size(), dist.get_rank()
    base = torch.arange(12, dtype=torch.float32).view(3, 4)
    view = (base + 100 * r)[:, ::2]
    expected = sum((base + 100 * k)[:, ::2] for k in range(n))
    if contiguous:
        view = view.contiguous()
    dist.all_reduce(view)
    return (view - expected).abs().max().item()
