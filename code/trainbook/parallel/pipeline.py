"""Pipeline parallelism from scratch: cut the model into stages, stream micro-batches through them.

The reference model is cut by layers into `p` stages, one per rank: the first also embeds the
tokens, the last also applies the final norm, the head and the loss. A global batch is split into
`m` micro-batches. A stage's forward receives an activation from the previous rank, runs its
blocks and sends the result on; its backward receives the gradient of that output from the next
rank and sends the gradient of its input back. Gradients of a stage's weights accumulate over the
micro-batches (each loss scaled by 1/m), so one optimizer step sees the gradient of the whole
global batch, exactly as one process would.

Two schedules, the only difference is the order of the same F and B operations on each rank:

- GPipe (Huang et al. 2019): all m forwards, then all m backwards. Every stage holds the
  activations of all m micro-batches at once.
- 1F1B as PipeDream-Flush runs it (Narayanan et al. 2021, ICML, "Memory-Efficient
  Pipeline-Parallel DNN Training"; synchronous, unlike PipeDream's 1F1B of 2019): p - 1 - stage
  warm-up forwards, then alternate one forward and one backward, then drain the remaining
  backwards, and flush before the optimizer step. Stage s holds at most p - s micro-batches.

Both leave the same bubble, (p - 1) idle slots per rank out of m + p - 1. Every F and B is timed
(perf_counter, zero at a barrier), so the timelines in the book are measured, not drawn. The
native `torch.distributed.pipelining` schedules (GPipe, 1F1B, interleaved 1F1B, zero bubble) run
on the same stage modules for comparison. `PipelineRun` trains any of them through the teaching
loop over the mesh's "pp" ranks; the orders and the bubble arithmetic are in
`pipeline_schedules`.

Tied embeddings (the gpt2 flavour) put one matrix on the first and on the last stage; its two
gradient contributions are summed with an all-reduce between those two ranks after the backward
(as Megatron-LM does), so both copies take the same update.

Chapter: book/parallelism/pipeline-parallel.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ..launch import rank_device
from ..model import lm_loss
from ..train.parallelize import Stage, split_model  # noqa: F401 (the one Stage, re-exported)
from . import harness
from .pipeline_schedules import (
    KINDS,
    NATIVE,
    SCRATCH,
    check_microbatches,
    native_schedule,
    native_stage_indices,
    planned,
    schedule_order,
)

if TYPE_CHECKING:
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.pipelining import PipelineStage


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class Events:
    """Per-rank timeline: (op, micro-batch, start, end) in seconds from a shared zero."""

    def __init__(self, rank: int, group: dist.ProcessGroup | None = None):
        self.rank, self.rows = rank, []
        dist.barrier(group=group)  # ranks leave the barrier at nearly the same time: a common 0
        here = (socket.gethostname(), time.perf_counter())
        zeros = [None] * dist.get_world_size(group)
        dist.all_gather_object(zeros, here, group=group)
        # perf_counter is one monotonic clock per machine: on one host take rank 0's zero
        # exactly; across hosts the barrier is the best alignment (skew ~ its latency)
        self.t0 = zeros[0][1] if zeros[0][0] == here[0] else here[1]

    def timed(self, op: str, mb: int, fn: Callable[..., Any], *args: Any,
              stage: int | None = None) -> Any:
        _sync()
        start = time.perf_counter() - self.t0
        out = fn(*args)
        _sync()  # on a GPU the kernels run asynchronously: wait before reading the clock
        self.rows.append({"rank": self.rank, "stage": self.rank if stage is None else stage,
                          "op": op, "mb": mb, "start": start,
                          "end": time.perf_counter() - self.t0})
        return out


def scratch_step(stage: Stage, x: torch.Tensor, y: torch.Tensor, kind: str, m: int,
                 events: Events | None = None, group: dist.ProcessGroup | None = None) -> dict:
    """One pipeline step of the from-scratch schedule `kind` on this rank's stage.

    x, y: the whole global batch (every rank has the data; only the ends use it). Returns the
    micro-batch losses (last stage) and the peak number of micro-batches in flight (forward done,
    backward not yet). Gradients accumulate in the stage's parameters. `group`: the pipeline's
    ranks in stage order (default: all ranks).
    """
    rank, p = dist.get_rank(group), dist.get_world_size(group)
    if len(x) % m:
        raise ValueError(f"global batch {len(x)} does not split into {m} micro-batches")
    xs, ys = x.chunk(m), y.chunk(m)
    shape = (len(xs[0]), x.shape[1], _d_model(stage))
    saved: dict[int, tuple] = {}  # micro-batch -> (input that needs a gradient, output or loss)
    sends, losses, peak = [], [None] * m, 0

    def timed(op, i, fn, *args):  # only compute is timed: waiting in recv is idle time
        return events.timed(op, i, fn, *args) if events else fn(*args)

    def forward(i):
        if stage.is_first:
            inp = xs[i]
        else:
            inp = torch.empty(shape, device=x.device)
            dist.recv(inp, group=group, group_src=rank - 1)
            inp.requires_grad_()
        if stage.is_last:  # each micro-batch carries 1/m of the mean loss
            out = timed("F", i, lambda: lm_loss(stage(inp), ys[i]) / m)
            losses[i] = out.detach() * m
        else:
            out = timed("F", i, stage, inp)
            sends.append(dist.isend(out.detach().contiguous(), group=group, group_dst=rank + 1))
        saved[i] = (inp, out)

    def backward(i):
        inp, out = saved.pop(i)
        grad = None
        if not stage.is_last:
            grad = torch.empty(shape, device=x.device)
            dist.recv(grad, group=group, group_src=rank + 1)
        timed("B", i, out.backward, grad)
        if not stage.is_first:
            sends.append(dist.isend(inp.grad.contiguous(), group=group, group_dst=rank - 1))

    for op, i in schedule_order(kind, p, m, rank):
        (forward if op == "F" else backward)(i)
        peak = max(peak, len(saved))
    for work in sends:
        work.wait()
    return {"losses": losses, "in_flight": peak}


def _d_model(stage: Stage) -> int:
    return next(iter(stage.blocks.values())).attn.o.out_features


def sync_tied(stage_modules: list[Stage], first_and_last: dist.ProcessGroup) -> None:
    """Sum the tied embedding/head gradient over the ranks holding the first and the last stage."""
    for st in stage_modules:
        if st.tied and (st.is_first or st.is_last):
            w = st.embed.weight if st.is_first else st.head.weight
            if w.grad is None:
                w.grad = torch.zeros_like(w)
            dist.all_reduce(w.grad, group=first_and_last)


# ---------------------------------------------------------------------------------------------
# Training through the teaching loop
# ---------------------------------------------------------------------------------------------

def time_native(stage: PipelineStage, events: Events) -> None:
    """Wrap a PipelineStage's per-micro-batch compute calls so they land on the timeline."""
    fwd, bwd = stage.forward_one_chunk, stage.backward_one_chunk
    bww = stage.backward_weight_one_chunk

    s = stage.stage_index

    def forward_one_chunk(i, *a, **k):
        return events.timed("F", i, lambda: fwd(i, *a, **k), stage=s)

    def backward_one_chunk(i, *a, **k):
        op = "B" if k.get("full_backward", True) else "I"
        return events.timed(op, i, lambda: bwd(i, *a, **k), stage=s)

    def backward_weight_one_chunk(i, *a, **k):
        return events.timed("W", i, lambda: bww(i, *a, **k), stage=s)

    stage.forward_one_chunk, stage.backward_one_chunk = forward_one_chunk, backward_one_chunk
    stage.backward_weight_one_chunk = backward_weight_one_chunk


