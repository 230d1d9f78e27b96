"""trainbook collectives: time each collective over a range of payloads on every torchrun rank.

Reports time, algbw and busbw per operation and payload (nccl-tests conventions), and the
alpha-beta fit t = alpha + S / B of each operation. gloo on CPU, nccl on GPU. Run it under
torchrun, e.g. torchrun --standalone --nproc_per_node 2 -m trainbook collectives --payload-range
1KiB 1MiB; rank 0 prints. Chapter: book/parallelism/collectives
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
from pathlib import Path

import torch

from ..bench import collectives as bench
from ..report import table
from . import _torchrun
from ._args import check_writable, non_negative_int, positive_float, positive_int

HELP = "time, algbw, busbw and alpha-beta fit of each collective on the torchrun ranks"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ops", default=",".join(bench.OPS),
                   help=f"comma-separated subset of {', '.join(bench.OPS)} (default: all)")
    p.add_argument("--payload-range", nargs=2, default=["1KiB", "16MiB"], metavar=("START", "STOP"),
                   help="smallest and largest payload, e.g. 1KiB 1GiB (default: 1KiB 16MiB)")
    p.add_argument("--factor", type=positive_int, default=4,
                   help="payload step factor, >= 2 (default: 4)")
    p.add_argument("--iters", type=positive_int, default=10,
                   help="timed calls per payload (default: 10)")
    p.add_argument("--warmup", type=non_negative_int, default=2,
                   help="untimed calls first (default: 2)")
    p.add_argument("--dtype", default="fp32", choices=list(bench.DTYPES),
                   help="element type (default: fp32)")
    p.add_argument("--timeout-s", type=positive_float, default=300,
                   help="seconds before a stuck collective fails (default: 300)")
    p.add_argument("--json", action="store_true",
                   help="print JSON (meta, rows, fits) instead of a table")
    p.add_argument("--json-out", metavar="FILE", help="also write that JSON to FILE")


def run(args: argparse.Namespace) -> int:
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    if not ops:
        raise ValueError(f"--ops {args.ops!r} names no collective; "
                         f"use some of {', '.join(bench.OPS)}")
    bench.check_benchmark(ops, args.iters, args.warmup)
    sizes = bench.payload_sizes(*map(bench.parse_size, args.payload_range), args.factor)
    if args.json_out and not Path(args.json_out).resolve().parent.is_dir():
        raise ValueError(f"--json-out {args.json_out}: its folder does not exist; create it first")
    check_writable(args.json_out, "--json-out")
    _torchrun.world_size("collectives")
    with _torchrun.process_group(args.timeout_s) as backend:
        rows = bench.benchmark(ops, sizes, args.iters, args.warmup, bench.DTYPES[args.dtype])
        if _torchrun.is_main():
            _report(args, backend, rows)
    return 0


def _report(args, backend: str, rows: list[dict]) -> None:
    n, fits = rows[0]["ranks"], bench.fit_ops(rows)
    meta = {"ranks": n, "backend": backend, "dtype": args.dtype, "iters": args.iters,
            "torch": torch.__version__,
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": shlex.join(["trainbook", *sys.argv[1:]])}
    result = {"meta": meta, "rows": rows, "fits": fits}
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump(result, fh, indent=1)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{n} ranks, backend {backend}, {args.dtype}, {args.iters} iterations per payload")
    print(table([{"op": r["op"], "bytes": r["bytes"], "time us": r["time_s"] * 1e6,
                  "algbw GB/s": r["algbw_GBps"], "busbw GB/s": r["busbw_GBps"]} for r in rows]))
    for op, f in fits.items():
        print(f"{op}: t = {f['alpha_us']:.1f} us + S / {f['bandwidth_GBps']:.3g} GB/s "
              f"(busbw {f['bus_bandwidth_GBps']:.3g} GB/s)")
