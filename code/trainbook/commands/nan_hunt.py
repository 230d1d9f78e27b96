"""trainbook nan-hunt: run training steps with the NaN detector on and say where the first inf or
NaN came from: the step, the micro-batch, the module and tensor (forward or backward, shape,
count of bad elements), the backward function anomaly mode blames and the forward line that made
it, and with --stats the tensors of that micro-batch nearest fp16's limits. Exit status 0 when
every step's loss and gradients are finite, 1 when the hunt found something.

On your own run: --resume-from a checkpoint of `train --ckpt-dir` replays the next --steps steps
from it with the run's own configuration (model, data position, optimizer, schedule). To see the
tools work: --plant log0|div0|fp16-softmax puts a known bug into the reference model.

  python -m trainbook nan-hunt --plant log0 --steps 3
  python -m trainbook nan-hunt --plant fp16-softmax --lr 3e-2 --steps 30 --stats 8
  python -m trainbook nan-hunt --resume-from ckpt/step-001200.pt --steps 100

Chapter: book/stability/debugging.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import sys
from pathlib import Path

from ..stability.debugging_bugs import PLANTS
from ._args import finite_float, non_negative_int, positive_int

HELP = "train a few steps with the NaN detector on; name the module of the first inf or NaN"

# trainer options a hunt may set (the rest keep the trainer's defaults or the checkpoint's)
OPTIONS = ("model", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "tokenizer",
           "vocab_size", "corpus", "seq_len", "batch_size", "grad_accum", "optimizer", "lr",
           "warmup_steps", "grad_clip", "dtype", "device", "cache_dir")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..train import config_fields

    p.add_argument("--resume-from", help="a checkpoint written by train --ckpt-dir (a "
                   "step-NNNNNN.pt file or DCP folder): replay from it with its configuration")
    p.add_argument("--steps", type=positive_int, default=20,
                   help="how many steps to run (from the checkpoint's step) (default: 20)")
    p.add_argument("--plant", choices=("none", *PLANTS), default="none",
                   help="plant a known bug in the reference model (default: none)")
    p.add_argument("--plant-step", type=positive_int, default=1,
                   help="the step the planted bug starts at (default: 1)")
    p.add_argument("--seed", type=non_negative_int, default=None,
                   help="seed for initialisation and data order (default: the trainer's, 0)")
    for f in config_fields():
        if f.name in OPTIONS:
            conv = int if f.type.startswith("int") else \
                finite_float if f.type.startswith("float") else str
            p.add_argument("--" + f.name.replace("_", "-"), type=conv, default=None,
                           help=f"{f.metadata['help']} (default: the trainer's, {f.default}, "
                                "or the checkpoint's)")
    p.add_argument("--stats", type=non_negative_int, default=0,
                   help="print this many tensors of the bad micro-batch nearest fp16's limits "
                        "(default: 0)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def _checkpoint_config(path: str) -> tuple[dict, int]:
    """The train_config and step stored with a checkpoint (file or DCP folder)."""
    from ..train.checkpoint import EXTRA, is_sharded, load_checkpoint

    p = Path(path)
    if not p.exists():
        raise ValueError(f"--resume-from {path}: no such checkpoint; give a step-NNNNNN.pt file "
                         "or step folder written by train --ckpt-dir")
    try:
        state = load_checkpoint(p / EXTRA if is_sharded(p) else p)
    except Exception as e:  # not a torch file, a folder without DCP metadata, truncated...
        raise ValueError(f"--resume-from {path}: cannot read it as a trainbook checkpoint "
                         f"({type(e).__name__}); give a file or step folder written by train "
                         "--ckpt-dir") from None
    if not isinstance(state, dict) or "train_config" not in state or "step" not in state:
        raise ValueError(f"--resume-from {path}: not a trainbook checkpoint (no train_config); "
                         "give a file or step folder written by train --ckpt-dir")
    return state["train_config"], int(state["step"])


def config_from_args(args: argparse.Namespace) -> tuple:  # (TrainConfig, step it starts after)
    """The run to replay and the step it resumes at (0: from scratch): the checkpoint's
    configuration (one process, stopping --steps after its step) or the trainer's defaults, with
    the options given on the command line."""
    from ..train import TrainConfig, config_fields

    given = {k: getattr(args, k) for k in (*OPTIONS, "seed") if getattr(args, k) is not None}
    quiet = dict(monitor="", log_every=0, progress=False, ckpt_dir=None, ckpt_every=0,
                 resume=False, eval_batches=1)
    if args.resume_from:
        stored, step = _checkpoint_config(args.resume_from)
        known = {f.name for f in config_fields()}
        base = {k: v for k, v in stored.items() if k in known}
        base.update(dp_replicate=1, dp_shard=1, tp=1, pp=1, cp=1, layout=None)  # one process
        if step >= base.get("steps", 0):
            raise ValueError(f"--resume-from {args.resume_from}: the checkpoint is at the end of "
                             f"its run (step {step} of {base.get('steps')}): nothing to replay")
        return TrainConfig(**{**base, **given, **quiet, "resume_from": args.resume_from,
                              "stop_after": step + args.steps}), step
    if "warmup_steps" not in given:  # the trainer's 20, or a quarter of a shorter hunt
        given["warmup_steps"] = min(TrainConfig.warmup_steps, args.steps // 4)
    return TrainConfig(**{**given, **quiet, "steps": args.steps}), 0


def hunt(args: argparse.Namespace) -> dict:
    """Run it; the report as a dict (found is None when every step was finite)."""
    from .. import train as train_pkg
    from ..stability import debugging
    from ..stability.debugging_bugs import Plant
    from ..train.monitor import NanMonitor
    from .train import check

    cfg, start = config_from_args(args)
    check(cfg)
    monitor = NanMonitor(fp16_scaling=cfg.dtype == "fp16")
    hooks = ([Plant(args.plant, args.plant_step)] if args.plant != "none" else []) + [monitor]
    result = train_pkg.train(cfg, hooks=hooks)
    h = [row for row in result.history if row["step"] > start]  # this hunt's steps
    report = {"model": result.model_config.name, "first_step": start + 1,
              "steps_finite": len(h), "last_loss": h[-1]["loss"] if h else None,
              "plant": args.plant, "stopped": result.stopped, "step": monitor.step,
              "found": None, "anomaly": None, "stats": []}
    if monitor.found is not None:
        report["found"] = dataclasses.asdict(monitor.found) | {"text": str(monitor.found)}
        x, y = monitor.batch
        a = debugging.anomaly(result.model, x, y, monitor.autocast)
        report["anomaly"] = None if a is None else dataclasses.asdict(a) | {"text": str(a)}
        if args.stats:
            rows = debugging.risky(debugging.module_stats(result.model, x, y,
                                                          autocast=monitor.autocast))
            cols = ["phase", "module", "cls", "tensor", "max_finite", "headroom", "nonfinite",
                    "fp16_over", "fp16_flush", "reason"]
            report["stats"] = [{k: int(v) if k in cols[6:9] else v for k, v in row.items()}
                               for row in rows[cols].head(args.stats).to_dict("records")]
    return report


def print_report(r: dict) -> None:
    if r["step"] is None:
        print(f"nan-hunt: {r['steps_finite']} steps from step {r['first_step']}, every loss and "
              f"gradient norm finite (last loss {r['last_loss']:.4f}): nothing to hunt")
        return
    if r["found"] is None:
        print(f"nan-hunt: {r['stopped']}")
        return
    print(f"nan-hunt: {r['stopped'].split(':')[0]}, micro-batch {r['found']['micro_batch']}")
    print(f"  detector: {r['found']['text']}")
    print("  anomaly mode: " + (r["anomaly"]["text"] if r["anomaly"] else
                                "nothing (backward returned no NaN: the bad value is in the "
                                "forward pass or an inf)"))
    if r["stats"]:
        from ..report import table
        print("  the first tensors of that micro-batch at fp16's limits, in execution order "
              "(headroom: binades below fp16's largest value):")
        print(table([{k: (f"{v:.3g}" if isinstance(v, float) else v) for k, v in row.items()}
                     for row in r["stats"]]))


def run(args: argparse.Namespace) -> int:
    log = io.StringIO()  # the trainer's lines: "resumed from ...", "stopped after ..."
    with contextlib.redirect_stdout(log):
        report = hunt(args)
    kept = [line for line in log.getvalue().splitlines() if line.startswith("resumed")]
    print("\n".join(kept), file=sys.stderr if args.json else sys.stdout) if kept else None
    if args.json:
        print(json.dumps(report, indent=1, default=str))
    else:
        print_report(report)
    return 0 if report["step"] is None else 1
