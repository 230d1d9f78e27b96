"""The trainer's monitors (`--monitor spikes,nan`): hooks that watch the training stream.

`SpikeMonitor` scores each step's loss and relative update norm against the trailing window of
healthy steps (a z-score: how many standard deviations above the recent mean) and flags a step
where either passes its threshold; the history row gets `loss_z`, `update_z` and `spike`.
`NanMonitor` stops the run at the first step whose loss or gradients are not finite, after
finding where the first inf or NaN came from: `find_nonfinite` runs the step's first bad
micro-batch again with a hook on every module and reports the first module, in execution
order, whose forward output or backward gradient holds one.

Chapter: book/stability/loss-spikes (spikes); book/stability/debugging (NaN).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from .hooks import Hook, StepContext, StopTraining

MONITORS = ("spikes", "nan")


class SpikeMonitor(Hook):
    """Flag steps whose loss or relative update norm ||dtheta|| / ||theta|| is more than
    `threshold` standard deviations above the mean of the last `window` unflagged steps.

    Nothing is scored during the first `warmup` steps or before the window holds `min_history`
    steps (the early loss falls too fast to have a stationary mean). Flagged steps do not enter
    the window, so a spike does not hide the one after it."""

    def __init__(self, window: int = 50, threshold: float = 6.0, warmup: int = 20,
                 min_history: int = 10, stop: bool = False):
        if window < 2 or min_history < 2 or min_history > window:
            raise ValueError(f"need 2 <= min_history <= window, got {min_history}, {window}")
        if not threshold > 0 or warmup < 0:
            raise ValueError(f"need threshold > 0 and warmup >= 0, got {threshold}, {warmup}")
        self.window, self.threshold, self.warmup = window, threshold, warmup
        self.min_history, self.stop = min_history, stop
        self.loss: deque = deque(maxlen=window)
        self.update: deque = deque(maxlen=window)
        self.spikes: list[int] = []
        self._before: list[torch.Tensor] = []

    @staticmethod
    def zscore(history: deque, value: float) -> float:
        """(value - mean) / std of the history; inf for a non-finite value."""
        if not math.isfinite(value):
            return math.inf
        n = len(history)
        mean = sum(history) / n
        var = sum((h - mean) ** 2 for h in history) / (n - 1)
        return (value - mean) / max(math.sqrt(var), 1e-12 * max(abs(mean), 1e-12))

    def before_update(self, ctx: StepContext) -> None:
        self._before = [p.detach().clone() for p in ctx.model.parameters()]

    def after_update(self, ctx: StepContext) -> None:
        with torch.no_grad():
            moved = sum(float((p.detach() - b).float().pow(2).sum())
                        for p, b in zip(ctx.model.parameters(), self._before))
            size = sum(float(b.float().pow(2).sum()) for b in self._before)
        self._before = []
        update = math.sqrt(moved / max(size, 1e-30))
        rec = ctx.record
        rec["update_norm"] = update
        scored = ctx.step > self.warmup and len(self.loss) >= self.min_history
        lz = self.zscore(self.loss, ctx.loss) if scored else 0.0
        uz = self.zscore(self.update, update) if scored else 0.0
        rec["loss_z"], rec["update_z"] = lz, uz
        rec["spike"] = scored and (lz > self.threshold or uz > self.threshold)
        if rec["spike"]:
            self.spikes.append(ctx.step)
            if self.stop:
                raise StopTraining(f"spike at step {ctx.step}: loss z {lz:.1f}, "
                                   f"update z {uz:.1f} (threshold {self.threshold:g})")
            return
        if math.isfinite(ctx.loss):
            self.loss.append(ctx.loss)
            self.update.append(update)


@dataclass
class NonFinite:
    """Where the first inf or NaN appeared: `module` (its qualified name, '' for the model),
    `phase` ('forward' output, or 'backward' gradient w.r.t. the module's input), the kind of
    value, and how many modules ran before it."""

    module: str
    phase: str
    kind: str
    order: int
    micro_batch: int = 0

    def __str__(self) -> str:
        where = self.module or "the model"
        what = "output" if self.phase == "forward" else "gradient of its input"
        return f"first {self.kind} in the {self.phase} pass: {what} of {where}"


def _kind(t: torch.Tensor) -> str | None:
    """'nan', 'inf' or None for a tensor (or a tuple of them)."""
    ts = [x for x in (t if isinstance(t, (tuple, list)) else (t,))
          if isinstance(x, torch.Tensor) and x.is_floating_point()]
    if any(torch.isnan(x).any() for x in ts):
        return "nan"
    if any(torch.isinf(x).any() for x in ts):
        return "inf"
    return None


def find_nonfinite(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                   autocast: Callable[[], AbstractContextManager] | None = None,
                   backward: bool = True) -> NonFinite | None:
    """Run forward (and backward) of one micro-batch with a hook on every module; the first
    module, in the order they ran, whose output or input gradient is not finite. Leaves
    gradients as they were. None if everything is finite."""
    found: list[NonFinite] = []
    order = [0]

    def forward_hook(name):
        def hook(_mod, _inp, out):
            order[0] += 1
            kind = _kind(out)
            if kind and not any(f.phase == "forward" for f in found):
                found.append(NonFinite(name, "forward", kind, order[0]))
        return hook

    def backward_hook(name):
        def hook(_mod, grad_in, _grad_out):
            order[0] += 1
            kind = _kind(grad_in)
            if kind and not found:
                found.append(NonFinite(name, "backward", kind, order[0]))
        return hook

    handles = []
    for name, mod in model.named_modules():
        handles.append(mod.register_forward_hook(forward_hook(name)))
        if backward:
            handles.append(mod.register_full_backward_hook(backward_hook(name)))
    saved = [p.grad for p in model.parameters()]
    try:
        with autocast() if autocast else nullcontext():
            _, loss = model(x, y)
        if not found and backward and loss.requires_grad:
            loss.backward()
    finally:
        for h in handles:
            h.remove()
        for p, g in zip(model.parameters(), saved):
            p.grad = g
    return found[0] if found else None


class NanMonitor(Hook):
    """Stop at the first step whose loss or gradient norm is not finite, naming the module that
    made the first inf or NaN. Under fp16 loss scaling, inf gradients with a finite loss are the
    scaler's business (it skips the step and lowers the scale), not a failure."""

    def __init__(self, fp16_scaling: bool = False):
        self.fp16_scaling = fp16_scaling
        self.found: NonFinite | None = None

    def before_update(self, ctx: StepContext) -> None:
        bad_loss = not math.isfinite(ctx.loss)
        bad_grad = not math.isfinite(ctx.grad_norm) and not self.fp16_scaling
        if not (bad_loss or bad_grad):
            return
        for i, (x, y) in enumerate(ctx.batches):
            hit = find_nonfinite(ctx.model, x, y, ctx.autocast)
            if hit is not None:
                hit.micro_batch = i
                self.found = hit
                break
        what = "loss" if bad_loss else "gradient norm"
        where = f": {self.found}" if self.found else \
            " (not reproduced when the micro-batches ran again: look for non-determinism)"
        raise StopTraining(f"non-finite {what} at step {ctx.step}{where}")


def make_monitors(names: str, fp16_scaling: bool = False) -> list[Hook]:
    """The monitors a comma-separated `--monitor` value names ('' for none)."""
    chosen = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in MONITORS]
    if unknown:
        raise ValueError(f"unknown monitor {unknown[0]!r}; choose from {', '.join(MONITORS)} "
                         "(comma-separated)")
    return [SpikeMonitor() if n == "spikes" else NanMonitor(fp16_scaling) for n in chosen]
