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

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from . import harness

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class DataParallel(nn.Module):
    """`module` replicated over the ranks of `group` (default: all ranks)."""

    def __init__(self, module: nn.Module, bucket_mb: float = 25.0,
                 group: dist.ProcessGroup | None = None):
        super().__init__()
        if not dist.is_initialized():
            raise ValueError("DataParallel needs a process group: run under torchrun or "
                             "trainbook.launch.run")
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
        self.module, self.group, self.world = module, group, dist.get_world_size(group)
        self.sync, self.calls, self.bytes = True, 0, 0  # counters: all-reduce calls and bytes sent
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t.data, group=group, group_src=0)  # replicas start from the first's
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

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
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
            self._pending.append((i, flat, dist.all_reduce(flat, group=self.group, async_op=True)))
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


KINDS = ("scratch", "ddp")


@dataclass(kw_only=True)
class DataParallelRun(harness.Technique):
    """Each rank trains on its shard of every global batch, wrapped by `kind` ('scratch':
    `DataParallel` above, 'ddp': PyTorch's). With accumulation > 1 the shard is split into
    micro-batches and only the last one synchronises. Stats (scratch): all-reduce calls and
    bytes over the run, and the number of buckets."""

    kind: str = "scratch"
    accumulation: int = 1
    bucket_mb: float = 25.0
    mesh_dim: str = "dp"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be 'scratch' or 'ddp', got {self.kind!r}")
        if self.accumulation < 1:
            raise ValueError(f"accumulation must be >= 1, got {self.accumulation}")

    def build(self, setup: harness.Setup, mesh: DeviceMesh | None) -> None:
        if mesh is None:
            raise ValueError("data parallelism runs inside a process group: use "
                             "trainbook.launch.run(harness.sweep, nprocs, ...)")
        group = mesh["dp"].get_group()
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.inner = harness.build_model(setup)
        self.model = DataParallel(self.inner, self.bucket_mb, group) if self.kind == "scratch" \
            else nn.parallel.DistributedDataParallel(self.inner, bucket_cap_mb=self.bucket_mb,
                                                     process_group=group)
        self.optimizer = harness.make_optimizer(setup, self.inner.parameters())

    def local_batch(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = harness.shard((x, y), self.rank, self.world)
        if len(x) % self.accumulation:
            raise ValueError(f"{len(x)} sequences per rank do not split into "
                             f"{self.accumulation} micro-batches")
        return x, y

    def forward_backward(self, x: torch.Tensor,
                         y: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        total = torch.zeros(())
        for micro, (xm, ym) in enumerate(zip(x.chunk(self.accumulation),
                                             y.chunk(self.accumulation), strict=True)):
            last = micro == self.accumulation - 1
            with self.model.no_sync() if not last else nullcontext():
                logits, loss = self.model(xm, ym)
                (loss / self.accumulation).backward()
            total += loss.detach() / self.accumulation
        return logits, total

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.inner.named_parameters()

    def stats(self) -> dict:
        if self.kind != "scratch":
            return {}
        return {"allreduce_calls": self.model.calls, "allreduce_bytes": self.model.bytes,
                "buckets": len(self.model.buckets)}
