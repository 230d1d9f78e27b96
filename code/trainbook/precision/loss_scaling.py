"""Dynamic loss scaling from scratch, checked step for step against `torch.amp.GradScaler`.

fp16 has 5 exponent bits: gradients below 2^-24 flush to zero. Multiplying the loss by a scale S
multiplies every gradient of the backward pass by S (the chain rule is linear), which moves them
into fp16's range; dividing the fp32 gradients by S before the optimizer step undoes it exactly
when S is a power of two. Too large an S overflows to inf instead. Dynamic loss scaling finds
the largest S that does not: start high (2^16), halve S and skip the step whenever a gradient is
inf or NaN, double it after `growth_interval` steps in a row without one. `LossScaler` does
that with GradScaler's arithmetic (the reciprocal of S taken in float64, the scale kept in fp32,
growth only to a finite scale), so the two agree bit for bit (`lockstep`).

Chapter: book/precision/mixed-precision.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable

import pandas as pd
import torch

from ..launch import threads

__all__ = ["GRADSCALER_DEFAULTS", "LossScaler", "gradscaler_defaults", "lockstep"]

# torch.amp.GradScaler's documented defaults; gradscaler_defaults() reads the installed ones
GRADSCALER_DEFAULTS = {"init_scale": 2.0**16, "growth_factor": 2.0, "backoff_factor": 0.5,
                       "growth_interval": 2000}


def gradscaler_defaults() -> dict[str, float]:
    """The installed torch.amp.GradScaler's defaults, read from its signature."""
    sig = inspect.signature(torch.amp.GradScaler.__init__).parameters
    return {k: sig[k].default for k in GRADSCALER_DEFAULTS}


class LossScaler:
    """Dynamic loss scaling: `scale(loss)` before backward, `unscale_(optimizer)` (optional, to
    clip the true gradients), `step(optimizer)` (skipped on inf/NaN), then `update()`."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000):
        if not (math.isfinite(init_scale) and init_scale > 0):
            raise ValueError(f"init_scale must be a positive number, got {init_scale}")
        if not growth_factor > 1:
            raise ValueError(f"growth_factor must be > 1 (2 doubles the scale), "
                             f"got {growth_factor}")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"backoff_factor must be in (0, 1) (0.5 halves the scale), "
                             f"got {backoff_factor}")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) \
                or growth_interval < 1:
            raise ValueError(f"growth_interval must be a whole number of steps >= 1, "
                             f"got {growth_interval!r}")
        self._scale = torch.tensor(float(init_scale), dtype=torch.float32)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.good_steps = 0  # finite steps in a row since the last change
        self.found_inf = False
        self._unscaled = False

    def get_scale(self) -> float:
        return self._scale.item()

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times S (an fp32 product, exact for a power-of-two S)."""
        return loss * self._scale.to(loss.device)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> bool:
        """Divide every gradient by S (multiply by 1/S, taken in float64 and rounded to fp32)
        and note whether any is inf or NaN. Returns that finding."""
        if self._unscaled:
            raise RuntimeError("unscale_ was already called this step; call update() first")
        inv = self._scale.double().reciprocal().float()
        found = False
        with torch.no_grad():
            for p in _grads(optimizer):
                found |= not bool(torch.isfinite(p.grad).all())
                p.grad.mul_(inv.to(p.grad.device))
        self.found_inf, self._unscaled = found, True
        return found

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """optimizer.step() unless a gradient was inf or NaN; returns whether it stepped."""
        if not self._unscaled:
            self.unscale_(optimizer)
        if self.found_inf:
            return False
        optimizer.step()
        return True

    def update(self) -> None:
        """Back off after an overflow; grow after growth_interval finite steps in a row (only
        to a finite scale), as torch._amp_update_scale_ does."""
        if not self._unscaled:
            raise RuntimeError("update() needs a step first: scale, backward, step, update")
        if self.found_inf:
            self._scale = self._scale * self.backoff_factor
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps == self.growth_interval:
                grown = self._scale * self.growth_factor
                if torch.isfinite(grown):
                    self._scale = grown
                self.good_steps = 0
        self._unscaled, self.found_inf = False, False

    def state_dict(self) -> dict:
        return {"scale": self.get_scale(), "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self._scale = torch.tensor(float(state["scale"]), dtype=torch.float32)
        self.good_steps = int(state["good_steps"])


def _grads(optimizer: torch.optim.Optimizer) -> Iterable[torch.Tensor]:
    return (p for g in optimizer.param_groups for p in g["params"] if p.grad is not None)


@threads(1)
def lockstep(model_fn: Callable[[], torch.nn.Module],
             batches: list[tuple[torch.Tensor, torch.Tensor]], plant: Iterable[int] = (),
             lr: float = 1e-3, clip: float = 1.0, **scaler_kwargs: float) -> pd.DataFrame:
    """Train two copies of `model_fn()` on the same `batches` (each (x, y); the model returns
    (logits, loss)), one with LossScaler and one with torch.amp.GradScaler("cpu"), both with the
    same settings and AdamW, and compare them after every step. At the steps in `plant`
    (1-based) one gradient entry is set to inf after backward in both, as an overflow would.

    One row per step: each scaler's scale before the step, whether each stepped, and the
    largest difference between the two models' parameters after it (0.0 when bit-equal)."""
    plant = set(plant)
    if not batches:
        raise ValueError("lockstep needs at least one batch")
    if any(not isinstance(s, int) or not 1 <= s <= len(batches) for s in plant):
        raise ValueError(f"planted steps must be in 1..{len(batches)}, got {sorted(plant)}")
    models = [model_fn(), model_fn()]
    if any(not torch.equal(a, b) for a, b in zip(*(m.state_dict().values() for m in models))):
        raise ValueError("model_fn must build the same model every time (seed it inside)")
    opts = [torch.optim.AdamW(m.parameters(), lr=lr) for m in models]
    ours = LossScaler(**scaler_kwargs)
    theirs = torch.amp.GradScaler("cpu", **scaler_kwargs)
    rows = []
    for step, (x, y) in enumerate(batches, start=1):
        row = {"step": step, "planted": step in plant}
        for name, model, opt, scaler in (("ours", models[0], opts[0], ours),
                                         ("torch", models[1], opts[1], theirs)):
            row[f"scale_{name}"] = scaler.get_scale()
            scaler.scale(model(x, y)[1]).backward()
            if step in plant:
                next(model.parameters()).grad.view(-1)[0] = math.inf
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            before = [p.detach().clone() for p in model.parameters()]
            scaler.step(opt)
            scaler.update()
            row[f"stepped_{name}"] = any(not torch.equal(b, p) for b, p in
                                         zip(before, model.parameters()))
            opt.zero_grad(set_to_none=True)
        row["max_param_diff"] = max((a - b).abs().max().item() for a, b in
                                    zip(models[0].parameters(), models[1].parameters()))
        rows.append(row)
    return pd.DataFrame(rows).set_index("step")
