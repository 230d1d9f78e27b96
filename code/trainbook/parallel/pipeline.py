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
on the same stage modules for comparison.

Tied embeddings (the gpt2 flavour) put one matrix on the first and on the last stage; its two
gradient contributions are summed with an all-reduce between those two ranks after the backward
(as Megatron-LM does), so both copies take the same update.

Chapter: book/parallelism/pipeline-parallel.
"""

from __future__ import annotations

import socket
import time

import torch
import torch.distributed as dist
from torch import nn

from ..launch import rank_device
from ..model import lm_loss
from ..train.parallelize import Stage, split_model  # noqa: F401 (the one Stage, re-exported)
from . import harness

SCRATCH = ("gpipe", "1f1b")
NATIVE = ("native-gpipe", "native-1f1b", "native-interleaved", "native-zero-bubble")
KINDS = SCRATCH + NATIVE


def schedule_order(kind: str, p: int, m: int, stage: int) -> list[tuple[str, int]]:
    """The (op, micro-batch) order one stage runs: ("F", i) or ("B", i)."""
    if kind == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    if kind != "1f1b":
        raise ValueError(f"from-scratch schedule must be one of {SCRATCH}, got {kind!r}")
    warmup = min(p - 1 - stage, m)
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):  # steady state: one forward, then the oldest backward
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", i) for i in range(m - warmup, m)]


device = rank_device  # this rank's device: its GPU under NCCL, else the CPU


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class Events:
    """Per-rank timeline: (op, micro-batch, start, end) in seconds from a shared zero."""

    def __init__(self, rank: int):
        self.rank, self.rows = rank, []
        dist.barrier()  # ranks leave the barrier at nearly the same time: the common zero
        here = (socket.gethostname(), time.perf_counter())
        zeros = [None] * dist.get_world_size()
        dist.all_gather_object(zeros, here)
        # perf_counter is one monotonic clock per machine: on one host take rank 0's zero
        # exactly; across hosts the barrier is the best alignment (skew ~ its latency)
        self.t0 = zeros[0][1] if zeros[0][0] == here[0] else here[1]

    def timed(self, op: str, mb: int, fn, *args, stage: int | None = None):
        _sync()
        start = time.perf_counter() - self.t0
        out = fn(*args)
        _sync()  # on a GPU the kernels run asynchronously: wait before reading the clock
        self.rows.append({"rank": self.rank, "stage": self.rank if stage is None else stage,
                          "op": op, "mb": mb, "start": start,
                          "end": time.perf_counter() - self.t0})
        return out


def scratch_step(stage: Stage, x, y, kind: str, m: int, events: Events | None = None) -> dict:
    """One pipeline step of the from-scratch schedule `kind` on this rank's stage.

    x, y: the whole global batch (every rank has the data; only the ends use it). Returns the
    micro-batch losses (last stage) and the peak number of micro-batches in flight (forward done,
    backward not yet). Gradients accumulate in the stage's parameters.
    """
    rank, p = dist.get_rank(), dist.get_world_size()
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
            dist.recv(inp, src=rank - 1)
            inp.requires_grad_()
        if stage.is_last:  # each micro-batch carries 1/m of the mean loss
            out = timed("F", i, lambda: lm_loss(stage(inp), ys[i]) / m)
            losses[i] = out.detach() * m
        else:
            out = timed("F", i, stage, inp)
            sends.append(dist.isend(out.detach().contiguous(), dst=rank + 1))
        saved[i] = (inp, out)

    def backward(i):
        inp, out = saved.pop(i)
        grad = None
        if not stage.is_last:
            grad = torch.empty(shape, device=x.device)
            dist.recv(grad, src=rank + 1)
        timed("B", i, out.backward, grad)
        if not stage.is_first:
            sends.append(dist.isend(inp.grad.contiguous(), dst=rank - 1))

    for op, i in schedule_order(kind, p, m, rank):
        (forward if op == "F" else backward)(i)
        peak = max(peak, len(saved))
    for work in sends:
        work.wait()
    return {"losses": losses, "in_flight": peak}


def _d_model(stage: Stage) -> int:
    return next(iter(stage.blocks.values())).attn.o.out_features


def sync_tied(stage_modules: list[Stage], first_and_last) -> None:
    """Sum the tied embedding/head gradient over the ranks holding the first and the last stage."""
    for st in stage_modules:
        if st.tied and (st.is_first or st.is_last):
            w = st.embed.weight if st.is_first else st.head.weight
            if w.grad is None:
                w.grad = torch.zeros_like(w)
            dist.all_reduce(w.grad, group=first_and_last)


# ---------------------------------------------------------------------------------------------
# Native: torch.distributed.pipelining
# ---------------------------------------------------------------------------------------------

def native_stage_indices(kind: str, p: int, rank: int) -> tuple[int, list[int]]:
    """(number of stages, the stage indices this rank holds) for a native schedule."""
    if kind in ("native-gpipe", "native-1f1b"):
        return p, [rank]
    if kind == "native-interleaved":  # loop: rank r holds r, r + p
        return 2 * p, [rank, rank + p]
    if kind == "native-zero-bubble":  # V shape (ZBV): rank r holds r and 2p - 1 - r
        return 2 * p, [rank, 2 * p - 1 - rank]
    raise ValueError(f"native schedule must be one of {NATIVE}, got {kind!r}")


def native_schedule(kind: str, stages: list, m: int):
    """The torch.distributed.pipelining schedule object for `kind` over this rank's stages."""
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleZBVZeroBubble,
    )
    if kind == "native-gpipe":
        return ScheduleGPipe(stages[0], m, loss_fn=lm_loss)
    if kind == "native-1f1b":
        return Schedule1F1B(stages[0], m, loss_fn=lm_loss)
    if kind == "native-interleaved":
        return ScheduleInterleaved1F1B(stages, m, loss_fn=lm_loss)
    return ScheduleZBVZeroBubble(stages, m, loss_fn=lm_loss)


