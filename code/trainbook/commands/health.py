"""trainbook health: check this node before or after a job; exit status 1 if a check failed.

The burn-in (every machine): the best matmul within a time budget, memory copy bandwidth, the
all-reduce bus bandwidth between local ranks, and the same seeded computation on every rank,
which must agree bit for bit. Each number is graded against this node's own baseline (saved
earlier with --save-baseline on a known-good run) or, on a GPU without one, the hardware table:
below --warn-below of it warns, below --fail-below fails. On a GPU node, nvidia-smi's counters
too: uncorrectable ECC errors, pending or failed row remaps, clocks held back by the hardware,
inactive NVLink links, and the Xid events of the kernel log triaged with NVIDIA's catalog
(--kernel-log FILE triages a saved log on any machine).

  python -m trainbook health --save-baseline /etc/trainbook/baseline.json   # a good node, once
  python -m trainbook health --baseline /etc/trainbook/baseline.json        # prolog / epilog
  python -m trainbook health --checks xid --kernel-log dmesg.txt

Exit status: 0 all passed (warnings and skips included), 1 a check failed (drain the node),
2 bad input. Chapter: book/failures/health
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from ..failures import gpu_counters, health
from ..report import table
from ._args import check_writable, positive_float, positive_int

HELP = "node health check (burn-in, ECC, remapped rows, NVLink, Xid); exit 1 on a failure"
ALL = (*health.BURN_IN, *gpu_counters.COUNTERS)
MAX_RANKS = 64


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checks", default=",".join(ALL),
                   help=f"comma-separated subset of {', '.join(ALL)} (default: all)")
    p.add_argument("--ranks", type=positive_int, default=None,
                   help="local ranks for the all-reduce and the cross-rank check (default: the "
                        "GPUs here, or 2 on a CPU)")
    p.add_argument("--budget-s", type=positive_float, default=2.0,
                   help=f"seconds for the matmul measurement, at most {health.MAX_BUDGET_S:g} "
                        "(default: 2)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="CPU threads for the measurements (default: torch's)")
    p.add_argument("--baseline", default=None,
                   help="grade against this node's baseline (a --save-baseline file)")
    p.add_argument("--save-baseline", default=None, metavar="FILE",
                   help="store this run's measurements as the node's baseline")
    p.add_argument("--warn-below", type=positive_float, default=0.8,
                   help="warn below this fraction of the expected value (default: 0.8)")
    p.add_argument("--fail-below", type=positive_float, default=0.5,
                   help="fail below this fraction of the expected value (default: 0.5)")
    p.add_argument("--kernel-log", default=None,
                   help="triage the Xid events of this saved kernel log instead of dmesg")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--json-out", metavar="FILE", help="also write the JSON report to FILE")


def run(args: argparse.Namespace) -> int:
    import torch

    from ..launch import threads

    checks = [c.strip() for c in args.checks.split(",") if c.strip()]
    unknown = [c for c in checks if c not in ALL]
    if unknown or not checks:
        raise ValueError(f"--checks {args.checks!r}: unknown check "
                         f"{unknown[0] if unknown else '(none)'!r}; choose from {', '.join(ALL)}")
    if not args.budget_s <= health.MAX_BUDGET_S:
        raise ValueError(f"--budget-s {args.budget_s:g} is over {health.MAX_BUDGET_S:g} s; a "
                         "health check should take seconds")
    thresholds = health.Thresholds(args.warn_below, args.fail_below) \
        if args.fail_below <= args.warn_below < 1 else None
    if thresholds is None:
        raise ValueError(f"need --fail-below <= --warn-below < 1, got --fail-below "
                         f"{args.fail_below:g} and --warn-below {args.warn_below:g}")
    ranks = args.ranks or max(2, torch.cuda.device_count())
    if ranks > MAX_RANKS:
        raise ValueError(f"--ranks {ranks}: at most {MAX_RANKS} local ranks")
    if args.threads is not None and args.threads > 1024:
        raise ValueError(f"--threads {args.threads}: at most 1024")
    baseline = health.load_baseline(args.baseline) if args.baseline else None
    if args.kernel_log and not Path(args.kernel_log).is_file():
        raise ValueError(f"--kernel-log {args.kernel_log}: no such file; save one with "
                         "dmesg > FILE or journalctl -k > FILE")
    for option, path in (("--save-baseline", args.save_baseline), ("--json-out", args.json_out)):
        check_writable(path, option)
    with threads(args.threads or torch.get_num_threads()):
        result, measured = health.run_checks(checks, ranks, args.budget_s, baseline, thresholds,
                                             args.kernel_log)
    status = health.exit_status(result)
    command = shlex.join(["python", "-m", "trainbook", *sys.argv[1:]])
    if args.save_baseline:
        if not measured:
            raise ValueError("--save-baseline needs a burn-in check (matmul, memory, all-reduce)")
        health.save_baseline(args.save_baseline, measured, command)
    report = {"status": ("fail" if status else "warn" if any(c.status == "warn" for c in result)
                         else "pass"), "exit_status": status, "checks": health.as_dict(result),
              "measured": measured}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1) + "\n")
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(table(health.report_rows(result)))
        print(f"health: {report['status'].upper()} (exit status {status})"
              + (f"; baseline saved to {args.save_baseline}" if args.save_baseline else ""))
    return status
