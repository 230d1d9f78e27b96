"""Collective-communication benchmark: time, algbw and busbw per operation and payload.

Conventions follow nccl-tests (its doc/PERFORMANCE.md). The payload S is the size of the
full buffer: the input and output of all_reduce and broadcast, the *output* of all_gather (each
rank contributes S/n), the *input* of reduce_scatter (each rank keeps S/n), and each rank's send
buffer of all_to_all. algbw = S / t. busbw = algbw x a factor that makes the number comparable to
the link bandwidth whatever the rank count n: 2(n-1)/n for all_reduce, (n-1)/n for all_gather,
reduce_scatter and all_to_all, 1 for broadcast.

    torchrun --nproc_per_node 8 -m trainbook.bench.collectives --payload-range 1KiB 1GiB
    srun torchrun ... -m trainbook.bench.collectives --ops all_reduce --json out.json

gloo on CPU, nccl on GPU. Every rank runs `benchmark()`; rank 0 prints and writes the results.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import sys
import time
from numbers import Integral

import torch
import torch.distributed as dist

from ..launch import rank_device

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
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
    """Input and output tensors of `op` for a payload of nbytes (rounded to a multiple of n elements)."""
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
        dist.all_gather_single(out, inp)
    elif op == "reduce_scatter":
        dist.reduce_scatter_single(out, inp)
    elif op == "broadcast":
        dist.broadcast(inp, src=0)
    else:
        dist.all_to_all_single(out, inp)


def time_op(op: str, nbytes: int, iters: int = 10, warmup: int = 2, dtype=torch.float32,
            rounds: int = 3) -> float:
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


def benchmark(ops=OPS, sizes=(2**10, 2**16, 2**20), iters: int = 10, warmup: int = 2,
              dtype=torch.float32) -> list[dict]:
    """One row per (op, payload): time, algbw and busbw. Call on every rank of a process group."""
    if not dist.is_initialized():
        raise ValueError("benchmark() runs inside a process group: use torchrun, or "
                         "trainbook.launch.run(benchmark, nprocs=N)")
    for op in ops:
        bus_factor(op, 2)  # validates the name
    if iters < 1 or warmup < 0:
        raise ValueError(f"need iters >= 1 and warmup >= 0, got {iters} and {warmup}")
    n, rows = dist.get_world_size(), []
    elem = torch.tensor([], dtype=dtype).element_size()
    for op in ops:
        for size in sizes:
            numel = max(n, size // elem // n * n)
            t = time_op(op, size, iters, warmup, dtype)
            nbytes = numel * elem
            rows.append({"op": op, "bytes": nbytes, "ranks": n, "time_s": t,
                         "algbw_GBps": nbytes / t / 1e9, "busbw_GBps": nbytes / t / 1e9 * bus_factor(op, n)})
    return rows


def fit_alpha_beta(nbytes, seconds) -> tuple[float, float]:
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


def _args(argv):
    p = argparse.ArgumentParser(prog="torchrun --nproc_per_node N -m trainbook.bench.collectives",
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {', '.join(OPS)}")
    p.add_argument("--payload-range", nargs=2, default=["1KiB", "16MiB"], metavar=("START", "STOP"),
                   help="smallest and largest payload, e.g. 1KiB 1GiB (default: 1KiB 16MiB)")
    p.add_argument("--factor", type=int, default=4, help="payload step factor (default: 4)")
    p.add_argument("--iters", type=int, default=10, help="timed calls per payload (default: 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls first (default: 2)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"], help="element type")
    p.add_argument("--timeout-s", type=int, default=300, help="collective timeout, seconds")
    p.add_argument("--json", dest="json_out", help="write the rows and the alpha-beta fits here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _args(argv)
    try:
        ops = [o.strip() for o in args.ops.split(",") if o.strip()]
        for op in ops:
            bus_factor(op, 2)
        sizes = payload_sizes(parse_size(args.payload_range[0]), parse_size(args.payload_range[1]), args.factor)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if "RANK" not in os.environ:
        print("error: run under torchrun (or srun + torchrun), e.g. "
              "torchrun --nproc_per_node 2 -m trainbook.bench.collectives", file=sys.stderr)
        return 2
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout_s))
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    rows = benchmark(ops, sizes, args.iters, args.warmup, dtype)
    if dist.get_rank() == 0:
        from ..report import table
        n = dist.get_world_size()
        print(f"{n} ranks, backend {backend}, {args.dtype}, {args.iters} iterations per payload")
        print(table([{"op": r["op"], "bytes": r["bytes"], "time us": r["time_s"] * 1e6,
                      "algbw GB/s": r["algbw_GBps"], "busbw GB/s": r["busbw_GBps"]} for r in rows]))
        fits = {}
        for op in ops:
            mine = [r for r in rows if r["op"] == op]
            if len({r["bytes"] for r in mine}) >= 2:
                alpha, bw = fit_alpha_beta([r["bytes"] for r in mine], [r["time_s"] for r in mine])
                fits[op] = {"alpha_us": alpha * 1e6, "bandwidth_GBps": bw / 1e9,
                            "bus_bandwidth_GBps": bw / 1e9 * bus_factor(op, n)}
                print(f"{op}: t = {alpha * 1e6:.1f} us + S / {bw / 1e9:.3g} GB/s "
                      f"(busbw {bw / 1e9 * bus_factor(op, n):.3g} GB/s)")
        if args.json_out:
            meta = {"ranks": n, "backend": backend, "dtype": args.dtype, "iters": args.iters,
                    "torch": torch.__version__, "date": datetime.datetime.now().isoformat(timespec="seconds"),
                    "command": " ".join(sys.argv)}
            with open(args.json_out, "w") as fh:
                json.dump({"meta": meta, "rows": rows, "fits": fits}, fh, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
