"""Any layout on a named device mesh, through the teaching loop, checked against one process.

A `DeviceMesh` arranges the world's ranks in a grid with named dimensions; each dimension is a
process group of its own (`mesh["dp_shard"]`, `mesh["tp"]`), and every parallelism takes the
dimension it works on. `ComposedRun` trains the harness model under a `Layout` with the
trainer's own machinery (`train.parallelize`: pipeline split, DTensor TP + SP, recomputation,
FSDP2 or HSDP, applied from outside in torchtitan's order; `train.engine.Composed` steps it), so
the chapter and `python -m trainbook train` run the same code. Each rank takes the slice of the
global batch of its data-parallel coordinate; ranks that differ only in tp or pp see the same
sequences. The trace holds every gradient and parameter gathered to a full tensor under the
reference names, so `harness.max_differences` compares it with single-process training.

Chapter: book/parallelism/putting-it-together.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..launch import rank_device
from ..layout import Layout, check_layout
from ..train import engine
from . import harness

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def _full(tensors: dict) -> dict[str, torch.Tensor]:
    """DTensors (sharded over any mesh) -> plain full tensors; a collective on every rank.

    A 2-D (FSDP x TP) DTensor is gathered with two all-gathers in sequence; DTensor logs a
    performance warning about it, which is silenced here (a one-off gather for checking)."""
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    level, log.level = log.level, logging.ERROR
    try:
        return {n: harness.full_tensor(t) for n, t in tensors.items()}
    finally:
        log.setLevel(level)


def _merged_over_ranks(part: dict) -> dict:
    """Every rank's dict merged: pipeline stages hold different parameters."""
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, part)
    merged: dict = {}
    for q in parts:
        merged.update(q)
    return merged


@dataclass(kw_only=True)
class ComposedRun(harness.Technique):
    """The harness model trained under `layout` (FSDP, HSDP, TP + SP, PP and their products)
    with `layout.micro_batch` sequences per micro-batch; the mesh has the layout's named
    dimensions (`Layout.mesh_shape`: pp, dp_replicate, dp_shard, cp, tp)."""

    layout: Layout

    def __post_init__(self):
        if not isinstance(self.layout, Layout):
            raise ValueError(f"layout must be a trainbook.layout.Layout, got "
                             f"{type(self.layout).__name__}; build one with Layout(dp=2, tp=2)")
        if self.layout.cp > 1 or self.layout.ep > 1:
            raise ValueError(f"layout {self.layout.short()}: context and expert parallelism "
                             "have their own chapters' techniques; use cp=1 and ep=1 here")
        if self.layout.pp_schedule == "zbv":
            raise ValueError("pp_schedule 'zbv' is not run by the composed engine; use gpipe, "
                             "1f1b or interleaved-1f1b")

    def mesh_shape(self, world: int) -> dict[str, int]:
        if world != self.layout.gpus:
            raise ValueError(f"layout {self.layout.short()} needs {self.layout.gpus} ranks, "
                             f"got {world}; launch with nprocs={self.layout.gpus}")
        return self.layout.mesh_shape()

    def build(self, setup: harness.Setup, mesh: DeviceMesh | None) -> None:
        if mesh is None:
            raise ValueError("ComposedRun runs inside a process group: use "
                             "trainbook.launch.run(harness.sweep, nprocs=layout.gpus, ...)")
        L = self.layout
        check_layout(L, setup.model_config(), setup.seq_len, setup.global_batch)
        per_rank = setup.global_batch // L.dp
        self.device = rank_device()
        self.dp_rank = mesh.get_local_rank("dp_replicate") * L.dp_shard + \
            mesh.get_local_rank("dp_shard")
        self.microbatches = per_rank // L.micro_batch
        model = harness.build_model(setup).to(self.device)
        self.engine = engine.Composed(model, L, mesh, self.device, nullcontext,
                                      self.microbatches)
        self.model = self.engine.parts[0]  # what the memory tracker follows
        self.optimizer = harness.make_optimizer(
            setup, [p for part in self.engine.parts for p in part.parameters()])

    def local_batch(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return harness.shard((x, y), self.dp_rank, self.layout.dp)

    def forward_backward(self, x: torch.Tensor,
                         y: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        batches = list(zip(x.chunk(self.microbatches), y.chunk(self.microbatches), strict=True))
        return None, self.engine.step(batches)  # None on pipeline ranks without the last stage

    def global_loss(self, loss: torch.Tensor | None) -> float:
        return engine.global_loss(loss, self.device)

    def _named(self, get) -> dict[str, torch.Tensor]:
        mine = _full({n: get(p) for part in self.engine.parts
                      for n, p in part.named_parameters()})
        return _merged_over_ranks(mine) if self.layout.pp > 1 else mine

    def gradients(self) -> dict[str, torch.Tensor]:
        return self._named(lambda p: p.grad)

    def parameters(self) -> dict[str, torch.Tensor]:
        return self._named(lambda p: p)

    def stats(self) -> dict:
        return {"layout": self.layout.short(), "microbatches": self.microbatches,
                "mesh": self.layout.mesh_shape()}
