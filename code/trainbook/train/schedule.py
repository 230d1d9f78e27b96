"""The trainer's learning-rate schedules: the learning rate at every step, from the config.

Chapter: book/start/first-run (warmup and cosine).
"""

from __future__ import annotations

import math

from .config import SCHEDULES, TrainConfig

__all__ = ["SCHEDULES", "lr_at"]


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to cfg.lr over warmup_steps, then cosine decay to min_lr_ratio * lr at
    cfg.steps."""
    if cfg.schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {cfg.schedule!r}")
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)
