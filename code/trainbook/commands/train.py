"""trainbook train: the reference trainer (one process, or under torchrun with DDP).

Chapter: book/start/first-run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
from pathlib import Path

from ..train import TrainConfig, TrainResult, config_fields
from ._args import check_model_file, check_writable, finite_float

HELP = "train the reference model on the shipped corpus (works under torchrun)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """One option per TrainConfig field, documented by the field's own help text."""
    for f in config_fields():
        flag, help = "--" + f.name.replace("_", "-"), f"{f.metadata['help']} (default: {f.default})"
        if f.type == "bool":
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                           help=help)
        else:
            conv = int if f.type.startswith("int") else \
                finite_float if f.type.startswith("float") else str
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


def check(cfg: TrainConfig, json_out: str | None = None) -> None:
    """What train() would only find wrong after building the tokenizer and the data (seconds of
    work, files in the cache), found first: the model and its overrides, the layout for this
    launch, the device, tokenizer, corpus, AdamW's betas and the paths the run reads or writes.
    Each raises ValueError with the fix."""
    from .. import data
    from ..launch import resolve_device
    from ..train import layout_for, model_config

    vocab = {"bytes": 256, "bpe": cfg.vocab_size}.get(cfg.tokenizer)
    if vocab is None:  # a tokenizer file: read it now, its vocabulary sizes the model
        vocab = data.load_tokenizer_file(cfg.tokenizer).vocab_size
    data.load_corpus(cfg.corpus)  # a shipped name or a readable UTF-8 file
    for name in ("beta1", "beta2"):
        if not 0 <= getattr(cfg, name) < 1:
            raise ValueError(f"--{name} must be in [0, 1), got {getattr(cfg, name)}")
    resolve_device(cfg.device)
    try:
        check_model_file(cfg.model)
    except ValueError as e:
        raise ValueError(f"--model: {e}") from None
    layout_for(cfg, int(os.environ.get("WORLD_SIZE", "1")), model_config(cfg, vocab))
    if cfg.resume_from and not Path(cfg.resume_from).exists():
        raise ValueError(f"--resume-from {cfg.resume_from}: no such checkpoint; give a file or "
                         "step folder written by --ckpt-dir, or drop the option")
    for option, path in (("--ckpt-dir", cfg.ckpt_dir), ("--cache-dir", cfg.cache_dir)):
        check_writable(path, option, folder=True)
    if json_out and not Path(json_out).resolve().parent.is_dir():
        raise ValueError(f"--json-out {json_out}: its folder does not exist; create it first")
    check_writable(json_out, "--json-out")


def run(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from ..train import train

    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in config_fields()})
    check(cfg, args.json_out)
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
