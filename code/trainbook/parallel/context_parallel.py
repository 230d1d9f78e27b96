"""Context parallelism from scratch: split every sequence across ranks, attend across the split.

Every token-wise layer (embeddings, norms, MLPs, the head) is local to a token, so a rank that
holds a slice of each sequence computes them alone. Attention is the exception: a query needs
the keys and values of every earlier position. Two ways to get them:

- all-gather K/V (Llama 3, Section 3.3.2): gather the whole sequence's keys and values, attend
  locally with the causal mask shifted to this rank's query positions. Simple; each rank holds
  the full K/V of a layer while it attends.
- ring attention (Liu et al. 2023): pass K/V blocks around a ring of ranks; each rank attends to
  the block it holds while the next one is in flight, and combines the partial results with the
  online softmax (Milakov and Gimelshein 2018; Dao et al. 2022). Only two blocks are in memory
  at a time in the forward pass.
- Ulysses (Jacobs et al. 2023): all-to-all q, k and v from sequence shards to head shards,
  attend over the whole sequence for a few heads, all-to-all back; and the hybrid of USP (Fang
  and Zhao 2024), Ulysses inside groups of ranks and the ring across them.

The causal mask makes the work lopsided: with contiguous shards the last rank attends to the
whole sequence and the first to its own slice. Zig-zag sharding (rank r holds chunks r and
2n-1-r of 2n) gives every rank the same work.

The attention itself is in `cp_attention`. `ContextParallelRun` trains the harness's reference
model through the teaching loop with each rank of the mesh's "cp" dimension holding a shard of
every sequence, and checks it against `harness.reference`. Ring attention here is differentiable
through autograd (the ring shift's backward is the reverse shift), which is exact but keeps
every received block for backward; the memory-saving ring backward, which passes dK/dV around
the ring again, is not implemented. `forward_comm` counts one forward pass's collectives, to set
against `cp_ulysses.comm_volume`.

Chapter: book/parallelism/context-parallel.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..compute import memory
from ..model import Transformer, lm_loss
from . import harness
from .cp_attention import (
    attention_group,
    check_attention,
    check_kind,
    check_layout,
    shard_positions,
)
from .cp_ulysses import CommVolume, HybridGroups, comm_volume

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# ---------------------------------------------------------------------------------------------
# The reference model, context parallel
# ---------------------------------------------------------------------------------------------

def cp_forward(model: Transformer, idx: torch.Tensor, positions: list[torch.Tensor],
               attend: Callable[..., torch.Tensor], counter: dict | None = None,
               group: dist.ProcessGroup | None = None,
               attn_group: dist.ProcessGroup | HybridGroups | None = None) -> torch.Tensor:
    """The reference Transformer's forward on this rank's tokens `idx` (B, T/n) -> logits.

    Same modules and weights as `model.forward`; what changes: learned positions and RoPE use
    the tokens' global positions, and each block's attention core is the context-parallel
    `attend` (its q, k, v projections, RoPE and output projection are the reference's own).
    `group`: the CP ranks; `attn_group`: what `attend` takes (default: `group`; the hybrid's
    grid groups, see `cp_attention.attention_group`).
    """
    attn_group = group if attn_group is None else attn_group
    try:
        for block in model.layers():  # an instance attribute shadows Attention.core
            block.attn.core = lambda q, k, v: attend(q, k, v, positions, counter, attn_group)
        return model(idx, positions=positions[dist.get_rank(group)])[0]  # via __call__
    finally:
        for block in model.layers():
            block.attn.__dict__.pop("core", None)


def cp_loss(model: Transformer, x: torch.Tensor, y: torch.Tensor, positions: list[torch.Tensor],
            attend: Callable[..., torch.Tensor], counter: dict | None = None,
            group: dist.ProcessGroup | None = None,
            attn_group: dist.ProcessGroup | HybridGroups | None = None
            ) -> tuple[torch.Tensor, float]:
    """(loss to backpropagate, global mean loss): this rank's summed cross-entropy divided by
    the token count of all ranks, so the per-rank gradients add up to the full-batch gradient."""
    logits = cp_forward(model, x, positions, attend, counter, group, attn_group)
    local = lm_loss(logits, y, reduction="sum")
    stats = torch.stack([local.detach(), torch.tensor(float(y.numel()))])
    dist.all_reduce(stats, group=group)
    return local / stats[1], (stats[0] / stats[1]).item()


def sync_gradients(model: torch.nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Sum the gradients over the CP ranks: they are data-parallel over the sequence's tokens."""
    params = [p for p in model.parameters() if p.grad is not None]
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, group=group)
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
        offset += p.numel()


