"""trainbook memory: training memory per rank (model states, activations, logits) and whether it
fits a GPU. Give --model (a preset or a config.json) for the full breakdown, or --params N for
model states only. Parallelism: --dp with --zero shards model states, --tp/--pp/--ep divide the
weights, --tp (with sequence parallelism), --cp and --recompute shrink activations.

Chapter: book/compute/memory.
"""

from __future__ import annotations

import argparse
import json
import math

from .. import configs, hardware
from ..compute import memory
from ..report import table
from ._args import check_model_file

HELP = "training memory per rank: model states, activations, logits; fits a GPU?"


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model",
                     help=f"preset ({', '.join(configs.PRESETS)}) or path to a config.json")
    src.add_argument("--params", type=float,
                     help="bare parameter count (e.g. 7.5e9): model states only")
    p.add_argument("--dp", type=int, default=1, help="data-parallel ranks (default 1)")
    p.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3),
                   help="ZeRO stage over the dp ranks: 1 optimizer state, 2 + gradients, "
                        "3 + weights (FSDP); needs --dp > 1")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks (with sequence parallelism)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (1F1B; the first stage "
                                                     "holds pp micro-batches in flight)")
    p.add_argument("--cp", type=int, default=1, help="context-parallel ranks (split the sequence)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (mixture of experts; "
                                                     "must divide --dp)")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch per rank")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the "
                                                             "model's max_seq_len)")
    p.add_argument("--microbatches", type=int, default=None,
                   help="micro-batches per optimizer step (default 1, or --pp when pipelining)")
    p.add_argument("--recompute", default="none", choices=memory.RECOMPUTE,
                   help="activation recomputation (default none)")
    p.add_argument("--dtype", default="bf16", choices=memory.PRECISIONS,
                   help="fp32, or bf16/fp16 mixed precision with fp32 master weights "
                        "(default bf16)")
    p.add_argument("--optimizer", default="adamw", choices=memory.OPTIMIZERS,
                   help="adamw, sgd (with momentum), adam8bit, adafactor (default adamw)")
    p.add_argument("--activations", default="production", choices=memory.ACTIVATION_MODELS,
                   help="activation model: production (fused kernels, for published models; "
                        "default), reference (the book's model, as measured), korthikanti "
                        "(Korthikanti et al. 2022, Table 2)")
    p.add_argument("--grad-dtype", default=None, choices=memory.GRAD_DTYPES,
                   help="gradient precision (default: --dtype); fp32 for Megatron's main "
                        "gradients or FSDP2 with an fp32 reduce dtype")
    p.add_argument("--gpu", default="h100-sxm",
                   help=f"GPU to check the fit on ({', '.join(hardware.SPECS)})")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def inputs_from_args(args: argparse.Namespace) -> memory.MemoryInputs:
    """MemoryInputs from parsed options (bad combinations raise ValueError with the fix)."""
    params = None
    if args.params is not None:
        if not math.isfinite(args.params) or args.params < 1 or args.params != int(args.params):
            raise ValueError(f"--params must be a positive whole number, got {args.params:g}")
        params = int(args.params)
    model = configs.resolve(args.model) if args.model else None
    return memory.MemoryInputs(
        model=model, params=params, dtype=args.dtype, optimizer=args.optimizer, dp=args.dp,
        zero=args.zero, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep,
        micro_batch=args.micro_batch, seq_len=args.seq_len, microbatches=args.microbatches,
        recompute=args.recompute, activations=args.activations, grad_dtype=args.grad_dtype)


def run(args: argparse.Namespace) -> int:
    hardware.get(args.gpu)  # an unknown GPU fails before any work
    if args.model:
        check_model_file(args.model)
    x = inputs_from_args(args)
    b = memory.estimate(x)
    fit = memory.fits(b, args.gpu)
    what = x.model.name if x.model else f"{x.params:,} parameters"
    if args.json:
        setup = {k: getattr(x, k) for k in ("dtype", "optimizer", "dp", "zero", "tp", "pp", "cp",
                                             "ep", "micro_batch", "microbatches", "recompute",
                                             "activations", "grad_dtype")}
        setup["seq_len"] = x.tokens_seq or None
        print(json.dumps({"model": what, "setup": setup, "bytes": b.as_dict(), "fit": fit},
                         indent=2))
        return 0
    seq = f", seq {x.tokens_seq}" if x.model else ""
    print(f"{what}: {x.dtype} {x.optimizer}, dp {x.dp} zero {x.zero}, tp {x.tp} pp {x.pp} "
          f"cp {x.cp} ep {x.ep}, micro-batch {x.micro_batch}{seq}, recompute {x.recompute}"
          + (f" (stage: {b.stage})" if x.pp > 1 else ""))
    print(table(b.rows()))
    for note in b.notes:
        print(f"note: {note}")
    cap = "nominal" if fit["capacity_is_nominal"] else "reported"
    print(f"{fit['verdict']} on {fit['gpu']} ({fit['capacity_gib']:.1f} GiB {cap}): peak "
          f"{fit['peak_gib']:.2f} GiB, free {fit['free_gib']:.2f} GiB (estimate within "
          f"{fit['margin']:.0%})")
    return 0
