"""trainbook plan: enumerate parallel layouts (dp, tp, pp, cp, ep, ZeRO stage, micro-batch,
recompute, interleave) of a model on N GPUs, keep those that obey the divisibility rules and fit
in memory, estimate each one's step time from compute and communication, and rank them. With
--explain, say why one layout is or is not feasible. The time model is a ranking aid, not a
prediction: see trainbook.parallel.planner for what it leaves out.

Chapter: book/parallelism/putting-it-together.
"""

from __future__ import annotations

import argparse
import json

from .. import configs, hardware
from ..compute.memory import ESTIMATE_MARGIN
from ..parallel import planner
from ..report import table
from ._args import check_model_file, finite_float

MAX_GPUS = 2**20  # 1,048,576: above the largest clusters built
HELP = "rank parallel layouts (dp/tp/pp/cp/ep, ZeRO, micro-batch, recompute) for a model on N GPUs"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help=f"preset ({', '.join(configs.PRESETS)}) or path to a config.json")
    p.add_argument("--gpu", default="h100-sxm", help=f"GPU type ({', '.join(hardware.SPECS)})")
    p.add_argument("--gpus", type=int, required=True, help="number of GPUs (a positive integer)")
    p.add_argument("--global-batch-tokens", type=int, required=True,
                   help="tokens per optimizer step, a multiple of --seq-len (e.g. 16777216)")
    p.add_argument("--seq-len", type=int, required=True, help="tokens per sequence")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"),
                   help="bf16/fp16 mixed precision with fp32 master weights, or fp32 "
                        "(default bf16)")
    p.add_argument("--grad-dtype", default=None, choices=("fp32", "bf16", "fp16"),
                   help="gradient precision (default: --dtype); fp32 for Megatron's main "
                        "gradients or FSDP2 with an fp32 reduce dtype")
    p.add_argument("--activations", default="production", choices=planner.ACTIVATIONS,
                   help="activation model: production (fused kernels; default) or reference "
                        "(the book's own model)")
    p.add_argument("--top", type=int, default=10, help="layouts to show (default 10)")
    p.add_argument("--all-variants", action="store_true",
                   help="list every variant, not only the fastest of each (dp, tp, pp, cp, ep)")
    p.add_argument("--domain-gpus", type=int, default=None,
                   help="GPUs per NVLink domain (default: the GPU's, from the hardware table: "
                        "8 for HGX nodes, 72 for GB200 NVL72)")
    p.add_argument("--nic-gbps", type=finite_float, default=None,
                   help="scale-out network per GPU in GB/s (default: the GPU's platform, e.g. "
                        "50 for one 400 Gb/s NIC per GPU)")
    p.add_argument("--mfu-matmul", type=finite_float, default=0.5,
                   help="fraction of the bf16 peak the matmuls reach (default 0.5)")
    p.add_argument("--headroom", type=finite_float, default=0.10,
                   help="fraction of GPU memory kept free (default 0.10)")
    p.add_argument("--margin", type=finite_float, default=ESTIMATE_MARGIN,
                   help="keep only layouts whose estimated peak may grow by this fraction and "
                        f"still fit: the estimator's error (default {ESTIMATE_MARGIN:g}; 0 "
                        "keeps every layout that fits)")
    p.add_argument("--explain", metavar="LAYOUT",
                   help="explain one layout instead, e.g. "
                        "'tp=8,pp=16,dp=128,zero=2,recompute=full' (dp defaults to the rest)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    if args.gpus is None or args.gpus < 1:
        raise ValueError(f"--gpus must be a positive integer, got {args.gpus}")
    check_model_file(args.model)
    if args.gpus > MAX_GPUS:  # the layouts enumerate the divisors: past this it never ends
        raise ValueError(f"--gpus {args.gpus:,} is more than the planner enumerates; give at most "
                         f"{MAX_GPUS:,}")
    if args.top < 1:
        raise ValueError(f"--top must be a positive integer, got {args.top}")
    if not 0 <= args.margin < 1:
        raise ValueError(f"--margin is a fraction of the estimated peak in [0, 1), got "
                         f"{args.margin:g}; e.g. --margin {ESTIMATE_MARGIN:g} (the estimator's "
                         "error) or --margin 0 to keep every layout that fits")
    cluster = planner.Cluster(gpu=args.gpu, gpus=args.gpus, domain_gpus=args.domain_gpus,
                              nic_gbps=args.nic_gbps, mfu_matmul=args.mfu_matmul,
                              headroom=args.headroom)
    job = planner.Job(configs.resolve(args.model), args.global_batch_tokens, args.seq_len,
                      dtype=args.dtype, grad_dtype=args.grad_dtype, activations=args.activations)
    if args.explain:
        text = planner.explain(args.explain, job, cluster)
        print(json.dumps({"explain": text}, indent=2) if args.json else text)
        return 0
    plans = planner.rank(job, cluster, margin=args.margin)
    shown = (plans if args.all_variants else planner.best_per_shape(plans))[: args.top]
    if args.json:
        print(json.dumps({"model": job.model.name, "gpu": cluster.spec.name, "gpus": args.gpus,
                          "margin": args.margin, "feasible_layouts": len(plans),
                          "layouts": [dict(p.row(), breakdown_s=p.breakdown) for p in shown]},
                         indent=2))
        return 0
    print(f"{job.model.name} on {args.gpus:,} x {cluster.spec.name}: {job.sequences:,} sequences "
          f"of {job.seq_len:,} tokens per step; {len(plans)} feasible layouts "
          f"(memory limit {cluster.usable_gib:.1f} GiB with the peak {args.margin:.0%} higher, "
          f"matmuls at {cluster.mfu_matmul:.0%} of "
          f"peak, network {cluster.nic_gbps:g} GB/s per GPU)")
    if not plans:
        print("no layout fits: more GPUs, a shorter sequence or a smaller global batch; "
              "try --explain to see why a layout fails")
        return 0
    print(table([p.row() for p in shown]))
    return 0
