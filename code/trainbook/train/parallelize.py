"""Native PyTorch parallelism applied to the reference model from outside, as a layout says.

The model never sees a mesh (torchtitan's rule). `parallelize` applies, in this order, which is
the order torchtitan documents and the only one in which each step sees what it needs:

1. pipeline split (`Stage`): each pp rank keeps its slice of the blocks, the embedding on the
   first stage and the head on the last, under the reference parameter names;
2. tensor + sequence parallelism (DTensor `parallelize_module` with `tp_plan` over mesh "tp"):
   it needs the plain modules, before anything wraps them;
3. activation checkpointing per block (full, or selective: keep matmul outputs, recompute the
   rest), inside FSDP's units so that a recomputed block gathers its weights once;
4. FSDP2 `fully_shard` per block, then the root, over "dp_shard", or the 2-D
   ("dp_replicate", "dp_shard") mesh: HSDP; with a shard dimension of 1 that is replication
   (DDP's all-reduce of gradients, here for DTensor and pipeline parts, which DDP cannot wrap).

Pipelines run under `torch.distributed.pipelining` (`pipeline_schedule`); gradient clipping
sums the squared norm over pipeline stages as well (`clip_grad_norm_`).

Chapter: book/parallelism/putting-it-together; book/parallelism/pipeline-parallel (Stage).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from ..layout import Layout
from ..model import Transformer, lm_loss

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.pipelining.schedules import (
        PipelineScheduleMulti,
        PipelineScheduleSingle,
    )

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
             "interleaved-1f1b": "ScheduleInterleaved1F1B", "zbv": "ScheduleZBVZeroBubble"}
VIRTUAL = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2, "zbv": 2}  # stages per pp rank


class Stage(Transformer):
    """Layers [first_layer, last_layer) of a reference `Transformer`, sharing its modules: the
    same class with fewer parts, the embedding on the first stage only, the final norm and head
    on the last. Its forward is the model's own `trunk`: token ids or hidden states in, hidden
    states or logits out.

    Blocks live in a ModuleDict keyed by their index in the full model, so `named_parameters()`
    gives the reference names ("blocks.3.attn.q.weight") and gradients and checkpoints map back
    by name.
    """

    forward = Transformer.trunk

    def __init__(self, model: Transformer, first_layer: int, last_layer: int):
        nn.Module.__init__(self)  # the parts come from `model`, not freshly made
        n = model.cfg.n_layers
        if not 0 <= first_layer < last_layer <= n:
            raise ValueError(f"layers [{first_layer}, {last_layer}) are not a slice of {n} layers")
        self.cfg, self.tied = model.cfg, model.cfg.tied
        self.is_first, self.is_last = first_layer == 0, last_layer == n
        self.embed = model.embed if self.is_first else None
        self.pos = model.pos if self.is_first else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[i]
                                     for i in range(first_layer, last_layer)})
        self.norm = model.norm if self.is_last else None
        self.head = model.head if self.is_last else None
        if model.rope_cos is not None:
            self.register_buffer("rope_cos", model.rope_cos, persistent=False)
            self.register_buffer("rope_sin", model.rope_sin, persistent=False)
        else:
            self.rope_cos = self.rope_sin = None


def split_model(model: Transformer, num_stages: int, stage_index: int) -> Stage:
    """Stage `stage_index` of `num_stages` equal stages (whole layers each)."""
    n = model.cfg.n_layers
    if num_stages < 1 or n % num_stages:
        raise ValueError(f"{n} layers do not split into {num_stages} equal stages; "
                         f"pick a number of stages that divides {n}")
    if not 0 <= stage_index < num_stages:
        raise ValueError(f"stage_index {stage_index} is not in [0, {num_stages})")
    per = n // num_stages
    return Stage(model, stage_index * per, (stage_index + 1) * per)


def stage_indices(schedule: str, pp_rank: int, pp: int) -> list[int]:
    """The stages a pp rank holds: one; two, round-robin (interleaved 1F1B: r and r + pp) or in
    a V (zero bubble V: r and 2pp - 1 - r, so the first and last stage share a rank)."""
    if VIRTUAL[schedule] == 1:
        return [pp_rank]
    return [pp_rank, 2 * pp - 1 - pp_rank] if schedule == "zbv" else [pp_rank, pp_rank + pp]


def tp_plan(model: Transformer, sp: bool, shared_input: bool = True,
            loss_parallel: bool = True) -> dict:
    """The parallelize_module plan for the reference model (or a pipeline stage of it): module
    name -> ParallelStyle. shared_input=False leaves each Colwise layer to convert its own input
    (TP only); loss_parallel=False returns whole logits (for a loss computed elsewhere, as a
    pipeline schedule does) instead of a vocabulary-sharded DTensor for `loss_parallel()`."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    gpt2 = model.cfg.flavour == "gpt2"
    seq = Shard(1) if sp else Replicate()
    plan = {}
    if model.embed is not None:
        # gpt2 adds learned positions to the embedding output, so keep it whole and shard the
        # sequence at the first block's input instead (a local slice, no communication).
        plan["embed"] = RowwiseParallel(input_layouts=Replicate(),
                                        output_layouts=Replicate() if gpt2 else seq)
    if model.head is not None:
        plan["head"] = (ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1),
                                        use_local_output=False) if loss_parallel else
                        ColwiseParallel(input_layouts=seq, output_layouts=Replicate()))
        if sp:
            plan["norm"] = SequenceParallel()
    # q, k, v (and gate, up) read one input: convert it to a DTensor once, at the module's
    # entry, so its gradient is reduced once (three Colwise layers would each all-reduce it).
    entry = dict(input_layouts=(seq, None), desired_input_layouts=(Replicate(), None))
    names = [name for name, _ in model.blocks.named_children()]
    if sp and gpt2 and model.embed is not None:
        plan[f"blocks.{names[0]}"] = PrepareModuleInput(input_layouts=(Replicate(), None),
                                                        desired_input_layouts=(Shard(1), None),
                                                        use_local_output=True)
    for i in names:
        b = f"blocks.{i}."
        for name in ("attn.q", "attn.k", "attn.v", "mlp.up") + (() if gpt2 else ("mlp.gate",)):
            plan[b + name] = ColwiseParallel()
        plan[b + "attn.o"] = RowwiseParallel(output_layouts=seq)
        plan[b + "mlp.down"] = RowwiseParallel(output_layouts=seq)
        if shared_input or sp:
            plan[b + "attn"] = PrepareModuleInput(**entry)
            plan[b + "mlp"] = PrepareModuleInput(input_layouts=(seq,),
                                                 desired_input_layouts=(Replicate(),))
        if sp:
            plan[b + "attn_norm"] = SequenceParallel()
            plan[b + "mlp_norm"] = SequenceParallel()
    return plan


