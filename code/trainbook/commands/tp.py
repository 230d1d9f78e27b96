"""trainbook tp: train the harness model with tensor parallelism (Megatron-style from scratch and
with DTensor, each with or without sequence parallelism) over the torchrun ranks.

Prints, per implementation, the first and last loss and the all-reduces, all-gathers and
reduce-scatters of one training step's forward and backward, as the teaching loop's
CommCounter sees them. NCCL on GPUs, gloo on CPU.
Example: torchrun --standalone --nproc_per_node 8 -m trainbook tp --d-model 1024 --heads 16
--kv-heads 8 --seq-len 1024 --batch 8. Chapter: book/parallelism/tensor-parallel
"""

from __future__ import annotations

import argparse
import json

from ..parallel import harness, tensor_parallel
from ..report import table
from . import _torchrun
from ._args import positive_int

HELP = ("tensor (and sequence) parallelism from scratch and with DTensor: losses and collectives "
        "(torchrun)")
OPS = ("all_reduce", "all_gather", "reduce_scatter")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kind", choices=tensor_parallel.KINDS, action="append",
                   help="implementation (repeatable; default: all)")
    p.add_argument("--flavour", choices=("llama", "gpt2"), default="llama",
                   help="model flavour (default: llama)")
    p.add_argument("--d-model", type=positive_int, default=256, help="hidden size (default: 256)")
    p.add_argument("--layers", type=positive_int, default=2, help="transformer blocks (default: 2)")
    p.add_argument("--heads", type=positive_int, default=8,
                   help="query heads, divisible by the ranks (default: 8)")
    p.add_argument("--kv-heads", type=positive_int, default=8,
                   help="key/value heads, divisible by the ranks; llama only (default: 8)")
    p.add_argument("--seq-len", type=positive_int, default=128,
                   help="tokens per sequence (default: 128)")
    p.add_argument("--batch", type=positive_int, default=8,
                   help="sequences per step, every rank sees all (default: 8)")
    p.add_argument("--steps", type=positive_int, default=3, help="training steps (default: 3)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    kinds = args.kind or list(tensor_parallel.KINDS)
    kv = args.kv_heads if args.flavour == "llama" else args.heads
    setup = harness.Setup(flavour=args.flavour, d_model=args.d_model, n_layers=args.layers,
                          n_heads=args.heads, n_kv_heads=kv, d_ff=4 * args.d_model,
                          seq_len=args.seq_len, global_batch=args.batch, steps=args.steps)
    cfg = setup.model_config()  # a shape the model cannot have fails here
    world = _torchrun.world_size("tp")
    tensor_parallel.check_divisible(cfg, world, setup.seq_len,
                                    sp=any(k.endswith("_sp") for k in kinds))
    with _torchrun.process_group():
        rows = [_row(kind, harness.run(setup, tensor_parallel.TensorParallelRun(kind=kind)))
                for kind in kinds]
        if _torchrun.is_main():
            print(json.dumps({"ranks": world, "rows": rows}, indent=2) if args.json else
                  f"{world} ranks, {setup.steps} steps\n{table(rows)}")
    return 0


def _row(kind: str, out: harness.Result) -> dict:
    losses = out.trace.losses
    return {"kind": kind, "first_loss": losses[0], "last_loss": losses[-1],
            **{op: out.calls["forward_backward"].get(op, 0) for op in OPS}}
