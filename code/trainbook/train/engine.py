"""How one optimizer step runs under a layout: the part of the trainer that parallelism changes.

`Plain` is one process, or DDP under torchrun (every rank a full replica): the reference path,
which resumes bit for bit. `Composed` runs any layout of FSDP/HSDP, tensor (+ sequence) and
pipeline parallelism built by `parallelize`. Both expose the same four operations to the
training loop: `step` (forward and backward over the step's micro-batches), `clip`,
`global_loss` (the mean over the ranks that hold a loss) and `evaluate`.

Chapter: book/parallelism/putting-it-together.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from ..layout import Layout
from . import parallelize as par

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a replicated loss under TP), or the tensor itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def global_loss(loss: torch.Tensor | None, device: torch.device) -> float:
    """The mean of the losses held across ranks (pipeline ranks without the last stage hold
    none). One all-reduce of (sum, count); gloo has no ReduceOp.AVG."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return loss.item()
    pair = torch.stack([loss.detach().float() if loss is not None else
                        torch.zeros((), device=device), torch.tensor(float(loss is not None),
                                                                     device=device)])
    dist.all_reduce(pair)
    return (pair[0] / pair[1]).item()


class Plain:
    """One process, or DDP: each micro-batch forward and backward, gradients synchronised on
    the last one only (`no_sync`), loss scaled for fp16."""

    def __init__(self, model: nn.Module, train_model: nn.Module, ddp_enabled: bool,
                 autocast: Callable[[], AbstractContextManager], scaler: torch.amp.GradScaler):
        self.model, self.train_model, self.ddp = model, train_model, ddp_enabled
        self.autocast, self.scaler = autocast, scaler
        self.parts = [model]

    def step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        loss_sum = None
        for micro, (x, y) in enumerate(batches):
            sync = not self.ddp or micro == len(batches) - 1
            with (nullcontext() if sync else self.train_model.no_sync()), self.autocast():
                _, loss = self.train_model(x, y)
            self.scaler.scale(loss / len(batches)).backward()
            loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
        return loss_sum / len(batches)

    def clip(self, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """The global gradient norm, gradients clipped to `max_norm` (inf: only measured, so an
        overflowing norm cannot turn every gradient into inf/inf = NaN)."""
        self.scaler.unscale_(optimizer)
        if max_norm == float("inf"):
            return torch.nn.utils.get_total_norm(
                [p.grad for p in self.model.parameters() if p.grad is not None])
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    @torch.no_grad()
    def evaluate(self, blocks: torch.Tensor, batch_size: int, batches: int,
                 device: torch.device) -> float:
        """Mean loss over the first `batches` batches of `blocks` (a fixed, comparable set)."""
        return evaluate(self.model, blocks, batch_size, batches, device, self.autocast,
                         nullcontext)


class Composed:
    """FSDP/HSDP x TP x PP: the parts this rank holds, a pipeline schedule when pp > 1."""

    def __init__(self, model: nn.Module, layout: Layout, mesh: DeviceMesh, device: torch.device,
                 autocast: Callable[[], AbstractContextManager], n_microbatches: int):
        self.layout, self.mesh, self.device, self.autocast = layout, mesh, device, autocast
        self.pp_rank = mesh.get_local_rank("pp")
        self.parts = par.parallelize(model, layout, mesh, self.pp_rank)
        self.schedule = None
        if layout.pp > 1:
            self.schedule = par.pipeline_schedule(self.parts, layout, mesh, device,
                                                  n_microbatches, self.pp_rank)
        self.first = any(getattr(p, "is_first", True) for p in self.parts)
        self.last = any(getattr(p, "is_last", True) for p in self.parts)
        self.fsdp = layout.dp > 1  # every dp layout of a composed run goes through FSDP2

    def loss_context(self) -> AbstractContextManager:
        """Vocabulary-parallel loss on sharded logits (TP without PP; with PP the head returns
        whole logits for the schedule's loss)."""
        if self.layout.tp > 1 and self.layout.pp == 1:
            from torch.distributed.tensor.parallel import loss_parallel
            return loss_parallel()
        return nullcontext()

    def _pipeline(self, run, x, y):
        """One schedule call on this rank's stages: inputs on the first, targets on the last."""
        losses: list = []
        args = (x,) if self.first else ()
        kwargs = dict(target=y, losses=losses) if self.last else {}
        with self.autocast():
            run(*args, **kwargs)
        return torch.stack([local(t) for t in losses]).mean() if losses else None

    def step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor | None:
        if self.schedule is not None:  # the micro-batches go through the pipeline together
            x = torch.cat([b[0] for b in batches])
            y = torch.cat([b[1] for b in batches])
            return self._pipeline(self.schedule.step, x, y)
        model, loss_sum = self.parts[0], None
        for micro, (x, y) in enumerate(batches):
            if self.fsdp:  # reduce-scatter the gradients once, after the last micro-batch
                model.set_requires_gradient_sync(micro == len(batches) - 1)
            with self.autocast(), self.loss_context():
                _, loss = model(x, y)
                (loss / len(batches)).backward()
            loss = local(loss).detach()
            loss_sum = loss if loss_sum is None else loss_sum + loss
        return loss_sum / len(batches)

    def clip(self, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        params = [p for part in self.parts for p in part.parameters()]
        group = self.mesh["pp"].get_group() if self.layout.pp > 1 else None
        return par.clip_grad_norm_(params, max_norm, group)

    @torch.no_grad()
    def evaluate(self, blocks: torch.Tensor, batch_size: int, batches: int,
                 device: torch.device) -> float:
        if self.schedule is None:
            return evaluate(self.parts[0], blocks, batch_size, batches, device, self.autocast,
                             self.loss_context)
        n = self.schedule._n_microbatches
        losses = []
        for i in range(min(batches, max(1, len(blocks) // (batch_size * n)))):
            block = blocks[i * batch_size * n:(i + 1) * batch_size * n].to(device)
            loss = self._pipeline(self.schedule.eval, block[:, :-1], block[:, 1:])
            losses.append(global_loss(loss, device))
        return sum(losses) / len(losses)


@torch.no_grad()
def evaluate(model: nn.Module, blocks: torch.Tensor, batch_size: int, batches: int,
             device: torch.device, autocast: Callable[[], AbstractContextManager] = nullcontext,
             loss_context: Callable[[], AbstractContextManager] = nullcontext) -> float:
    """Mean loss over the first `batches` batches of `blocks` (a fixed, comparable set)."""
    was_training = model.training
    model.eval()
    losses = []
    for i in range(min(batches, max(1, len(blocks) // batch_size))):
        block = blocks[i * batch_size:(i + 1) * batch_size].to(device)
        with autocast(), loss_context():
            losses.append(local(model(block[:, :-1], block[:, 1:])[1]).item())
    model.train(was_training)
    return sum(losses) / len(losses)