@dataclass(kw_only=True)
class ContextParallelRun(harness.Technique):
    """The reference model with every sequence split over the mesh's "cp" ranks (`kind`: the
    attention and the sharding, see KINDS; `ulysses_degree`: the hybrid's Ulysses group size).
    The model is replicated, so its gradients and parameters are full tensors; the loss is the
    global mean. Stats: the query-key pairs this rank's attention computed per layer in the
    first step (per sequence and head of the model)."""

    kind: str = "allgather_kv"
    mesh_dim: str = "cp"
    ulysses_degree: int = 2

    def __post_init__(self):
        check_kind(self.kind)

    def build(self, setup: harness.Setup, mesh: DeviceMesh | None) -> None:
        if mesh is None:
            raise ValueError("context-parallel attention needs a process group: use "
                             "trainbook.launch.run(harness.sweep, nprocs, ...)")
        cfg, world = setup.model_config(), mesh.size()
        check_layout(self.kind, world, cfg.n_heads, cfg.n_kv_heads, self.ulysses_degree)
        self.group = mesh["cp"].get_group()
        self.attend, scheme = check_kind(self.kind)
        self.attn_group = attention_group(self.kind, self.group, self.ulysses_degree)
        self.rank = dist.get_rank(self.group)
        self.positions = [shard_positions(setup.seq_len, world, r, scheme) for r in range(world)]
        self.layers, self.heads, self.counter = setup.n_layers, cfg.n_heads, None
        self.model = harness.build_model(setup)
        self.optimizer = harness.make_optimizer(setup, self.model.parameters())

    def local_batch(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mine = self.positions[self.rank]
        return x[:, mine], y[:, mine]

    def forward_backward(self, x: torch.Tensor,
                         y: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        first = self.counter is None
        if first:
            self.counter = {}
        loss, mean = cp_loss(self.model, x, y, self.positions, self.attend,
                             self.counter if first else None, self.group, self.attn_group)
        loss.backward()
        sync_gradients(self.model, self.group)
        return None, torch.tensor(mean)  # already the global mean

    def global_loss(self, loss: torch.Tensor) -> float:
        return loss.item()

    def stats(self) -> dict:
        return {"rank": self.rank,
                "pairs_per_layer": self.counter["pairs"] / (self.layers * self.heads)}


def estimate_memory(setup: harness.Setup, cp: int) -> memory.MemoryBreakdown:
    """`compute.memory.estimate` for the setup with the sequence over `cp` ranks (fp32, AdamW,
    the whole global batch on every rank)."""
    return memory.estimate(memory.MemoryInputs(
        model=setup.model_config(), dtype="fp32", optimizer="adamw", cp=cp,
        micro_batch=setup.global_batch, seq_len=setup.seq_len, activations="reference"))


def _check_for(kind: str, options: dict, _setup: harness.Setup) -> dict:
    return check_attention(kind, **options)


def attention_check(kind: str, **options: Any) -> partial:
    """`check_attention(kind, **options)` as a sweep variant: a picklable callable of the setup."""
    check_kind(kind)
    return partial(_check_for, kind, options)


def forward_comm(kind: str, setup: harness.Setup, ulysses_degree: int = 2) -> dict:
    """The collectives of one context-parallel forward pass of the harness model, per layer, as
    `harness.CommCounter` sees them: {"rank", "calls": {op: n}, "bytes": {op: full bytes}}.
    Only attention communicates in the forward pass (the loss's all-reduce comes after it)."""
    fn, scheme = check_kind(kind)
    cfg, group = setup.model_config(), dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    check_layout(kind, world, cfg.n_heads, cfg.n_kv_heads, ulysses_degree)
    positions = [shard_positions(setup.seq_len, world, r, scheme) for r in range(world)]
    attn_group = attention_group(kind, group, ulysses_degree)
    model = harness.build_model(setup)
    x, _ = harness.global_batches(dataclasses.replace(setup, steps=1))[0]
    with torch.no_grad(), harness.CommCounter() as seen:
        cp_forward(model, x[:, positions[rank]], positions, fn, None, group, attn_group)
    per_layer = lambda d: {op: n // setup.n_layers if n % setup.n_layers == 0  # noqa: E731
                           else n / setup.n_layers for op, n in d.items()}
    return {"rank": rank, "kind": kind, "calls": per_layer(seen.calls),
            "bytes": per_layer(seen.bytes)}


def setup_comm_volume(kind: str, setup: harness.Setup, cp: int,
                      ulysses_degree: int = 2) -> CommVolume:
    """`comm_volume` for the harness model's attention (fp32, the whole global batch per rank):
    what `forward_comm` should measure."""
    cfg = setup.model_config()
    return comm_volume(kind, setup.seq_len, cp, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                       bytes_per_value=4, batch=setup.global_batch, ulysses_degree=ulysses_degree)


def _comm_for(kind: str, ulysses_degree: int, setup: harness.Setup) -> dict:
    return forward_comm(kind, setup, ulysses_degree)


def comm_probe(kind: str, ulysses_degree: int = 2) -> partial:
    """`forward_comm(kind, setup, ulysses_degree)` as a sweep variant."""
    check_kind(kind)
    return partial(_comm_for, kind, ulysses_degree)


def _official_for(options: dict, _setup: harness.Setup) -> dict:
    return official_api_on_cpu(**options)


def official_api_probe(**options: int | bool) -> partial:
    """`official_api_on_cpu(**options)` as a sweep variant."""
    return partial(_official_for, options)


# ---------------------------------------------------------------------------------------------
# The official API on CPU
# ---------------------------------------------------------------------------------------------

def official_api_on_cpu(seq_len: int = 32, backward: bool = True) -> dict:
    """Try `torch.distributed.tensor.experimental.context_parallel` on this (CPU) process group,
    once per SDPA backend; return what happened (the real error message, or success)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.MATH):
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 2, seq_len, 8, generator=g) for _ in range(3))
        try:
            with sdpa_kernel(backend), context_parallel(mesh, buffers=[q, k, v],
                                                        buffer_seq_dims=[2, 2, 2]):
                qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
                out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
                if backward:
                    out.sum().backward()
            results[backend.name] = "works"
        except Exception as e:  # the point: show the real error
            msg = str(e).strip().splitlines()
            results[backend.name] = f"{type(e).__name__}: {msg[0] if msg else ''}"[:300]
    return {"rank": rank, "torch": torch.__version__, **results}
