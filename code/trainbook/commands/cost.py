"""trainbook cost: time, GPU-hours and dollars of a training run, ideal and with failures.

Ideal time = training FLOPs / (GPUs x dense peak x MFU). The goodput part stretches it by
blocking checkpoint writes and failures (each costs a restart plus, on average, half a
checkpoint interval of lost work), checkpointing at Young's optimal interval unless told.

Chapter: book/compute/cost.
"""

from __future__ import annotations

import argparse
import json

from .. import configs, hardware
from ..compute import cost
from ..report import table
from ._args import check_model_file, finite_float

HELP = "training time and cost from FLOPs, GPUs, peak and MFU, with checkpoint/failure goodput"

LLAMA3_MTBF_GPU_HOURS = cost.LLAMA3_MTBF_GPU_HOURS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help=f"preset ({', '.join(configs.PRESETS)}) or path to a config.json")
    p.add_argument("--tokens", required=True,
                   help="training tokens: 15T, 300B, 2.5e12 or 1000000 (suffixes k, M, B, T, P)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="training context length for the attention FLOPs "
                        "(default: the model's max)")
    p.add_argument("--flops", choices=cost.FLOP_MODES, default="6n+attn",
                   help="FLOPs per token: 6N plus attention (PaLM) or plain 6N (default: 6n+attn)")
    p.add_argument("--gpu", default="h100-sxm",
                   help=f"accelerator from the spec table: {', '.join(hardware.SPECS)} "
                        "(default: h100-sxm)")
    p.add_argument("--gpus", type=int, default=1, help="number of GPUs, >= 1 (default: 1)")
    p.add_argument("--mfu", type=finite_float, default=0.4,
                   help="model FLOPs utilisation in (0, 1], e.g. 0.4 for 40%% (default: 0.4)")
    p.add_argument("--dtype", default="bf16",
                   help=f"dtype whose dense peak MFU refers to: {', '.join(hardware.DTYPES)} "
                        "(default: bf16)")
    p.add_argument("--price-per-gpu-hour", type=finite_float, default=None,
                   help="price of one GPU-hour in your currency; without it no cost is printed")
    g = p.add_argument_group("goodput (checkpoints and failures)")
    g.add_argument("--ckpt-minutes", type=finite_float, default=1.0,
                   help="minutes a blocking checkpoint write stalls training (default: 1)")
    g.add_argument("--ckpt-interval-minutes", default="auto",
                   help="minutes of training between checkpoints, or 'auto' for Young's "
                        "sqrt(2 x ckpt time x cluster MTBF) (default: auto)")
    f = g.add_mutually_exclusive_group()
    f.add_argument("--mtbf-gpu-hours", type=finite_float, default=None,
                   help="mean time between job-stopping failures of ONE GPU, in GPU-hours "
                        f"(default: {LLAMA3_MTBF_GPU_HOURS:,.0f}, Llama 3's 419 interruptions "
                        "in 54 days on 16,384 GPUs)")
    f.add_argument("--failures-per-million-gpu-hours", type=finite_float, default=None,
                   help="the same failure rate written as failures per 10^6 GPU-hours "
                        f"(Llama 3: {1e6 / LLAMA3_MTBF_GPU_HOURS:.1f})")
    g.add_argument("--restart-minutes", type=finite_float, default=10.0,
                   help="minutes from a failure until training runs again (default: 10)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _mtbf(args) -> float:
    if args.failures_per_million_gpu_hours is not None:
        rate = args.failures_per_million_gpu_hours
        if not rate > 0:
            raise ValueError(f"--failures-per-million-gpu-hours must be > 0, got {rate}")
        return 1e6 / rate
    if args.mtbf_gpu_hours is not None:
        if not args.mtbf_gpu_hours > 0:
            raise ValueError(f"--mtbf-gpu-hours must be > 0, got {args.mtbf_gpu_hours}")
        return args.mtbf_gpu_hours
    return LLAMA3_MTBF_GPU_HOURS


def _interval(text: str) -> float | None:
    if str(text).strip().lower() == "auto":
        return None
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"--ckpt-interval-minutes must be a number of minutes or 'auto', "
                         f"got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    check_model_file(args.model)
    est = cost.estimate(args.model, args.tokens, args.gpu, args.gpus, args.mfu, args.dtype,
                        args.seq_len, args.flops, args.price_per_gpu_hour)
    gp = cost.goodput(est.seconds / 3600, args.gpus, _mtbf(args), args.ckpt_minutes,
                      args.restart_minutes, _interval(args.ckpt_interval_minutes))
    rows = cost.summary_rows(est, gp)
    if args.json:
        real = rows[1]
        print(json.dumps({"ideal": est.to_dict(), "goodput": gp.to_dict(),
                          "with_failures": {"wall_hours": gp.wall_hours, "days": real["days"],
                                            "gpu_hours": real["GPU-hours"], "cost": real["cost"]}},
                         indent=2))
        return 0
    print(f"{est.model}: {est.tokens:.4g} tokens x {est.flops / est.tokens:.4g} FLOPs/token "
          f"({est.flop_mode}, seq_len {est.seq_len}) = {est.flops:.4g} FLOPs")
    print(f"{est.gpus:,} x {est.gpu} at {est.peak_tflops:g} TFLOPS {est.dtype} (dense) "
          f"x MFU {est.mfu:.0%}")
    print(table(rows))
    print(f"goodput {gp.goodput:.1%}: cluster MTBF {gp.cluster_mtbf_hours:.3g} h "
          f"({gp.mtbf_gpu_hours:,.0f} GPU-hours / {gp.gpus:,} GPUs), "
          f"expected failures {gp.failures:,.1f}; "
          f"checkpoint every {gp.interval_minutes:.3g} min ({gp.ckpt_minutes:g} min each), "
          f"restart {gp.restart_minutes:g} min")
    print(f"waste per hour of useful work: checkpoints {gp.ckpt_share:.1%}, lost work "
          f"{gp.rework_share:.1%}, restarts {gp.restart_share:.1%} (first order)")
    return 0
