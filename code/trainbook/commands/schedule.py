"""trainbook schedule: the learning rate at every step of a schedule, computed by the trainer's own
function (trainbook.train.schedule), to check a configuration before a run. Without --json it
prints sampled rows (every phase boundary included) and a summary; --json gives every step.
Step numbers are the trainer's: step k is the k-th optimizer step, as in its log.

Chapter: book/pretraining/schedules.
"""

from __future__ import annotations

import argparse
import json

from ..report import table
from ..train import TrainConfig, config_fields
from ..train.schedule import DECAY_SHAPES, SCHEDULES, decay_start, phase, schedule_lrs

HELP = "the learning rate at every step of cosine, wsd, linear or constant (the trainer's own)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = {f.name: f.default for f in config_fields()}  # the trainer's defaults
    p.add_argument("--kind", default=d["schedule"],
                   help=f"schedule: {', '.join(SCHEDULES)} (default: {d['schedule']})")
    p.add_argument("--steps", type=int, default=d["steps"],
                   help=f"optimizer steps in the run (default: {d['steps']})")
    p.add_argument("--lr", type=float, default=d["lr"], help=f"peak learning rate "
                                                              f"(default: {d['lr']})")
    p.add_argument("--warmup-steps", type=int, default=d["warmup_steps"],
                   help=f"linear warmup steps (default: {d['warmup_steps']})")
    p.add_argument("--min-lr-ratio", type=float, default=d["min_lr_ratio"],
                   help="final learning rate of cosine, linear and wsd as a fraction of the "
                        f"peak; 0 decays to zero (default: {d['min_lr_ratio']})")
    p.add_argument("--decay-frac", type=float, default=d["decay_frac"],
                   help=f"wsd: share of the steps in the final decay (default: "
                        f"{d['decay_frac']})")
    p.add_argument("--decay-shape", default=d["decay_shape"],
                   help=f"wsd: {', '.join(DECAY_SHAPES)} (default: {d['decay_shape']})")
    p.add_argument("--rows", type=int, default=20,
                   help="about how many steps the table samples (default 20; --json: all)")
    p.add_argument("--json", action="store_true",
                   help="print the settings and the learning rate of every step as JSON")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig a run with these schedule options would have (its checks apply)."""
    for flag, value, what, choices in (("--kind", args.kind, "a schedule", SCHEDULES),
                                       ("--decay-shape", args.decay_shape, "a decay shape",
                                        DECAY_SHAPES)):
        if value not in choices:
            raise ValueError(f"{flag} {value!r} is not {what}: use one of {', '.join(choices)}")
    if args.rows < 2:
        raise ValueError(f"--rows must be >= 2, got {args.rows}")
    return TrainConfig(schedule=args.kind, steps=args.steps, lr=args.lr,
                       warmup_steps=args.warmup_steps, min_lr_ratio=args.min_lr_ratio,
                       decay_frac=args.decay_frac, decay_shape=args.decay_shape, progress=False)


def sampled_steps(cfg: TrainConfig, rows: int) -> list[int]:
    """0-based steps to show: evenly spaced, plus the first and last step of every phase."""
    n = cfg.steps
    picks = {round(i * (n - 1) / (rows - 1)) for i in range(rows)} if n > 1 else {0}
    edges = {0, n - 1, cfg.warmup_steps - 1, cfg.warmup_steps}
    if cfg.schedule == "wsd":
        start = decay_start(n, cfg.decay_frac)
        edges |= {start - 1, start}
    return sorted(s for s in picks | edges if 0 <= s < n)


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    lrs = schedule_lrs(cfg)
    settings = {"kind": cfg.schedule, "steps": cfg.steps, "peak_lr": cfg.lr,
                "warmup_steps": cfg.warmup_steps}
    if cfg.schedule != "constant":
        settings["min_lr_ratio"] = cfg.min_lr_ratio
    if cfg.schedule == "wsd":
        settings |= {"decay_frac": cfg.decay_frac, "decay_shape": cfg.decay_shape,
                     "decay_start_step": decay_start(cfg.steps, cfg.decay_frac) + 1}
    if args.json:
        print(json.dumps({**settings, "lr": lrs}, indent=1))
        return 0
    rows = [{"step": s + 1, "lr": lrs[s], "of peak": f"{lrs[s] / cfg.lr:.1%}",
             "phase": phase(s, cfg)} for s in sampled_steps(cfg, args.rows)]
    print(", ".join(f"{k} {v}" for k, v in settings.items()))
    print(table(rows))
    counts = {p: sum(phase(s, cfg) == p for s in range(cfg.steps))
              for p in ("warmup", "stable", "decay")}
    print(f"{cfg.steps} steps: " + ", ".join(f"{k} {v}" for k, v in counts.items()) +
          f"; mean lr {sum(lrs) / len(lrs):.4g} ({sum(lrs) / len(lrs) / cfg.lr:.1%} of peak), "
          f"last {lrs[-1]:.4g}")
    return 0
