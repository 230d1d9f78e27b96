"""The trainer's learning-rate schedules: the learning rate at every step, as one pure function.

`learning_rate` is the whole definition: a linear warmup, then cosine decay to a floor,
warmup-stable-decay (WSD: constant, then a short cooldown), linear decay, or constant. `lr_at`
reads its arguments from a TrainConfig, as the loop does at every step; `schedule_lrs` lists a
run's learning rates (what `python -m trainbook schedule` prints). A schedule that is a pure
function of the step is what makes an exact resume, and WSD's cooldowns branched from saved
states of one run, possible.

Chapter: book/start/first-run (warmup and cosine); book/pretraining/schedules.
"""

from __future__ import annotations

import math

from .config import DECAY_SHAPES, SCHEDULES, TrainConfig, decay_start

__all__ = ["DECAY_SHAPES", "SCHEDULES", "check_schedule", "decay_start", "learning_rate", "lr_at",
           "phase", "schedule_lrs"]


def check_schedule(kind: str, steps: int, warmup_steps: int = 0, decay_frac: float = 0.2,
                   decay_shape: str = "1-sqrt", lr: float = 1.0, min_lr_ratio: float = 0.0) -> None:
    """Raise ValueError, saying what to change, for any setting no schedule can run with."""
    if kind not in SCHEDULES:
        raise ValueError(f"unknown schedule {kind!r}: use one of {', '.join(SCHEDULES)}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a whole number >= 1, got {steps!r}")
    if not isinstance(warmup_steps, int) or not 0 <= warmup_steps <= steps:
        raise ValueError(f"warmup_steps must be in [0, steps={steps}], got {warmup_steps!r}")
    if not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"the peak learning rate must be > 0, got {lr}")
    if not 0 <= min_lr_ratio <= 1:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    if not 0 < decay_frac <= 1:
        raise ValueError(f"decay_frac must be in (0, 1] (the share of the steps in WSD's final "
                         f"decay; 0.2 is common), got {decay_frac}")
    if decay_shape not in DECAY_SHAPES:
        raise ValueError(f"unknown decay_shape {decay_shape!r}: use one of "
                         f"{', '.join(DECAY_SHAPES)}")
    if kind == "wsd" and decay_start(steps, decay_frac) < warmup_steps:
        raise ValueError(f"wsd: {warmup_steps} warmup steps and a decay over "
                         f"{steps - decay_start(steps, decay_frac)} steps (decay_frac "
                         f"{decay_frac} of {steps}) do not fit in {steps} steps; lower "
                         f"warmup_steps or decay_frac")


def learning_rate(kind: str, step: int, steps: int, lr: float, warmup_steps: int = 0,
                  min_lr_ratio: float = 0.0, decay_frac: float = 0.2,
                  decay_shape: str = "1-sqrt") -> float:
    """The learning rate of optimizer step `step` (0-based) of a `steps`-step run.

    Every schedule starts with a linear warmup, lr * (step + 1) / warmup_steps, so the first
    step already moves. Then: "cosine" decays along a half cosine to min_lr_ratio * lr at
    `steps`; "linear" decays along a line to the same floor (0: decay to zero); "constant"
    stays at lr; "wsd" stays at lr until `decay_start` and then cools down to the floor over
    the last decay_frac of the run, along 1 - sqrt(progress) ("1-sqrt", Hägele et al. 2024) or
    1 - progress ("linear"). Past `steps` every schedule holds its final value.
    """
    check_schedule(kind, steps, warmup_steps, decay_frac, decay_shape, lr, min_lr_ratio)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a whole number >= 0, got {step!r}")
    step = min(step, steps)  # past the end: the final value
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if kind == "constant":
        return lr
    if kind == "wsd":
        start = decay_start(steps, decay_frac)
        if step < start:
            return lr
        progress = min(1.0, (step - start) / (steps - start))
        keep = 1 - math.sqrt(progress) if decay_shape == "1-sqrt" else 1 - progress
    else:
        progress = (step - warmup_steps) / max(1, steps - warmup_steps)
        if kind == "cosine":
            keep = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        else:  # linear
            keep = 1 - min(1.0, progress)
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * keep)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """The learning rate the loop uses at optimizer step `step` (0-based) of the run `cfg`
    configures (cfg.schedule, lr, warmup_steps, min_lr_ratio, decay_frac, decay_shape)."""
    return learning_rate(cfg.schedule, step, cfg.steps, cfg.lr, cfg.warmup_steps,
                         cfg.min_lr_ratio, cfg.decay_frac, cfg.decay_shape)


def schedule_lrs(cfg: TrainConfig) -> list[float]:
    """The learning rate of every step the run takes: the trainer logs these as history "lr"."""
    return [lr_at(step, cfg) for step in range(cfg.steps)]


def phase(step: int, cfg: TrainConfig) -> str:
    """Which part of the schedule step `step` (0-based) is in: warmup, stable or decay."""
    if step < cfg.warmup_steps:
        return "warmup"
    if cfg.schedule == "constant" or (
            cfg.schedule == "wsd" and step < decay_start(cfg.steps, cfg.decay_frac)):
        return "stable"
    return "decay"
