"""The trainer's objectives: what the model is asked to predict from a packed batch.

Chapter: book/start/first-run (next-token prediction).
"""

from __future__ import annotations

import torch

from .config import OBJECTIVES

__all__ = ["OBJECTIVES", "prepare_model"]


def prepare_model(model: torch.nn.Module, objective: str) -> None:
    """Set up `model` for `objective` (attention mask kind). "clm": causal, as built."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
