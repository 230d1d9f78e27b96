"""trainbook train: the reference trainer (one process, or under torchrun with DDP).

Chapter: book/start/first-run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
from pathlib import Path

from ..train import TrainConfig, TrainResult, config_fields

HELP = "train the reference model on the shipped corpus (works under torchrun)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """One option per TrainConfig field, documented by the field's own help text."""
    for f in config_fields():
        flag, help = "--" + f.name.replace("_", "-"), f"{f.metadata['help']} (default: {f.default})"
        if f.type == "bool":
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                           help=help)
        else:
            conv = int if f.type.startswith("int") else float if f.type.startswith("float") else str
            p.add_argument(flag, type=conv, default=f.default, help=help)
    p.add_argument("--json", action="store_true",
                   help="print the final summary as JSON (the training log goes to stderr)")
    p.add_argument("--json-out",
                   help="write the config, summary and per-step history to this JSON file")


def summary(result: TrainResult) -> dict:
    """The run in a few numbers: final and validation loss, throughput and MFU (medians over the
    steps after the first, which pays one-time costs), steps and tokens."""
    h = result.history
    steady = h[1:] or h
    median = lambda key: statistics.median(r[key] for r in steady) if steady else None  # noqa: E731
    cfg = result.config
    return {"model": result.model_config.name, "steps": len(h),
            "final_loss": h[-1]["loss"] if h else None, "val_loss": result.val_loss,
            "tokens_per_s": median("tokens_per_s"), "step_time_s": median("step_time_s"),
            "mfu": median("mfu"),
            "tokens": len(h) * cfg.batch_size * cfg.seq_len * cfg.grad_accum * result.world_size,
            "world_size": result.world_size, "dtype": cfg.dtype,
            "flops_per_token": result.flops_per_token, "peak_flops": result.peak_flops,
            "peak_source": result.peak_source}


def run(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from ..train import train

    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in config_fields()})
    if args.json_out and not Path(args.json_out).resolve().parent.is_dir():
        raise ValueError(f"--json-out {args.json_out}: its folder does not exist; create it first")
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        result = train(cfg)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if args.json and rank0:
        print(json.dumps(summary(result), indent=2))
    if args.json_out and rank0:
        record = {"config": dataclasses.asdict(result.config),
                  "model_config": result.model_config.to_dict(),
                  "flops_per_token": result.flops_per_token, "peak_flops": result.peak_flops,
                  "peak_source": result.peak_source, "val_loss": result.val_loss,
                  "world_size": result.world_size, "summary": summary(result),
                  "history": result.history}
        with open(args.json_out, "w") as fh:
            json.dump(record, fh, indent=1)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0
