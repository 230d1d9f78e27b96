"""Weights kept in bf16 without an fp32 master copy: updates lost below half an ulp, and two fixes.

A bf16 weight w in [2^e, 2^(e+1)) has neighbours 2^(e-7) apart; the update w - u rounds back to w
(round to nearest) whenever |u| is below half that gap, 2^(e-8). So every update smaller than
|w| * 2^-9 is lost for sure, and every one larger than |w| * 2^-8 survives (`loss_thresholds`).
Mixed precision avoids this by updating an fp32 master copy; Zamirai et al. 2020 keep only bf16
and fix the rounding instead:

- Kahan-compensated updates: a bf16 buffer c holds what the last rounding dropped; the next
  update adds it back: d = u + c, w' = bf16(w + d), c = bf16(d - (w' - w)).
- Stochastic rounding: round up with probability equal to the distance from the value below,
  so the rounding is unbiased and small updates survive on average (`formats.quantize`).

`LowPrecisionWeights` wraps any optimizer (the trainer's AdamW): the inner optimizer computes
the fp32 result from the stored weights, and the wrapper stores it as the mode says. Weights are
held in fp32 tensors whose values are bf16 numbers, so the forward pass runs at fp32 speed on
any CPU; the compensation buffer is a real bf16 tensor.

Chapter: book/precision/mixed-precision.
"""

from __future__ import annotations

import torch

from .. import formats

__all__ = ["MODES", "LowPrecisionWeights", "bytes_per_param", "loss_thresholds"]

MODES = ("master", "nearest", "kahan", "stochastic")


def loss_thresholds(fmt: str = "bf16") -> tuple[float, float]:
    """(sure, never): an update u of a weight w is lost for sure when |u| < |w| * sure and never
    when |u| > |w| * never, under round to nearest. Half the gap at w over w lies in
    (2^-(m+2), 2^-(m+1)] for a format with m mantissa bits: bf16 2^-9 and 2^-8."""
    m = formats.get(fmt).man_bits
    return 2.0 ** -(m + 2), 2.0 ** -(m + 1)


def bytes_per_param(mode: str, fmt: str = "bf16", optimizer_bytes: float = 8.0) -> dict:
    """Bytes per parameter of each part under `mode`, on a GPU: weights and gradients in `fmt`,
    the fp32 master copy (master), the compensation buffer in `fmt` (kahan), and the inner
    optimizer's state (AdamW: two fp32 moments, 8 bytes)."""
    _check_mode(mode)
    b = formats.get(fmt).memory_bits / 8
    out = {"weights": b, "grads": b, "master": 4.0 if mode == "master" else 0.0,
           "compensation": b if mode == "kahan" else 0.0, "optimizer": optimizer_bytes}
    out["total"] = sum(out.values())
    return out


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown weights mode {mode!r}; choose one of {', '.join(MODES)}")


class LowPrecisionWeights:
    """Wrap `optimizer` so that its parameters are stored in `fmt` (bf16), updated by `mode`:

    - master: the parameters are the fp32 master copy, as in mixed precision (the matmuls round
      them to bf16 themselves: `train.emulate`'s bf16 recipe); nothing is rounded here.
    - nearest: the parameters are rounded to fmt after every step (round to nearest even).
    - kahan: as nearest, with a compensation buffer (a real `fmt` tensor) carrying what the
      rounding dropped into the next step.
    - stochastic: rounded stochastically after every step (seeded by `seed`).

    `step()` returns the share of the parameters whose update round to nearest would lose:
    the inner optimizer's fp32 result differs from the old weight but rounds to the same
    `fmt` number (with a master copy: the update does not reach the `fmt` copy this step).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, mode: str = "nearest",
                 fmt: str = "bf16", seed: int = 0):
        _check_mode(mode)
        f = formats.get(fmt)
        if f.bits > 16 or not f.torch_dtype:
            raise ValueError(f"{fmt} is not a 16-bit format with a torch dtype; use bf16 or fp16")
        self.optimizer, self.mode, self.fmt = optimizer, mode, f.name
        self.dtype = getattr(torch, f.torch_dtype)
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.generator = torch.Generator().manual_seed(seed)
        self.compensation = {}
        with torch.no_grad():
            for p in self.params:
                if mode != "master":
                    p.copy_(self._round(p))
                if mode == "kahan":
                    self.compensation[p] = torch.zeros_like(p, dtype=self.dtype)

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def _round(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype).to(x.dtype)  # torch's cast: round to nearest even

    @torch.no_grad()
    def step(self) -> float:
        old = [p.detach().clone() for p in self.params]
        self.optimizer.step()
        lost = total = 0
        for p, w in zip(self.params, old):
            want = p.detach().clone()  # the inner optimizer's fp32 result
            nearest = self._round(want)
            lost += int(((nearest == self._round(w)) & (want != w)).sum())
            total += p.numel()
            if self.mode == "nearest":
                p.copy_(nearest)
            elif self.mode == "stochastic":
                p.copy_(formats.quantize(want, self.fmt, stochastic=True,
                                         generator=self.generator))
            elif self.mode == "kahan":
                c = self.compensation[p]
                d = (want - w) + c.float()
                p.copy_(self._round(w + d))
                c.copy_(d - (p - w))  # the copy rounds it to fmt
        return lost / max(total, 1)

    def state_bytes(self) -> dict:
        """Bytes per parameter this wrapper and its optimizer hold, measured from the tensors
        (the weights and gradients are not state; see `bytes_per_param`)."""
        n = sum(p.numel() for p in self.params)
        opt = sum(t.numel() * t.element_size() for s in self.optimizer.state.values()
                  for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
        comp = sum(c.numel() * c.element_size() for c in self.compensation.values())
        return {"optimizer": opt / n, "compensation": comp / n}
