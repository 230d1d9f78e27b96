"""Silent data corruption: find the rank whose numbers are wrong while everything looks fine.

A GPU with a marginal unit computes, without an error or an Xid, a result that is slightly off;
the loss may not show it for thousands of steps. Two cheap detectors:

- **The same computation on every rank.** `health.chain_digest` runs a seeded matmul chain; on
  identical hardware every rank must produce the same bits (`python -m trainbook health`).
- **Replicas must stay identical.** Under data parallelism every rank holds the same weights
  after every step (the gradients are all-reduced, the update is deterministic). `checksum`
  sums a tensor's bit patterns as integers, exactly; `ReplicaCheck`, a trainer hook, all-gathers
  every parameter's checksum every `every` steps and stops the run naming the rank and the
  tensor that disagree with the majority. `FlipBit` plants the fault: one bit of one weight on
  one rank, the way a bad memory cell or ALU would.

Chapter: book/failures/health.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from ..train.hooks import Hook, StepContext, StopTraining

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def checksum(t: torch.Tensor) -> int:
    """The sum of a tensor's elements read as integers of their width (exact, order-free):
    any single flipped bit changes it."""
    t = t.detach().contiguous()
    bits = t.view(_INT_VIEW[t.element_size()]).to(torch.int64)
    return int(bits.sum().item())


def model_checksums(model: torch.nn.Module) -> dict[str, int]:
    """Every parameter's checksum, by name."""
    return {name: checksum(p) for name, p in model.named_parameters()}


def disagreements(per_rank: list[dict[str, int]]) -> list[dict[str, Any]]:
    """For each tensor whose checksum is not the same on every rank: the tensor and the ranks
    that differ from the most common value (the majority is taken as right)."""
    out = []
    for name in per_rank[0] if per_rank else []:
        values = [r[name] for r in per_rank]
        common, count = Counter(values).most_common(1)[0]
        if count < len(values):
            out.append({"tensor": name, "ranks": [i for i, v in enumerate(values) if v != common]})
    return out


def gather_checksums(model: torch.nn.Module) -> list[dict[str, int]]:
    """Every rank's checksums, in rank order (every rank must call this at the same point)."""
    mine = model_checksums(model)
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [mine]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


class ReplicaCheck(Hook):
    """Every `every` steps, compare every rank's parameter checksums; on a mismatch stop the
    run (or only record it, `stop=False`) naming the step, ranks and tensors."""

    def __init__(self, every: int = 1, stop: bool = True):
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.every, self.stop = every, stop
        self.found: list[dict[str, Any]] = []  # {"step", "tensor", "ranks"}
        self.checked = 0

    def after_update(self, ctx: StepContext) -> None:
        if ctx.step % self.every:
            return
        self.checked += 1
        bad = disagreements(gather_checksums(ctx.model))
        if not bad:
            return
        self.found += [{"step": ctx.step, **b} for b in bad]
        if ctx.record is not None:
            ctx.record["replica_mismatch"] = len(bad)
        if self.stop:
            ranks = sorted({r for b in bad for r in b["ranks"]})
            raise StopTraining(f"step {ctx.step}: the replica on rank(s) {ranks} differs from "
                               f"the others in {len(bad)} tensor(s), first {bad[0]['tensor']}: "
                               "silent data corruption? drain that node and resume from the "
                               "last checkpoint")


def flip_bit(t: torch.Tensor, index: int, bit: int) -> None:
    """Flip bit `bit` (0: the lowest) of element `index` of `t`, in place."""
    width = t.element_size() * 8
    if not 0 <= bit < width:
        raise ValueError(f"bit must be in [0, {width}) for {t.dtype}, got {bit}")
    if not 0 <= index < t.numel():
        raise ValueError(f"index must be in [0, {t.numel()}), got {index}")
    with torch.no_grad():
        flat = t.view(-1).view(_INT_VIEW[t.element_size()])
        flat[index] ^= torch.tensor(1 << bit if bit < width - 1 else -(1 << bit),
                                    dtype=flat.dtype)


class FlipBit(Hook):
    """At step `step` on rank `rank`, after the update, flip one bit of one element of the
    named parameter: a planted silent data corruption."""

    def __init__(self, step: int, rank: int, tensor: str, index: int = 0, bit: int = 0):
        if step < 1 or rank < 0:
            raise ValueError(f"need step >= 1 and rank >= 0, got {step} and {rank}")
        self.step, self.rank, self.tensor, self.index, self.bit = step, rank, tensor, index, bit

    def after_update(self, ctx: StepContext) -> None:
        here = dist.get_rank() if dist.is_initialized() else 0
        if ctx.step != self.step or here != self.rank:
            return
        params = dict(ctx.model.named_parameters())
        if self.tensor not in params:
            raise ValueError(f"no parameter {self.tensor!r}; the model has "
                             f"{', '.join(list(params)[:4])}, ...")
        flip_bit(params[self.tensor].data, self.index, self.bit)


def first_step(found: Iterable[dict[str, Any]]) -> int | None:
    """The first step at which a mismatch was seen."""
    steps = [f["step"] for f in found]
    return min(steps) if steps else None