def _time_native(stage, events: Events) -> None:
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


def planned(sched) -> dict[int, list[str | None]]:
    """A native schedule's planned compute actions per rank ("0F1": stage 0, forward,
    micro-batch 1; "I"/"W": the input and weight halves of a split backward; None: an idle
    slot). This is the plan every rank computes, not a measurement."""
    order = sched.pipeline_order or {}
    return {r: [None if a is None else str(a) for a in acts if a is None or a.is_compute_op]
            for r, acts in order.items()}


def _check_microbatches(kind: str, p: int, m: int) -> None:
    if m < 1:
        raise ValueError(f"microbatches must be >= 1, got {m}")
    if kind == "1f1b" and m < p:
        raise ValueError(f"1F1B with {p} stages needs at least {p} micro-batches to reach its "
                         f"steady state, got {m}; raise microbatches")
    if kind in ("native-interleaved", "native-zero-bubble") and m < p:
        raise ValueError(f"{kind} needs microbatches >= {p} stages per round, got {m}")


# ---------------------------------------------------------------------------------------------
# One run per rank, and a sweep
# ---------------------------------------------------------------------------------------------

def _build(setup: harness.Setup, kind: str, m: int):
    """This rank's stage modules and a function that runs one pipeline step on them."""
    rank, p = dist.get_rank(), dist.get_world_size()
    model = harness.build_model(setup).to(device())
    first_and_last = dist.new_group([0, p - 1]) if model.cfg.tied and p > 1 else None
    if kind in SCRATCH:
        stages, sched = [split_model(model, p, rank)], None

        def step(x, y, events=None):
            out = scratch_step(stages[0], x, y, kind, m, events)
            return out["losses"], out["in_flight"]
    else:
        from torch.distributed.pipelining import PipelineStage

        n_stages, idx = native_stage_indices(kind, p, rank)
        stages = [split_model(model, n_stages, i) for i in idx]
        pipes = [PipelineStage(st, i, n_stages, device()) for st, i in zip(stages, idx)]
        sched = native_schedule(kind, pipes, m)
        holds_first, holds_last = 0 in idx, n_stages - 1 in idx

        def step(x, y, events=None):
            if events is not None:
                for pipe in pipes:
                    _time_native(pipe, events)
            losses = [] if holds_last else None
            sched.step(*((x,) if holds_first else ()), target=y if holds_last else None,
                       losses=losses, return_outputs=False)
            for pipe in pipes:  # drop the timing wrappers again
                for name in ("forward_one_chunk", "backward_one_chunk",
                             "backward_weight_one_chunk"):
                    pipe.__dict__.pop(name, None)
            return ([t.detach() for t in losses] if holds_last else [None] * m), None
    del model

    def train_step(x, y, events=None):
        losses, in_flight = step(x, y, events)
        if first_and_last is not None:
            sync_tied(stages, first_and_last)
        return losses, in_flight

    return stages, train_step, (planned(sched) if sched is not None else None)


