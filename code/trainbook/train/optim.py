"""The trainer's optimizers: one builder per name, weight decay on matrices only.

Chapter: book/start/first-run (AdamW); Part 2 teaches the rest.
"""

from __future__ import annotations

import torch

from .config import OPTIMIZERS, TrainConfig
from .init import lr_scale

__all__ = ["OPTIMIZERS", "make_optimizer", "param_groups"]


def param_groups(model: torch.nn.Module, weight_decay: float, init: str = "scaled") -> list[dict]:
    """Matrices decay; norms and biases (1-D parameters) do not. Parameters whose learning rate
    the initialisation scales (muP) get their own group with "lr_scale"; the loop sets each
    group's learning rate to the schedule's times its lr_scale."""
    groups: dict[tuple[bool, float], list[torch.nn.Parameter]] = {}
    for name, p in model.named_parameters():
        key = (p.dim() >= 2, lr_scale(model, name, init))
        groups.setdefault(key, []).append(p)
    return [{"params": ps, "weight_decay": weight_decay if decay else 0.0, "lr_scale": scale}
            for (decay, scale), ps in groups.items()]


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """The optimizer `cfg.optimizer` names, over `model`'s parameters."""
    if cfg.optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, "
                         f"got {cfg.optimizer!r}")
    groups = param_groups(model, cfg.weight_decay, cfg.init)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
