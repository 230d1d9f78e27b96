"""Stragglers: one slow rank makes every rank slow, and the step time cannot say which.

In synchronous data parallelism every rank waits for the slowest at each all-reduce, so the
step time is the same on every rank: a GPU with throttled clocks, a rank sharing its cores, a
slow data loader slow the whole job and hide among the others. What does differ is the work a
rank does *before* it waits: `StepTimes`, a trainer hook, times each rank's forward pass (no
collective inside) and the whole step, and all-gathers both every step. `stragglers` names the
ranks whose median forward time is above `threshold` times the median over all ranks.
`SlowRank` plants the fault: a sleep in one rank's forward pass, as a slower GPU would add.

`rank_faults.demo` trains the reference model on gloo ranks with both hooks.

Chapter: book/failures/health.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from ..train.hooks import Batches, Hook, StepContext


class StepTimes(Hook):
    """Per step and rank: the forward pass (this rank's own work) and the whole step (which
    includes waiting for the others). Rows on every rank after each step."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self._start = self._fwd_start = 0.0
        self._forward = 0.0

    def on_model(self, model: torch.nn.Module) -> None:
        def pre(*_: Any) -> None:
            self._fwd_start = time.perf_counter()

        def post(*_: Any) -> None:
            self._forward += time.perf_counter() - self._fwd_start

        model.register_forward_pre_hook(pre)
        model.register_forward_hook(post)

    def on_batches(self, step: int, batches: Batches) -> None:
        self._start, self._forward = time.perf_counter(), 0.0
        return None

    def after_update(self, ctx: StepContext) -> None:
        mine = torch.tensor([self._forward, time.perf_counter() - self._start],
                            dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(everyone, mine)
        else:
            everyone = [mine]
        for rank, t in enumerate(everyone):
            self.rows.append({"step": ctx.step, "rank": rank, "forward_s": float(t[0]),
                              "step_s": float(t[1])})


class SlowRank(Hook):
    """Sleep `delay_s` in every forward pass of rank `rank` during steps `first`..`last`
    (1-based, inclusive; None: to the end): a planted straggler."""

    def __init__(self, rank: int, delay_s: float, first: int = 1, last: int | None = None):
        if rank < 0 or delay_s < 0 or first < 1 or (last is not None and last < first):
            raise ValueError(f"need rank >= 0, delay_s >= 0 and 1 <= first <= last, got rank "
                             f"{rank}, delay_s {delay_s}, steps {first}..{last}")
        self.rank, self.delay_s, self.first, self.last = rank, delay_s, first, last
        self._step = 0

    def on_batches(self, step: int, batches: Batches) -> None:
        self._step = step
        return None

    def on_model(self, model: torch.nn.Module) -> None:
        here = dist.get_rank() if dist.is_initialized() else 0
        if here != self.rank or not self.delay_s:
            return

        def slow(*_: Any) -> None:
            if self.first <= self._step and (self.last is None or self._step <= self.last):
                time.sleep(self.delay_s)

        model.register_forward_hook(slow)


def stragglers(rows: list[dict[str, Any]], threshold: float = 1.5,
               steps: tuple[int, int] | None = None) -> list[dict[str, Any]]:
    """Ranks whose median forward time over `steps` (first, last; None: all steps but the
    first, which pays start-up costs) exceeds `threshold` times the median of the other
    ranks': [{"rank", "forward_s", "ratio"}], slowest first."""
    if threshold <= 1:
        raise ValueError(f"threshold must be > 1 (a ratio to the other ranks), got {threshold}")
    per_rank = summary(rows, steps)
    out = []
    for r in per_rank:
        others = [o["forward_s"] for o in per_rank if o["rank"] != r["rank"]]
        if not others:
            continue
        ratio = r["forward_s"] / statistics.median(others)
        if ratio > threshold:
            out.append({"rank": r["rank"], "forward_s": r["forward_s"], "ratio": ratio})
    return sorted(out, key=lambda r: -r["ratio"])


def summary(rows: list[dict[str, Any]],
            steps: tuple[int, int] | None = None) -> list[dict[str, Any]]:
    """Per rank, the medians of its forward and step times over `steps` (first, last,
    inclusive; None: every step after the first)."""
    lo, hi = steps if steps is not None else (2, max((r["step"] for r in rows), default=0))
    kept = [r for r in rows if lo <= r["step"] <= hi]
    out = []
    for rank in sorted({r["rank"] for r in kept}):
        mine = [r for r in kept if r["rank"] == rank]
        out.append({"rank": rank, "forward_s": statistics.median(r["forward_s"] for r in mine),
                    "step_s": statistics.median(r["step_s"] for r in mine)})
    return out
