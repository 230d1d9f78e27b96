"""trainbook zero: train the harness model with ZeRO stages 1-3 (from scratch), FSDP2 and DDP on
the torchrun ranks, and check each against one process.

Prints the bytes each collective moves per step in units of the fp32 model size Psi (stages 1
and 2: 2 Psi, stage 3: 3 Psi), the largest difference in loss, gradients and parameters from
one process and, with --measure, each kind's peak memory per rank. The ranks keep the tiny model
on the CPU with gloo, so it runs the same on a laptop and a GPU node. Example: torchrun
--standalone --nproc_per_node 4 -m trainbook zero --kinds zero1,zero2,zero3,fsdp2.
Chapter: book/parallelism/zero-fsdp
"""

from __future__ import annotations

import argparse
import json

from ..parallel import harness, zero
from ..report import table
from . import _torchrun
from ._args import positive_int

HELP = "ZeRO 1-3 and FSDP2 vs one process: bytes per step, differences, peak memory (torchrun)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kinds", default="zero1,zero2,zero3,fsdp2",
                   help=f"comma-separated implementations, from {', '.join(zero.KINDS)} "
                        "(default: zero1,zero2,zero3,fsdp2)")
    p.add_argument("--steps", type=positive_int, default=3, help="training steps (default: 3)")
    p.add_argument("--optimizer", default="sgd", choices=("sgd", "adamw"),
                   help="optimizer (default: sgd)")
    p.add_argument("--measure", action="store_true", help="also measure peak memory per rank")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def parse_kinds(text: str) -> list[str]:
    """'zero1,fsdp2' -> ['zero1', 'fsdp2'], every name one of zero.KINDS."""
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    bad = [k for k in kinds if k not in zero.KINDS]
    if bad or not kinds:
        raise ValueError(f"--kinds {text!r}: unknown {bad}; use some of {', '.join(zero.KINDS)}")
    return kinds


def run(args: argparse.Namespace) -> int:
    kinds = parse_kinds(args.kinds)
    world = _torchrun.world_size("zero")
    setup = harness.Setup(steps=args.steps, optimizer=args.optimizer, global_batch=2 * world)
    with _torchrun.process_group(backend="gloo"):
        ref = harness.reference(setup) if _torchrun.is_main() else None
        psi = 4 * sum(p.numel() for p in harness.build_model(setup).parameters())
        rows = [_row(setup, kind, psi, ref, args.measure) for kind in kinds]
        if _torchrun.is_main():
            _print(rows, setup, world, args.json)
    return 0


def _row(setup: harness.Setup, kind: str, psi: int, ref: harness.Trace | None,
         measure: bool) -> dict:
    """One kind: bytes per step in units of Psi (fp32 model bytes), the differences from the
    one-process reference (where given) and, with measure, this rank's peak MiB."""
    out = harness.run(setup, zero.ZeroRun(kind=kind, measure_memory=measure))
    row = {"kind": kind,
           "bytes_per_step_psi": {c: b / psi for c, b in zero.paper_bytes(out).items()}}
    if measure:
        row["peak_MiB"] = out.memory["peak"] / 2**20
    if ref is not None:
        row["max_diff"] = harness.max_differences(out.trace, ref)
    return row


def _print(rows: list[dict], setup: harness.Setup, world: int, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"ranks": world, "steps": setup.steps, "optimizer": setup.optimizer,
                          "kinds": rows}, indent=2))
        return
    flat = [{"kind": r["kind"],
             **{f"{c} (Psi)": round(v, 3) for c, v in r["bytes_per_step_psi"].items()},
             **({"peak MiB": r["peak_MiB"]} if "peak_MiB" in r else {}),
             **{f"max |d {n}|": f"{v:.1e}" for n, v in r["max_diff"].items()}} for r in rows]
    print(f"{world} ranks, {setup.steps} steps, {setup.optimizer}")
    # kinds differ in collectives
    print(table(flat, list(dict.fromkeys(c for r in flat for c in r))))
