"""Collective-communication benchmark: time, algbw and busbw per operation and payload.

Conventions follow nccl-tests (its doc/PERFORMANCE.md). The payload S is the size of the
full buffer: the input and output of all_reduce and broadcast, the *output* of all_gather (each
rank contributes S/n), the *input* of reduce_scatter (each rank keeps S/n), and each rank's send
buffer of all_to_all. algbw = S / t. busbw = algbw x a factor that makes the number comparable to
the link bandwidth whatever the rank count n: 2(n-1)/n for all_reduce, (n-1)/n for all_gather,
reduce_scatter and all_to_all, 1 for broadcast.

    torchrun --nproc_per_node 8 -m trainbook collectives --payload-range 1KiB 1GiB
    srun torchrun ... -m trainbook collectives --ops all_reduce --json-out out.json

gloo on CPU, nccl on GPU. Every rank runs `benchmark()`; the command (`trainbook collectives`)
prints and writes rank 0's results.

Chapter: book/parallelism/collectives.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from numbers import Integral

import torch
import torch.distributed as dist

from .. import compat
from ..launch import rank_device

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*")


def parse_size(text: str) -> int:
    """'64MiB' -> 67108864 bytes. Units: B; KB, MB, GB decimal (10^3, 10^6, 10^9, as
    `compute.cost.parse_count` reads K, M, G); KiB, MiB, GiB binary. A bare K, M or G is
    ambiguous and refused; '1e6' and '4096' are plain bytes."""
    hint = "write e.g. 4096, 1KiB, 64MiB, 1GiB or 1GB (decimal)"
    m = _SIZE.fullmatch(str(text))
    if not m:
        raise ValueError(f"cannot read size {text!r}; {hint}")
    unit = m.group(2).upper()
    if unit in ("K", "M", "G"):
        raise ValueError(f"size {text!r}: a bare {m.group(2)} is ambiguous; write "
                         f"{m.group(1)}{unit}B (10^{'369'['KMG'.index(unit)]}) or "
                         f"{m.group(1)}{unit}iB (2^{(1 + 'KMG'.index(unit)) * 10})")
    if unit not in _UNITS:
        raise ValueError(f"cannot read size {text!r}: unknown unit {m.group(2)!r}; {hint}")
    value = float(m.group(1)) * _UNITS[unit]
    if value < 1 or value != int(value):
        raise ValueError(f"size {text!r} must be a whole number of bytes >= 1")
    return int(value)


def payload_sizes(lo: int, hi: int, factor: int = 2) -> list[int]:
    """lo, lo*factor, ... up to hi (inclusive)."""
    if not 1 <= lo <= hi:
        raise ValueError(f"payload range needs 1 <= start <= stop, got {lo} and {hi}")
    if factor < 2:
        raise ValueError(f"the step factor must be >= 2, got {factor}")
    sizes = [lo]
    while sizes[-1] * factor <= hi:
        sizes.append(sizes[-1] * factor)
    return sizes


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw for `op` on n ranks (nccl-tests): the fraction of S each rank must move.

    The book's one source of "bytes each rank sends per byte of payload": the alpha-beta model
    (`parallel.collectives.collective_time`), the planner and the wire-byte counts use it."""
    if isinstance(n, bool) or not isinstance(n, Integral) or n < 1:
        raise ValueError(f"the rank count n must be a whole number >= 1, got {n!r}")
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op == "broadcast":
        return 1.0
    raise ValueError(f"unknown collective {op!r}; known: {', '.join(OPS)}")


