"""trainbook records: the book's stored results (every file under book/*/data and data/), from
one registry: list them, check that a fresh run reproduces them, regenerate them.

  python -m trainbook records list                       # name, chapter, kind, machine, date
  python -m trainbook records check clipping-divergence  # regenerate in a temporary folder, compare
  python -m trainbook records check --all --max-minutes 5
  ATEN_CPU_CAPABILITY=avx2 python -m trainbook records check numerics-accumulation
  python -m trainbook records regen clipping-divergence  # rewrite the stored files, with provenance

`check` compares as the record's kind says: a deterministic record exactly on the machine class
that wrote it and within its tolerance on another; a chaotic run or a measurement on what the
chapter asserts. ATEN_CPU_CAPABILITY=avx2 (or default) makes PyTorch dispatch another kernel
set, so one machine checks a record as another CPU would. Exit status: 0 reproduced, 1 a record
did not reproduce, 2 bad input.

Chapter: book/how-to-use (stored results).
"""

from __future__ import annotations

import argparse
import json
import sys

from ._args import positive_float

HELP = "the book's stored results: list, check (a fresh run reproduces them), regen"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=("list", "check", "regen"),
                   help="list the records; check: regenerate in a temporary folder and compare; "
                        "regen: rewrite the stored files")
    p.add_argument("names", nargs="*", metavar="NAME", help="records to check or regenerate")
    p.add_argument("--all", action="store_true", help="every record that can be regenerated")
    p.add_argument("--max-minutes", type=positive_float, default=None,
                   help="with --all: only records whose regeneration takes at most this long "
                        "on a 2-core CPU (the registry's estimate)")
    p.add_argument("--root", default=None,
                   help="the trainbook repository (default: found from the working directory)")
    p.add_argument("--json", action="store_true", help="print JSON")


def _selected(args: argparse.Namespace):
    from .. import records as R

    if args.action == "list":
        if args.names or args.all or args.max_minutes is not None:
            raise ValueError("`records list` takes no names, --all or --max-minutes")
        return []
    if bool(args.names) == bool(args.all):
        raise ValueError(f"`records {args.action}` needs record names or --all (not both); "
                         "`python -m trainbook records list` names them")
    if args.max_minutes is not None and not args.all:
        raise ValueError("--max-minutes picks among all records: give it with --all")
    if args.names:
        chosen = [R.get(n) for n in args.names]
        inputs = [r.name for r in chosen if r.kind == "input"]
        if inputs:
            raise ValueError(f"{', '.join(inputs)}: {R.KINDS['input']}")
        return chosen
    return [r for r in R.RECORDS if r.kind != "input"
            and (args.max_minutes is None or (r.minutes or 0) <= args.max_minutes)]


def run(args: argparse.Namespace) -> int:
    from .. import records as R
    from ..report import table

    repo = R.root(args.root)
    chosen = _selected(args)
    if args.action == "list":
        rows = R.listing(repo)
        extra = R.undeclared(repo)
        if args.json:
            print(json.dumps({"records": rows, "undeclared": extra}, indent=1))
        else:
            print(table(rows))
            for f in extra:
                print(f"undeclared: {f} (add it to trainbook/records/registry.py)")
        return 1 if extra else 0
    if args.action == "regen":
        for r in chosen:
            print(f"{r.name}: regenerating ({r.minutes or '?'} min on a 2-core CPU) ...",
                  file=sys.stderr, flush=True)
            for path in R.regen(r, repo):
                print(f"wrote {path.relative_to(repo)}")
        return 0
    results = {}
    for r in chosen:
        print(f"{r.name}: checking ({r.minutes or '?'} min on a 2-core CPU) ...",
              file=sys.stderr, flush=True)
        differences: dict = {}
        problems = R.check(r, repo, differences)
        results[r.name] = {"problems": problems, "largest_difference": {
            f: {"absolute": a, "relative": rel} for f, (a, rel) in differences.items()}}
        if not args.json:
            print(f"{r.name}: {'reproduces' if not problems else 'DIFFERS'}")
            for f, (a, rel) in differences.items():
                print(f"  {f}: largest difference {a:.3g} absolute, {rel:.3g} relative")
            for p in problems[:20]:
                print(f"  {p}")
            if len(problems) > 20:
                print(f"  ... and {len(problems) - 20} more")
    if args.json:
        print(json.dumps(results, indent=1))
    return 1 if any(r["problems"] for r in results.values()) else 0