def build_mesh(layout: Layout, device_type: str) -> DeviceMesh:
    """The named device mesh of the layout (every dimension, size-1 ones included)."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = layout.mesh_shape()
    world = dist.get_world_size() if dist.is_initialized() else 1
    if layout.gpus != world:
        raise ValueError(f"layout {layout.short()} needs {layout.gpus} ranks, but "
                         f"{world} were started; launch with torchrun --nproc_per_node "
                         f"{layout.gpus} or change the layout")
    return init_device_mesh(device_type, tuple(shape.values()), mesh_dim_names=tuple(shape))


def selective_policy() -> Callable[[], tuple[object, object]]:
    """Op-level selective checkpointing: keep the matmul outputs, recompute everything else
    (norms, activations, softmax): most of the memory back for a few percent of the FLOPs."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    keep = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
            torch.ops.aten._scaled_dot_product_flash_attention.default,
            torch.ops.aten._scaled_dot_product_efficient_attention.default,
            torch.ops.aten._scaled_dot_product_cudnn_attention.default}
    # not the CPU kernel (_scaled_dot_product_flash_attention_for_cpu): on a CPU selective
    # recomputation reruns attention, as the memory chapter measures

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE

    return lambda: create_selective_checkpoint_contexts(policy)


def apply_recompute(model: Transformer, mode: str) -> None:
    """Activation checkpointing per block: "full" keeps each block's input only, "selective"
    also its matmul outputs; "none" does nothing. Parameter names do not change."""
    from torch.distributed._composable import checkpoint

    if mode == "none":
        return
    if mode not in ("selective", "full"):
        raise ValueError(f"recompute must be none, selective or full, got {mode!r}")
    for block in model.layers():
        if mode == "full":
            checkpoint(block)
        else:
            checkpoint(block, context_fn=selective_policy())


def parallelize(model: Transformer, layout: Layout, mesh: DeviceMesh,
                pp_rank: int = 0) -> list[Transformer]:
    """The model parts this rank trains (one, or two pipeline stages), with TP, recomputation
    and FSDP/HSDP applied in the order of the module docstring."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    if layout.pp > 1:
        n_stages = layout.pp * VIRTUAL[layout.pp_schedule]
        parts = [split_model(model, n_stages, i)
                 for i in stage_indices(layout.pp_schedule, pp_rank, layout.pp)]
    else:
        parts = [model]
    for part in parts:
        if layout.tp > 1:
            parallelize_module(part, mesh["tp"], tp_plan(part, sp=True,
                                                         loss_parallel=layout.pp == 1))
            if part.cfg.tied and part.embed is not None and part.head is not None:
                part.head.weight = part.embed.weight  # parallelize_module split them apart
        apply_recompute(part, layout.recompute)
        if layout.dp > 1:  # FSDP, HSDP, or (shard size 1) plain replication through FSDP2
            dp_mesh = (mesh["dp_replicate", "dp_shard"] if layout.replicas > 1
                       else mesh["dp_shard"])
            reshard = layout.zero >= 3  # ZeRO-1/2: keep the gathered weights for backward
            for block in part.layers():
                fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard)
            fully_shard(part, mesh=dp_mesh, reshard_after_forward=reshard)
    return parts


def pipeline_schedule(parts: list[Transformer], layout: Layout, mesh: DeviceMesh,
                      device: torch.device, n_microbatches: int,
                      pp_rank: int) -> PipelineScheduleSingle | PipelineScheduleMulti:
    """The torch.distributed.pipelining schedule of this rank's stages (loss: `lm_loss`, mean
    over micro-batches through scale_grads)."""
    from torch.distributed import pipelining
    from torch.distributed.pipelining import PipelineStage

    n_stages = layout.pp * VIRTUAL[layout.pp_schedule]
    group = mesh["pp"].get_group()
    stages = [PipelineStage(part, i, n_stages, device, group=group)
              for part, i in zip(parts, stage_indices(layout.pp_schedule, pp_rank, layout.pp))]
    cls = getattr(pipelining, SCHEDULES[layout.pp_schedule])
    if VIRTUAL[layout.pp_schedule] == 1:
        return cls(stages[0], n_microbatches, loss_fn=lm_loss)
    return cls(stages, n_microbatches, loss_fn=lm_loss)


def clip_grad_norm_(params: list[nn.Parameter], max_norm: float,
                    pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Clip the global gradient norm of DTensor (FSDP, TP) or plain gradients; with pipeline
    stages, the squared norms of every stage are summed first (each rank holds only its own)."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, 2.0)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if pp_group is not None:
        square = norm.pow(2)
        dist.all_reduce(square, group=pp_group)
        norm = square.sqrt()
    if max_norm != float("inf"):  # off: measured only (inf / inf would be NaN)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm
