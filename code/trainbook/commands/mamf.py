"""trainbook mamf: the maximum achievable matmul FLOPS (MAMF) finder.

Sweeps (m, n, k) matmul shapes in one dtype, times each with a cache flush before every repeat,
and reports mean, median and max TFLOPS per shape and the best shape. Runs on CPU, CUDA and ROCm.
Results go to a JSON-lines file as they are measured; Ctrl-C prints the summary of what was
measured so far and exits with status 130. Example: python -m trainbook mamf --dtype bf16
--m-range 1024 20480 1024 --n 4096 --k 4096 --output mamf.jsonl

Chapter: book/compute/throughput.
"""

from __future__ import annotations

import argparse
import json

from ..bench import matmul
from ..bench.timing import default_flush_bytes
from ..launch import resolve_device
from ..report import table
from ._args import (
    check_writable,
    command_line,
    finite_float,
    non_negative_int,
    positive_float,
    positive_int,
)

MAX_VALUES = 10_000  # per dimension: a sweep past this would not finish
HELP = "maximum achievable matmul FLOPS: sweep matmul shapes, report the best TFLOPS and shape"


def add_arguments(p: argparse.ArgumentParser) -> None:
    for dim in ("m", "n", "k"):
        g = p.add_mutually_exclusive_group()
        g.add_argument(f"--{dim}", type=positive_int, nargs="+", metavar=dim.upper(),
                       help=f"fixed value(s) of {dim} (several allowed)")
        g.add_argument(f"--{dim}-range", type=positive_int, nargs=3,
                       metavar=("START", "STOP", "STEP"),
                       help=f"{dim} from START to STOP inclusive, every STEP")
    p.add_argument("--dtype", default="bf16",
                   help="fp32, tf32 (GPU), bf16, fp16 or fp8 (GPU, compute capability >= 8.9); "
                        "default bf16")
    p.add_argument("--device", default="auto", help="auto (GPU if visible), cpu, cuda or cuda:N; "
                                                    "ROCm GPUs are cuda")
    p.add_argument("--repeats", type=positive_int, default=None,
                   help="timed matmuls per shape (default 50 on GPU, 10 on CPU; 3 with --quick)")
    p.add_argument("--warmup", type=non_negative_int, default=None,
                   help="untimed matmuls per shape first (default 10 on GPU, 2 on CPU; 1 quick)")
    p.add_argument("--flush-mib", type=finite_float, default=None,
                   help="cache-flush buffer written before every timed matmul, MiB (default: "
                        "256 on GPU, 2x the last-level cache capped at 256 on CPU; 32 quick)")
    p.add_argument("--budget", type=positive_float, default=None, metavar="SECONDS",
                   help="time budget: probe the dtype's speed first, skip shapes that would not "
                        "fit, and say how many were measured (for CPUs that emulate bf16/fp16)")
    p.add_argument("--quick", action="store_true",
                   help="fewer repeats and a small flush: a first look in seconds")
    p.add_argument("--output", metavar="FILE",
                   help="append results as JSON lines (metadata line, then one line per shape)")
    p.add_argument("--top", type=positive_int, default=10,
                   help="shapes listed in the summary table")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the summary and all rows as JSON")


def _values(args, dim):
    r = getattr(args, f"{dim}_range")
    if r is not None:
        if (r[1] - r[0]) // r[2] + 1 > MAX_VALUES:
            raise ValueError(f"--{dim}-range {' '.join(map(str, r))} gives more than "
                             f"{MAX_VALUES:,} values; use a larger STEP")
        return matmul.parse_range(*r, name=dim)
    fixed = getattr(args, dim)
    if fixed is None:
        raise ValueError(f"give --{dim} VALUE[S] or --{dim}-range START STOP STEP")
    if any(v < 1 for v in fixed):
        raise ValueError(f"--{dim} values must be >= 1, got {min(fixed)}")
    return fixed


def run(args: argparse.Namespace) -> int:
    if args.top < 1:
        raise ValueError(f"--top must be >= 1, got {args.top}")
    shapes = matmul.make_shapes(*(_values(args, d) for d in "mnk"))
    device = resolve_device(args.device)
    matmul.check_dtype(args.dtype, device)  # an unknown or unsupported dtype fails before work
    check_writable(args.output, "--output")
    gpu = device.type == "cuda"
    repeats = args.repeats if args.repeats is not None else (3 if args.quick else 50 if gpu else 10)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 10 if gpu else 2)
    if args.flush_mib is not None and args.flush_mib < 0:
        raise ValueError(f"--flush-mib must be >= 0, got {args.flush_mib}")
    flush = (int(args.flush_mib * 2**20) if args.flush_mib is not None
             else default_flush_bytes(device, small=args.quick))
    if args.budget is not None and args.budget <= 0:
        raise ValueError(f"--budget must be > 0 seconds, got {args.budget}")
    command = command_line(args)
    result = matmul.sweep(shapes, args.dtype, str(device), repeats, warmup, flush, args.output,
                          progress=not (args.no_progress or args.json), command=command,
                          budget_s=args.budget)
    summary = result.summary()
    if args.json:
        print(json.dumps({"summary": summary, "rows": result.rows()}, indent=2))
        return 130 if result.interrupted else 0
    if result.interrupted:
        print(f"interrupted: {summary['measured']} of {summary['planned']} shapes measured")
    if result.skipped:
        print(f"time budget {args.budget:g} s: {summary['measured']} of {summary['planned']} "
              f"shapes measured, {len(result.skipped)} skipped as too slow to fit")
    if not result.results:
        print("nothing measured" + (": give a larger --budget" if result.skipped else ""))
        return 130 if result.interrupted else 1
    rows = sorted(result.rows(), key=lambda r: -r["max_tflops"])[:args.top]
    cols = ["m", "n", "k", "mean_tflops", "median_tflops", "max_tflops", "median_ms"]
    print(f"{summary['device_name']}, {summary['dtype']}: {summary['measured']} shapes, "
          f"{'up to ' if args.budget else ''}{repeats} repeats each, "
          f"{flush / 2**20:g} MiB cache flush")
    print(table(rows, cols))
    print("best:")
    for stat in ("mean", "median", "max"):
        b = summary[f"best_{stat}"]
        print(f"  {stat:>6}: {b['tflops']:.4g} TFLOPS {summary['dtype']} @ {b['shape']} (MxNxK)")
    if args.output:
        print(f"results appended to {args.output}")
    return 130 if result.interrupted else 0
