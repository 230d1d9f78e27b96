"""Hooks: how code outside the loop watches or changes a run without editing the loop.

A hook is an object with any of five methods, called in order for every hook passed to
`train(cfg, hooks=[...])`: `on_model(model)` once, after the model is built and before the
optimizer sees its parameters (swap modules here); `on_batches(step, batches)` every step, before
the forward pass, which may return other micro-batches (plant bad data, drop a batch);
`before_update(ctx)` every step, when the gradients are complete and clipped, before the
optimizer moves the weights; `after_update(ctx)` after the step, with `ctx.record` (the history
row, to which a hook may add keys); `on_end(result)` once. A hook that raises `StopTraining`
ends the run cleanly: the history so far is kept, the reason is in `TrainResult.stopped`. The
trainer's own monitors (`--monitor spikes,nan`) are hooks.

Chapter: book/stability/loss-spikes; book/stability/debugging.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

Batches = list[tuple[torch.Tensor, torch.Tensor]]  # a step's (inputs, targets) micro-batches


class StopTraining(Exception):
    """Raised by a hook to end the run after this step; the message is the reason."""


@dataclass
class StepContext:
    """What a hook sees of one step. `batches` are the step's (inputs, targets) micro-batches;
    `loss` and `grad_norm` are floats (the norm before clipping); `record` is None until
    `after_update`."""

    step: int  # 1-based: the step being taken
    model: nn.Module  # the unwrapped model (no DDP)
    optimizer: torch.optim.Optimizer
    batches: list[tuple[torch.Tensor, torch.Tensor]]
    loss: float
    grad_norm: float
    autocast: Callable[[], AbstractContextManager]
    loss_scale: float = 1.0  # fp16: the GradScaler's scale this step (1 otherwise)
    record: dict[str, Any] | None = None
    notes: dict[str, Any] = field(default_factory=dict)  # hooks may pass things along here


class Hook:
    """Base class with every method a no-op: override the ones you need."""

    def on_model(self, model: nn.Module) -> None:
        """Once, before the optimizer is built: the place to replace or wrap modules."""

    def on_batches(self, step: int, batches: Batches) -> Batches | None:
        """Before step `step` (1-based) runs forward: return the micro-batches to train on
        instead of `batches`, or None to keep them."""

    def before_update(self, ctx: StepContext) -> None:
        """Gradients complete (unscaled, clipped), weights not yet moved."""

    def after_update(self, ctx: StepContext) -> None:
        """Weights moved; `ctx.record` is this step's history row."""

    def on_end(self, result: Any) -> None:
        """Once, with the TrainResult."""


def replace_batches(hooks: list[Hook], step: int, batches: Batches) -> Batches:
    """The micro-batches step `step` trains on after every hook's `on_batches`, in order."""
    for h in hooks:
        out = h.on_batches(step, batches)
        if out is not None:
            batches = out
    return batches


def call(hooks: list[Hook], method: str, *args: Any) -> str | None:
    """Call `method` on every hook in order; the reason of the first StopTraining, or None. Every
    hook still runs for this step, so the monitors all see the step that stops the run."""
    reason = None
    for h in hooks:
        try:
            getattr(h, method)(*args)
        except StopTraining as stop:
            reason = reason or str(stop)
    return reason
