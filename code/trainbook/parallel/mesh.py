"""Two-dimensional device meshes: FSDP x TP, HSDP and PP x FSDP on four ranks, checked exactly.

A `DeviceMesh` arranges the world's ranks in a grid with named dimensions; each dimension is a
process group of its own (`mesh["dp"]`, `mesh["tp"]`), and every parallelism takes the dimension
it works on. Here four ranks form a 2 x 2 grid and the same harness model is trained three ways:

- FSDP x TP: mesh ("dp", "tp"). Tensor parallelism on each block's MLP with DTensor
  (`parallelize_module`: gate/up column-wise, down row-wise), then `fully_shard` over "dp".
  Attention stays replicated across the "tp" pair: the reference `Attention` reshapes with the
  full head count, so a column-wise q/k/v would need a TP-aware attention module. The MLP-only
  plan is enough to show the composition; a production model keeps local head counts.
- HSDP: mesh ("replicate", "shard"). `fully_shard` with the 2D mesh shards within a pair and
  replicates across pairs: all four ranks are data-parallel.
- PP x FSDP: mesh ("pp", "dp"). Two pipeline stages (`torch.distributed.pipelining`, GPipe),
  each stage sharded by `fully_shard` over its "dp" pair.

Each `run_*` function trains a few SGD steps and returns a `harness.Trace` with every gradient
gathered to a full tensor under the reference parameter names, so `harness.max_differences`
compares it with single-process training. `sweep` runs several in one launch. The same
functions run on four GPUs under NCCL (the mesh and tensors follow the process group's backend).

Chapter: book/parallelism/putting-it-together.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

from ..launch import rank_device
from ..model import lm_loss
from ..train.parallelize import split_model, tp_plan
from . import harness

KINDS = ("fsdp_tp", "hsdp", "pp_fsdp")


def _need_four_ranks() -> int:
    if not dist.is_initialized():
        raise ValueError("mesh functions need a process group: run them under "
                         "trainbook.launch.run(fn, nprocs=4) or torchrun")
    world = dist.get_world_size()
    if world != 4:
        raise ValueError(f"the 2 x 2 meshes need 4 ranks, got {world}")
    return world


def _full(tensors: dict) -> dict[str, torch.Tensor]:
    """DTensors (sharded over any mesh) -> plain full tensors; a collective on every rank.

    A 2D (FSDP x TP) DTensor is gathered with two all-gathers in sequence; DTensor logs a
    performance warning about it, which is silenced here (a one-off gather for checking)."""
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    level, log.level = log.level, logging.ERROR
    try:
        return {n: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()
                for n, t in tensors.items()}
    finally:
        log.setLevel(level)


def _mean_over(value: torch.Tensor, group) -> float:
    value = value.detach().clone().contiguous()
    dist.all_reduce(value, group=group)
    return value.item() / dist.get_world_size(group)


def _train(setup: harness.Setup, model: nn.Module, rank: int, ranks: int, group) -> harness.Trace:
    """Plain data-parallel training loop: this rank's shard of each global batch, SGD."""
    opt = harness.make_optimizer(setup, model.parameters())
    losses, first = [], {}
    for step, batch in enumerate(harness.global_batches(setup)):
        x, y = (t.to(rank_device()) for t in harness.shard(batch, rank, ranks))
        _, loss = model(x, y)
        loss.backward()
        if step == 0:
            first = _full({n: p.grad for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(_mean_over(loss, group))
    return harness.Trace(losses, first, _full(dict(model.named_parameters())))


def run_fsdp_tp(setup: harness.Setup) -> harness.Trace:
    """FSDP over "dp" x tensor parallelism over "tp" on a 2 x 2 mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    _need_four_ranks()
    mesh = init_device_mesh(rank_device().type, (2, 2), mesh_dim_names=("dp", "tp"))
    model = harness.build_model(setup).to(rank_device())
    # TP first (whole logits: the loss is the plain one here), then FSDP over dp
    parallelize_module(model, mesh["tp"], tp_plan(model, sp=False, loss_parallel=False))
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    # both ranks of a tp pair see the same data: the batch is split over "dp" only
    return _train(setup, model, mesh.get_local_rank("dp"), 2, mesh["dp"].get_group())


def run_hsdp(setup: harness.Setup) -> harness.Trace:
    """Hybrid sharding: shard within each "shard" pair, replicate across "replicate"."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = _need_four_ranks()
    mesh = init_device_mesh(rank_device().type, (2, 2), mesh_dim_names=("replicate", "shard"))
    model = harness.build_model(setup).to(rank_device())
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return _train(setup, model, dist.get_rank(), world, None)  # all four are data-parallel


def run_pp_fsdp(setup: harness.Setup, microbatches: int = 2) -> harness.Trace:
    """Two GPipe stages over "pp" x FSDP over "dp": rank (p, d) holds stage p, shard d."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    _need_four_ranks()
    if setup.flavour != "llama":
        raise ValueError("run_pp_fsdp splits an untied model; tied embeddings (gpt2) would "
                         "need their gradient summed across the first and last stage")
    mesh = init_device_mesh(rank_device().type, (2, 2), mesh_dim_names=("pp", "dp"))
    p, d = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    stage_mod = split_model(harness.build_model(setup).to(rank_device()), 2, p)
    for block in stage_mod.blocks.values():
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(stage_mod, mesh=mesh["dp"])
    stage = PipelineStage(stage_mod, p, 2, rank_device(), group=mesh["pp"].get_group())
    # scale_grads: gradients are the mean over micro-batches, as one loss over the shard
    schedule = ScheduleGPipe(stage, microbatches, loss_fn=lm_loss, scale_grads=True)
    opt = harness.make_optimizer(setup, stage_mod.parameters())
    losses, first = [], {}
    for step, batch in enumerate(harness.global_batches(setup)):
        x, y = (t.to(rank_device()) for t in harness.shard(batch, d, 2))
        if len(x) % microbatches:
            raise ValueError(f"{len(x)} sequences per dp rank do not split into "
                             f"{microbatches} micro-batches")
        mb_losses: list = []
        if stage_mod.is_first:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=mb_losses)
        loss = torch.stack(mb_losses).mean() if mb_losses else torch.zeros((), device=rank_device())
        if step == 0:
            first = _gather_world(_full({n: q.grad for n, q in stage_mod.named_parameters()}))
        opt.step()
        opt.zero_grad(set_to_none=True)
        # the last stage has the loss: average it over dp, then share it with the first stage
        losses.append(_gather_world({"loss": _mean_over(loss, mesh["dp"].get_group())}, "max"))
    params = _gather_world(_full(dict(stage_mod.named_parameters())))
    return harness.Trace(losses, first, params)


def _gather_world(part: dict, combine: str = "merge"):
    """Every rank's dict merged (stages hold different parameters), or the max of one value."""
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, part)
    if combine == "max":
        return max(q["loss"] for q in parts)
    merged: dict = {}
    for q in parts:
        merged.update(q)
    return merged


def run(setup: harness.Setup, kind: str) -> harness.Trace:
    """One of KINDS on this rank."""
    fns = {"fsdp_tp": run_fsdp_tp, "hsdp": run_hsdp, "pp_fsdp": run_pp_fsdp}
    if kind not in fns:
        raise ValueError(f"kind {kind!r} is unknown; use one of {', '.join(KINDS)}")
    return fns[kind](setup)


def measure_hsdp_rank(cfg, micro_batch: int, seq_len: int, seed: int = 0) -> dict:
    """This rank's peak tensor bytes by category (MemTracker) for one AdamW step under HSDP on
    the 2 x 2 mesh: parameters, gradients and optimizer state sharded over the "shard" pair
    only, so the per-rank model states are those of FSDP over 2 ranks, not 4. The measurement
    is `bench.memory_measure.measure_fsdp_rank` with the 2-D mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    from ..bench.memory_measure import measure_fsdp_rank

    _need_four_ranks()
    mesh = init_device_mesh(rank_device().type, (2, 2), mesh_dim_names=("replicate", "shard"))
    return measure_fsdp_rank(cfg, micro_batch, seq_len, seed, mesh=mesh)


def sweep(setup: harness.Setup, kinds: tuple[str, ...] = KINDS,
          memory: dict | None = None) -> dict:
    """Several 2D meshes in one 4-rank launch (each builds and tears down its own sub-groups);
    with `memory` (keyword arguments of `measure_hsdp_rank`), also the HSDP memory measurement
    under the key "hsdp_memory"."""
    out = {}
    for kind in kinds:
        out[kind] = run(setup, kind)
        dist.barrier()
    if memory is not None:
        out["hsdp_memory"] = measure_hsdp_rank(**memory)
    return out
