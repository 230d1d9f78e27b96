"""trainbook cp: train the harness model context-parallel (every sequence split over the torchrun
ranks: all-gather K/V, ring, Ulysses all-to-all over heads, or the Ulysses x ring hybrid; contiguous
or zig-zag shards) and check it against one process.

Prints the largest difference in loss, gradients and parameters from one process. A correctness
check, not a trainer: the ranks keep the small tensors on the CPU with gloo, so it runs the same
on a laptop and a GPU node. Example: torchrun --standalone --nproc_per_node 4 -m trainbook cp
--kind ring_zigzag --seq-len 64. Chapter: book/parallelism/context-parallel
"""

from __future__ import annotations

import argparse
import json

from ..parallel import context_parallel, cp_attention, harness
from . import _torchrun
from ._args import positive_int

HELP = ("context parallelism (all-gather K/V, ring, Ulysses, hybrid; contiguous, zig-zag) vs one "
        "process (torchrun)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kind", default="ring_zigzag", choices=cp_attention.KINDS,
                   help="attention scheme (default: ring_zigzag)")
    p.add_argument("--seq-len", type=positive_int, default=64,
                   help="tokens per sequence, all ranks together; a multiple of the ranks "
                        "(of twice the ranks for zig-zag) (default: 64)")
    p.add_argument("--ulysses-degree", type=positive_int, default=2,
                   help="ranks per Ulysses group in the hybrid kinds (the rest form rings; "
                        "default: 2)")
    p.add_argument("--steps", type=positive_int, default=3, help="training steps (default: 3)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a line of text")


def run(args: argparse.Namespace) -> int:
    setup = harness.Setup(seq_len=args.seq_len, steps=args.steps)
    world = _torchrun.world_size("cp")
    scheme = cp_attention.ATTENTION[args.kind][1]
    cp_attention.shard_positions(setup.seq_len, world, 0, scheme)  # the sequence must split
    with _torchrun.process_group(backend="gloo"):
        run_cp = context_parallel.ContextParallelRun(kind=args.kind,
                                                     ulysses_degree=args.ulysses_degree)
        out = harness.run(setup, run_cp)
        if _torchrun.is_main():
            diff = harness.max_differences(out.trace, harness.reference(setup))
            if args.json:
                print(json.dumps({"kind": args.kind, "ranks": world, "seq_len": setup.seq_len,
                                  "ulysses_degree": args.ulysses_degree,
                                  "steps": setup.steps, "max_diff": diff,
                                  "step_seconds": out.step_seconds}, indent=2))
            else:
                print(f"{args.kind} on {world} ranks: max |diff| vs one process: "
                      + ", ".join(f"{k} {v:.1e}" for k, v in diff.items()))
    return 0