def _all(obj, group=None) -> list:
    """Every rank's object, in rank order."""
    got = [None] * dist.get_world_size(group)
    dist.all_gather_object(got, obj, group=group)
    return got


def _tracker_cls():
    """MemTracker that accepts a stage being called once per micro-batch.

    MemTracker refuses a root module that runs forward twice (it takes that for a second
    iteration); a pipeline stage does so m times per step by design. Forgetting the stage's
    per-module statistics before each call keeps the global peak, which is all we read."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class PipelineMemTracker(MemTracker):
        def _pre_fw_hook(self, module, inputs):
            if isinstance(module, Stage):
                self.memory_tracking.pop(module, None)
            return super()._pre_fw_hook(module, inputs)

    return PipelineMemTracker


@dataclass(kw_only=True)
class PipelineRun(harness.Technique):
    """The reference model cut into stages over the mesh's "pp" ranks, the global batch in
    `microbatches` micro-batches, scheduled by `kind` (from scratch: gpipe, 1f1b; native:
    torch.distributed.pipelining). Every rank returns the same trace, gathered from all
    stages. Stats: every rank's timeline of the last step (`events`), the peak micro-batches in
    flight per rank (scratch schedules) and the native schedule's plan."""

    kind: str = "1f1b"
    microbatches: int = 4
    mesh_dim: str = "pp"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")

    def build(self, setup: harness.Setup, mesh: DeviceMesh | None) -> None:
        if mesh is None:
            raise ValueError("a pipeline needs a process group: use "
                             "trainbook.launch.run(harness.sweep, nprocs, ...)")
        self.group = group = mesh["pp"].get_group()
        rank, p = dist.get_rank(group), dist.get_world_size(group)
        validate(setup, self.kind, self.microbatches, p)
        self.steps, self.step_index, self.events, self.in_flight = setup.steps, 0, [], None
        model = harness.build_model(setup).to(rank_device())
        ends = [dist.get_global_rank(group, 0), dist.get_global_rank(group, p - 1)]
        self.first_and_last = dist.new_group(ends) if model.cfg.tied and p > 1 else None
        self.plan = None
        if self.kind in SCRATCH:
            self.stages = [split_model(model, p, rank)]
        else:
            from torch.distributed.pipelining import PipelineStage

            n_stages, idx = native_stage_indices(self.kind, p, rank)
            self.stages = [split_model(model, n_stages, i) for i in idx]
            self.pipes = [PipelineStage(st, i, n_stages, rank_device(), group=group)
                          for st, i in zip(self.stages, idx)]
            self.schedule = native_schedule(self.kind, self.pipes, self.microbatches)
            self.holds = (0 in idx, n_stages - 1 in idx)
            self.plan = planned(self.schedule)
        self.model = nn.ModuleList(self.stages)  # what the memory tracker follows
        self.optimizer = harness.make_optimizer(setup, self.model.parameters())

    def _native_step(self, x, y, events):
        if events is not None:
            for pipe in self.pipes:
                time_native(pipe, events)
        first, last = self.holds
        losses = [] if last else None
        self.schedule.step(*((x,) if first else ()), target=y if last else None,
                           losses=losses, return_outputs=False)
        for pipe in self.pipes:  # drop the timing wrappers again
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                pipe.__dict__.pop(name, None)
        return ([t.detach() for t in losses] if last else [None]), None

    def pipeline_step(self, x: torch.Tensor, y: torch.Tensor, events: Events | None = None
                      ) -> tuple[list[torch.Tensor | None], int | None]:
        """Forward and backward of every micro-batch: (micro-batch losses or [None], peak in
        flight); the tied embedding's two gradients summed."""
        if self.kind in SCRATCH:
            out = scratch_step(self.stages[0], x, y, self.kind, self.microbatches, events,
                               self.group)
            losses, peak = out["losses"], out["in_flight"]
        else:
            losses, peak = self._native_step(x, y, events)
        if self.first_and_last is not None:
            sync_tied(self.stages, self.first_and_last)
        return losses, peak

    def forward_backward(self, x: torch.Tensor,
                         y: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        last = self.step_index == self.steps - 1  # time the last step: the first sets up
        events = Events(dist.get_rank(self.group), self.group) if last else None
        losses, peak = self.pipeline_step(x, y, events)
        if last:
            self.events, self.in_flight = events.rows, peak
        self.step_index += 1
        if losses[0] is None:  # this rank does not hold the last stage
            return None, torch.zeros((), device=rank_device())
        return None, torch.stack(losses).mean()

    def global_loss(self, loss: torch.Tensor) -> float:
        """The last stage's loss, shared with every rank of the pipeline."""
        loss = loss.detach().clone()
        dist.broadcast(loss, group=self.group, group_src=_last_rank(self.kind, self.mesh.size()))
        return loss.item()

    def _named(self, grads: bool) -> dict[str, torch.Tensor]:
        """Reference-named tensors of every stage, gathered from all ranks (a tied head is the
        embedding: left out)."""
        mine = {}
        for st in self.stages:
            for name, q in st.named_parameters():
                if st.tied and name == "head.weight":
                    continue
                t = q.grad if grads else q
                mine[name] = harness.full_tensor(torch.zeros_like(q) if t is None else t)
        merged = {}
        for part in _all(mine, self.group):
            merged.update(part)
        return merged

    def gradients(self) -> dict[str, torch.Tensor]:
        return self._named(grads=True)

    def parameters(self) -> dict[str, torch.Tensor]:
        return self._named(grads=False)

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.pipeline_step(x, y)
        self.optimizer_step()

    def memory_tracker_cls(self) -> type[MemTracker]:
        return _tracker_cls()

    def stats(self) -> dict:
        return {"events": _all(self.events, self.group),
                "in_flight": _all(self.in_flight, self.group), "planned": self.plan,
                "microbatches": self.microbatches, "ranks": self.mesh.size()}


def validate(setup: harness.Setup, kind: str, microbatches: int, ranks: int) -> None:
    """Reject a layout the schedule cannot run, before any process starts waiting on another."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if ranks < 2:
        raise ValueError(f"a pipeline needs at least 2 ranks, got {ranks}")
    check_microbatches(kind, ranks, microbatches)
    n_stages = native_stage_indices(kind, ranks, 0)[0] if kind in NATIVE else ranks
    if setup.n_layers % n_stages:
        raise ValueError(f"{setup.n_layers} layers do not split into {n_stages} equal stages "
                         f"({kind} on {ranks} ranks); use a multiple of {n_stages} layers")
    if setup.global_batch % microbatches:
        raise ValueError(f"global batch {setup.global_batch} does not split into "
                         f"{microbatches} micro-batches")


def _last_rank(kind: str, p: int) -> int:
    return 0 if kind == "native-zero-bubble" else p - 1
