"""trainbook hardware: the accelerator spec table (and this machine's measured CPU peak).

Chapter: book/appendix/hardware.
"""

from __future__ import annotations

import argparse
import json

from .. import hardware
from ..bench import peak
from ..report import table

HELP = "the accelerator spec table: dense peak TFLOPS per dtype, memory, bandwidth, sources"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--measure-cpu", action="store_true",
                   help="also measure this CPU's fp32/bf16 matmul peak (about a second) and say "
                        "whether bf16 is native or emulated here")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    rows = hardware.table()
    if args.measure_cpu:
        from ..bench import lowp
        cpu = peak.cpu_spec()
        rows.append({"name": "cpu (this machine)", "vendor": "measured",
                     **{f"{d} TFLOPS": cpu.tflops[d] for d in hardware.DTYPES},
                     "source": f"{cpu.source}; bf16 class: {lowp.cpu_class()}"})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(table(rows, [c for c in rows[0] if c != "source"]))
    if args.measure_cpu:
        print(f"\nthis machine: {lowp.machine_line()}")
    print("\nDense peaks (vendor sheets often print 2:4-sparse numbers, 2x these). Sources:")
    for r in rows:
        print(f"  {r['name']}: {r['source']}")
    return 0