def _buffers(op: str, nbytes: int, n: int, dtype: torch.dtype, device) -> tuple:
    """Input and output tensors of `op` for a payload of nbytes (rounded to a multiple of n
    elements)."""
    elem = torch.tensor([], dtype=dtype).element_size()
    numel = max(n, nbytes // elem // n * n)
    full = torch.ones(numel, dtype=dtype, device=device)
    part = torch.ones(numel // n, dtype=dtype, device=device)
    if op == "all_gather":
        return part, full
    if op == "reduce_scatter":
        return full, part
    if op == "all_to_all":
        return full, torch.empty_like(full)
    return full, full


def _run(op: str, inp, out):
    if op == "all_reduce":
        dist.all_reduce(inp)
    elif op == "all_gather":
        compat.all_gather_single(out, inp)
    elif op == "reduce_scatter":
        compat.reduce_scatter_single(out, inp)
    elif op == "broadcast":
        dist.broadcast(inp, src=0)
    else:
        dist.all_to_all_single(out, inp)


def time_op(op: str, nbytes: int, iters: int = 10, warmup: int = 2,
            dtype: torch.dtype = torch.float32, rounds: int = 3) -> float:
    """Seconds per call of `op` on nbytes: the average over `iters` calls, on the slowest rank
    (a collective ends when its last rank does), in the best of `rounds` rounds (a round that
    another process interrupted is not the network's speed)."""
    n, device = dist.get_world_size(), rank_device()
    inp, out = _buffers(op, nbytes, n, dtype, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        _run(op, inp, out)
    sync()
    best = float("inf")
    for _ in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            _run(op, inp, out)
        sync()
        elapsed = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        best = min(best, elapsed.item())
    return best


def check_benchmark(ops: Sequence[str], iters: int, warmup: int) -> None:
    """Reject what `benchmark` cannot run, before any process joins a group."""
    for op in ops:
        bus_factor(op, 2)  # validates the name
    if iters < 1 or warmup < 0:
        raise ValueError(f"need iters >= 1 and warmup >= 0, got {iters} and {warmup}")


def benchmark(ops: Sequence[str] = OPS, sizes: Sequence[int] = (2**10, 2**16, 2**20),
              iters: int = 10, warmup: int = 2, dtype: torch.dtype = torch.float32) -> list[dict]:
    """One row per (op, payload): time, algbw and busbw. Call on every rank of a process group."""
    if not dist.is_initialized():
        raise ValueError("benchmark() runs inside a process group: use torchrun, or "
                         "trainbook.launch.run(benchmark, nprocs=N)")
    check_benchmark(ops, iters, warmup)
    n, rows = dist.get_world_size(), []
    elem = torch.tensor([], dtype=dtype).element_size()
    for op in ops:
        for size in sizes:
            numel = max(n, size // elem // n * n)
            t = time_op(op, size, iters, warmup, dtype)
            nbytes = numel * elem
            rows.append({"op": op, "bytes": nbytes, "ranks": n, "time_s": t,
                         "algbw_GBps": nbytes / t / 1e9,
                         "busbw_GBps": nbytes / t / 1e9 * bus_factor(op, n)})
    return rows


def fit_alpha_beta(nbytes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """Least-squares fit of t = alpha + S / B in relative error: (alpha in s, B in bytes/s).

    Relative error weights small and large payloads alike; a plain fit would be decided by the
    largest payloads alone and miss the latency term.
    """
    import numpy as np

    s, t = np.asarray(nbytes, dtype=float), np.asarray(seconds, dtype=float)
    if len(s) < 2 or len(set(s.tolist())) < 2:
        raise ValueError("need at least two different payload sizes to fit alpha and beta")
    A = np.stack([np.ones_like(s), s], axis=1) / t[:, None]
    (alpha, inv_bw), *_ = np.linalg.lstsq(A, np.ones_like(t), rcond=None)
    alpha, inv_bw = max(alpha, 0.0), max(inv_bw, 1e-30)
    return float(alpha), float(1 / inv_bw)


def fit_ops(rows: list[dict]) -> dict[str, dict]:
    """The alpha-beta fit of each op in `benchmark` rows that has two payload sizes or more:
    latency in us, bandwidth in GB/s, and that bandwidth times the bus factor (busbw)."""
    fits = {}
    for op in dict.fromkeys(r["op"] for r in rows):
        mine = [r for r in rows if r["op"] == op]
        if len({r["bytes"] for r in mine}) >= 2:
            alpha, bw = fit_alpha_beta([r["bytes"] for r in mine], [r["time_s"] for r in mine])
            fits[op] = {"alpha_us": alpha * 1e6, "bandwidth_GBps": bw / 1e9,
                        "bus_bandwidth_GBps": bw / 1e9 * bus_factor(op, mine[0]["ranks"])}
    return fits
