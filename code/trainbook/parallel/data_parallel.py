"""Data parallelism from scratch: replicate the model, all-reduce gradient buckets during backward.

`DataParallel` does what `torch.nn.parallel.DistributedDataParallel` does, in one readable class:
rank 0's weights are broadcast so every replica starts equal; parameters are grouped into buckets
of about `bucket_mb` MiB in reverse registration order (roughly the order backward produces their
gradients); a hook on each parameter fires when its gradient is accumulated, and the moment a
bucket is complete its all-reduce is launched asynchronously, so communication overlaps with the
rest of backward. At the end of backward (an autograd-engine callback) the reductions are awaited
and the averaged gradients copied back. `no_sync()` skips all of it for accumulation micro-steps.

Chapter: book/parallelism/data-parallel.
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from torch import nn

from . import harness


class DataParallel(nn.Module):
    def __init__(self, module: nn.Module, bucket_mb: float = 25.0):
        super().__init__()
        if not dist.is_initialized():
            raise ValueError("DataParallel needs a process group: run under torchrun or "
                             "trainbook.launch.run")
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
        self.module, self.world = module, dist.get_world_size()
        self.sync, self.calls, self.bytes = True, 0, 0  # counters: all-reduce calls and bytes sent
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t.data, src=0)  # every replica starts from rank 0's weights
        params = [p for p in module.parameters() if p.requires_grad]
        self.buckets: list[list[nn.Parameter]] = [[]]
        size = 0
        for p in reversed(params):  # backward produces the last layers' gradients first
            if size and size + p.numel() * p.element_size() > bucket_mb * 2**20:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += p.numel() * p.element_size()
        self._bucket_of = {p: i for i, b in enumerate(self.buckets) for p in b}
        self._pending: list = []
        self._ready: list[int] = [0] * len(self.buckets)
        self._queued = False
        for p in params:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally (no communication) inside this block."""
        self.sync = False
        try:
            yield
        finally:
            self.sync = True

    def _grad_ready(self, p: nn.Parameter) -> None:
        if not self.sync:
            return
        if not self._queued:  # once per backward: finish the reductions when backward ends
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._queued = True
        i = self._bucket_of[p]
        self._ready[i] += 1
        if self._ready[i] == len(self.buckets[i]):  # the bucket is complete: reduce it now
            flat = torch.cat([q.grad.reshape(-1) for q in self.buckets[i]])
            self._pending.append((i, flat, dist.all_reduce(flat, async_op=True)))
            self.calls, self.bytes = self.calls + 1, self.bytes + flat.numel() * flat.element_size()

    def _finish(self) -> None:
        for i, flat, work in self._pending:
            work.wait()
            flat /= self.world  # sum -> mean: each rank's loss is a mean over its shard
            offset = 0
            for q in self.buckets[i]:
                q.grad.copy_(flat[offset:offset + q.numel()].view_as(q.grad))
                offset += q.numel()
        self._pending, self._ready, self._queued = [], [0] * len(self.buckets), False


def run_data_parallel(setup: harness.Setup, kind: str = "scratch", accumulation: int = 1,
                      bucket_mb: float = 25.0) -> dict:
    """Train on this rank's shard of each global batch, wrapped by `kind` ('scratch' or 'ddp').

    With accumulation > 1 each rank splits its shard into micro-batches and syncs only on the
    last one. Returns the trace, this rank's communication counters (scratch only) and the
    median seconds per step (the first step, which allocates, left out).
    """
    if kind not in ("scratch", "ddp"):
        raise ValueError(f"kind must be 'scratch' or 'ddp', got {kind!r}")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = harness.build_model(setup)
    if kind == "scratch":
        wrapped = DataParallel(model, bucket_mb)
    else:
        wrapped = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
    opt = harness.make_optimizer(setup, model.parameters())
    losses, first, times = [], {}, []
    for step, batch in enumerate(harness.global_batches(setup)):
        t0 = time.perf_counter()
        x, y = harness.shard(batch, rank, world)
        if len(x) % accumulation:
            raise ValueError(f"{len(x)} sequences per rank do not split into {accumulation} "
                             "micro-batches")
        total = torch.zeros(())
        for micro, (xm, ym) in enumerate(zip(x.chunk(accumulation), y.chunk(accumulation))):
            last = micro == accumulation - 1
            with (wrapped.no_sync() if not last else nullcontext()):
                _, loss = wrapped(xm, ym)
                (loss / accumulation).backward()
            total += loss.detach() / accumulation
        if step == 0:
            first = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        dist.all_reduce(total)
        losses.append(total.item() / world)
    trace = harness.Trace(losses, first,
                          {n: p.detach().clone() for n, p in model.named_parameters()})
    calls = wrapped.calls if kind == "scratch" else None
    sent = wrapped.bytes if kind == "scratch" else None
    return {"trace": trace, "allreduce_calls": calls, "allreduce_bytes": sent,
            "buckets": len(wrapped.buckets) if kind == "scratch" else None,
            "step_seconds": sorted(times[1:] or times)[len(times[1:] or times) // 2]}  # median


def sweep(setup: harness.Setup, variants: list[dict], fn=None) -> list[dict]:
    """fn (default run_data_parallel) once per variant (its keyword arguments), in one process
    group: one launch instead of many, since starting processes costs more than these tiny runs."""
    return [(fn or run_data_parallel)(setup, **v) for v in variants]


def measure_rank_memory(setup: harness.Setup, kind: str = "ddp", bucket_mb: float = 25.0) -> dict:
    """This rank's peak tensor bytes, by category, for one steady-state step of data parallelism
    (MemTracker; see trainbook.bench.memory_measure). Every rank holds a full replica.

    kind: 'scratch' or 'ddp'. DDP allocates its gradient buckets once and keeps them: one more
    copy of the gradients for the whole run (with gradient_as_bucket_view=True the gradients
    become views into them instead of a second copy; the buckets stay).
    """
    from ..bench.memory_measure import tracked_peak

    if kind not in ("scratch", "ddp"):
        raise ValueError(f"kind must be 'scratch' or 'ddp', got {kind!r}")
    model = harness.build_model(setup)
    wrapped = DataParallel(model, bucket_mb) if kind == "scratch" else \
        nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
    opt = harness.make_optimizer(setup, model.parameters())
    x, y = harness.shard(harness.global_batches(setup)[0], dist.get_rank(), dist.get_world_size())

    def step(_model, optimizer, xb, yb):
        logits, loss = wrapped(xb, yb)  # logits stay alive through backward, as in train.train
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del logits

    return tracked_peak(wrapped, opt, x, y, step=step)
