"""The trainer's initialisations: how the model's weights are drawn before step 0.

Chapter: book/start/first-run (the reference init).
"""

from __future__ import annotations

import torch

from .config import INITS

__all__ = ["INITS", "init_weights", "lr_scale"]


def init_weights(model: torch.nn.Module, scheme: str) -> None:
    """Initialise `model` in place. "scaled": the reference model's own init (N(0, 0.02),
    residual output projections scaled by 1/sqrt(2 n_layers)); it draws from the global RNG."""
    if scheme not in INITS:
        raise ValueError(f"init must be one of {', '.join(INITS)}, got {scheme!r}")
    # "scaled" is what Transformer.__init__ already drew: nothing to redo


def lr_scale(model: torch.nn.Module, name: str, scheme: str) -> float:
    """The factor on the schedule's learning rate for parameter `name` under `scheme` (1 for
    every parameter unless the parametrisation says otherwise, as muP does by width)."""
    return 1.0