def validate(setup: harness.Setup, kind: str, microbatches: int, ranks: int) -> None:
    """Reject a layout the schedule cannot run, before any process starts waiting on another."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if ranks < 2:
        raise ValueError(f"a pipeline needs at least 2 ranks, got {ranks}")
    _check_microbatches(kind, ranks, microbatches)
    n_stages = native_stage_indices(kind, ranks, 0)[0] if kind in NATIVE else ranks
    if setup.n_layers % n_stages:
        raise ValueError(f"{setup.n_layers} layers do not split into {n_stages} equal stages "
                         f"({kind} on {ranks} ranks); use a multiple of {n_stages} layers")
    if setup.global_batch % microbatches:
        raise ValueError(f"global batch {setup.global_batch} does not split into "
                         f"{microbatches} micro-batches")


def _last_rank(kind: str, p: int) -> int:
    return 0 if kind == "native-zero-bubble" else p - 1


def run_pipeline(setup: harness.Setup, kind: str = "1f1b", microbatches: int = 4,
                 memory: bool = False) -> dict:
    """Train `setup` with pipeline schedule `kind` over all ranks of the process group.

    Returns (the same on every rank): the trace (losses, first-step gradients and final
    parameters under the reference names, gathered from all stages), the last step's measured
    events of every rank, the peak micro-batches in flight per rank (scratch schedules) and,
    with memory=True, each rank's peak tensor bytes by category for one extra step.
    """
    if not dist.is_initialized():
        raise ValueError("run_pipeline needs a process group: use trainbook.launch.run")
    rank, p = dist.get_rank(), dist.get_world_size()
    validate(setup, kind, microbatches, p)
    stages, train_step, plan = _build(setup, kind, microbatches)
    params = [q for st in stages for q in st.parameters()]
    opt = harness.make_optimizer(setup, params)
    losses, first, events, in_flight = [], {}, [], None
    batches = [(x.to(device()), y.to(device())) for x, y in harness.global_batches(setup)]
    for s, (x, y) in enumerate(batches):
        last = s == setup.steps - 1  # time the last step: the first includes set-up work
        ev = Events(rank) if last else None
        mb_losses, peak = train_step(x, y, ev)
        if s == 0:
            first = _named(stages, grads=True)
        if last:
            events, in_flight = ev.rows, peak
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = torch.zeros((), device=device())
        if mb_losses[0] is not None:  # this rank holds the last stage
            loss = torch.stack(mb_losses).mean()
        dist.broadcast(loss, src=_last_rank(kind, p))
        losses.append(loss.item())
    trace = harness.Trace(losses, _gather(first), _gather(_named(stages, grads=False)))
    out = {"trace": trace, "events": _all(events), "in_flight": _all(in_flight),
           "kind": kind, "microbatches": microbatches, "ranks": p, "planned": plan}
    if memory:
        out["memory"] = _all(_measure(stages, opt, train_step, *batches[0]))
    return out


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


def _measure(stages, opt, train_step, x, y) -> dict:
    from ..bench.memory_measure import tracked_peak

    def step(model, optimizer, xb, yb):
        train_step(xb, yb)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return tracked_peak(nn.ModuleList(stages), opt, x, y, step=step, tracker_cls=_tracker_cls())


def _named(stages: list[Stage], grads: bool) -> dict[str, torch.Tensor]:
    """Reference-named tensors of this rank's stages (a tied head is the embedding: left out)."""
    out = {}
    for st in stages:
        for name, q in st.named_parameters():
            if st.tied and name == "head.weight":
                continue
            t = q.grad if grads else q
            out[name] = (torch.zeros_like(q) if t is None else t).detach().cpu().clone()
    return out


def _all(obj):
    """Every rank's object, in rank order (a list of p)."""
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, obj)
    return got


def _gather(named: dict) -> dict:
    merged = {}
    for part in _all(named):
        merged.update(part)
    return merged


def sweep(setup: harness.Setup, variants: list[dict]) -> list[dict]:
    """run_pipeline once per variant (its keyword arguments), in one process group."""
    return [run_pipeline(setup, **v) for v in variants]


# ---------------------------------------------------------------------------------------------
# Bubble arithmetic and timeline measurements
# ---------------------------------------------------------------------------------------------

def bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """Idle fraction of a step for GPipe/1F1B with p stages and m micro-batches, equal stage
    times: (p - 1) / (v m + p - 1); with v interleaved chunks per rank the bubble shrinks v-fold
    relative to compute (Narayanan et al. 2021, SC21, "Efficient Large-Scale Language Model
    Training on GPU Clusters Using Megatron-LM", Section 2.2)."""
    for name, val in (("p", p), ("m", m), ("v", v)):
        if not isinstance(val, int) or val < 1:
            raise ValueError(f"{name} must be a positive integer, got {val!r}")
    return (p - 1) / (v * m + p - 1)


def bubble_over_compute(p: int, m: int, v: int = 1) -> float:
    """The bubble relative to the ideal compute time: (p - 1) / (v m)."""
    bubble_fraction(p, m, v)
    return (p - 1) / (v * m)


def idle_fraction(events: list[list[dict]]) -> float:
    """Measured idle share: 1 - busy / (ranks x span), span from the first start to the last end."""
    rows = [r for per_rank in events for r in per_rank]
    if not rows:
        raise ValueError("no events recorded")
    span = max(r["end"] for r in rows) - min(r["start"] for r in rows)
    busy = sum(r["end"] - r["start"] for r in rows)
    return 1 - busy / (len(events) * span)


def stage_activation_bytes(cfg, stage: int, p: int, in_flight: int, micro_batch: int,
                           seq_len: int, dtype: str = "fp32") -> float:
    """Stored activations of one stage: in-flight micro-batches x its layers' bytes
    (`compute.memory.reference_layer_bytes`), plus the last stage's final-norm and logits."""
    from ..compute import memory

    if cfg.n_layers % p:
        raise ValueError(f"{cfg.n_layers} layers do not split into {p} stages")
    per_mb = cfg.n_layers // p * memory.reference_layer_bytes(cfg, micro_batch, seq_len, dtype)
    if stage == p - 1:  # final norm (3 tensors) and the fp32 log-softmax the loss keeps
        per_mb += micro_batch * seq_len * (3 * cfg.d_model + cfg.vocab_size) * 4
    return in_flight * per_mb
