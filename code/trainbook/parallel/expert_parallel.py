"""Expert parallelism from scratch: route tokens, send them to the rank that owns their expert.

A mixture-of-experts (MoE) layer has E expert MLPs and a router; each token goes to its top-k
experts. With expert parallelism (EP) over n ranks, rank r keeps experts r*E/n ... (r+1)*E/n - 1
and everything else (attention, norms, embeddings, the router) is replicated, as in data
parallelism: each rank has its own tokens. A MoE layer then runs in five steps:

1. route the local tokens (top-k over the router logits, softmax over the chosen k, as Mixtral);
2. count the rows going to each expert, exchange the counts (a small all-to-all), so every rank
   knows how many rows it will receive from every other rank;
3. dispatch: one `all_to_all_single` with those variable split sizes (no padding);
4. run the local experts on what arrived, send the results back with a second all-to-all;
5. combine: add each result, times its routing weight, to its token's output.

The all-to-all is differentiable: its backward is the reverse all-to-all (split sizes swapped),
so gradients flow back to the ranks that own the tokens. With infinite capacity the layer is the
single-process `trainbook.model.MoE` on the concatenation of all ranks' tokens.

The routing utilities and `RoutedMoE`, the single-process layer with capacity and statistics,
are in `moe_routing`. `ExpertParallelRun` trains a small Mixtral-style model with EP x DP
through the teaching loop, over the mesh's "ep" ranks.

Chapter: book/parallelism/expert-parallel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from .. import configs
from ..launch import rank_device
from ..model import MoE, Transformer
from . import harness
from .moe_routing import RoutedMoE, RouteStats, check_moe, route_and_stats

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from ..compute.memory import MemoryBreakdown

# ---------------------------------------------------------------------------------------------
# The differentiable all-to-all and the expert-parallel layer
# ---------------------------------------------------------------------------------------------

class AllToAll(torch.autograd.Function):
    """all_to_all_single with variable split sizes; backward is the reverse all-to-all.

    Row block i of the input goes to rank i (`send` rows), block j of the output came from rank
    j (`recv` rows). Gradients travel the other way with the split sizes swapped. `counter`
    (a dict) accumulates the bytes sent to other ranks, forward and backward.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int],
                group: dist.ProcessGroup | None, counter: dict) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group, ctx.counter = send, recv, group, counter
        return _all_to_all(x, send, recv, group, counter, "forward_bytes")

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        return _all_to_all(grad, ctx.recv, ctx.send, ctx.group, ctx.counter,
                           "backward_bytes"), None, None, None, None


def _all_to_all(x, send, recv, group, counter, key):
    x = x.contiguous()  # gloo silently corrupts non-contiguous tensors
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x, recv, send, group=group)
    me = dist.get_rank(group)
    row = x[0].numel() * x.element_size() if x.dim() > 1 else x.element_size()
    counter[key] = counter.get(key, 0) + (sum(send) - send[me]) * row  # off-rank bytes
    return out


class ExpertParallelMoE(nn.Module):
    """A MoE layer whose experts are spread over the ranks of `group` (E / n per rank).

    Built from a full `trainbook.model.MoE` (the same seeded weights on every rank): it keeps the
    router and only its own experts, in a ModuleDict keyed by the global expert index, so its
    parameter names are the reference model's ("experts.3.gate.weight"). The last call's routing
    statistics are in `self.stats`; `self.comm` counts all-to-all bytes sent to other ranks.
    A capacity limit counts this rank's tokens only (GShard's local dispatch groups), so drops
    can differ from a single process's on the whole batch.
    """

    def __init__(self, moe: MoE, group: dist.ProcessGroup | None = None,
                 capacity_factor: float | None = None):
        super().__init__()
        if not dist.is_initialized():
            raise ValueError("ExpertParallelMoE needs a process group: run under torchrun or "
                             "trainbook.launch.run")
        self.group = group
        self.ep, self.rank = dist.get_world_size(group), dist.get_rank(group)
        n_experts = len(moe.experts)
        check_moe(n_experts, moe.top_k, self.ep, capacity_factor)
        self.n_experts, self.top_k, self.capacity_factor = n_experts, moe.top_k, capacity_factor
        self.local = n_experts // self.ep
        self.first = self.rank * self.local
        self.router = moe.router
        self.experts = nn.ModuleDict({str(e): moe.experts[e]
                                      for e in range(self.first, self.first + self.local)})
        self.stats: RouteStats | None = None
        self.comm = {"forward_bytes": 0, "backward_bytes": 0, "calls": 0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        # 1. route the local tokens; sort the kept assignments by expert (so by destination rank)
        weights, chosen, keep, self.stats = route_and_stats(self.router, x, self.top_k,
                                                             self.capacity_factor, True, self.group)
        token, slot = keep.nonzero(as_tuple=True)
        expert = chosen[token, slot]
        order = torch.argsort(expert, stable=True)
        token, slot, expert = token[order], slot[order], expert[order]
        # 2. rows per expert -> rank; learn how many rows each rank sends to my experts
        per_expert = torch.bincount(expert, minlength=self.n_experts)
        incoming = torch.empty_like(per_expert)
        dist.all_to_all_single(incoming, per_expert, group=self.group)  # E/n counts per rank
        send = per_expert.view(self.ep, self.local).sum(1).tolist()
        recv = incoming.view(self.ep, self.local).sum(1).tolist()
        # 3. dispatch the token vectors: variable split sizes, no padding
        arrived = AllToAll.apply(x[token], send, recv, self.group, self.comm)
        # 4. run my experts on the rows that arrived (ordered by source rank, then expert)
        which = torch.repeat_interleave(torch.arange(self.local, device=x.device).repeat(self.ep),
                                        incoming)
        done = torch.zeros_like(arrived)
        for j in range(self.local):
            rows = (which == j).nonzero(as_tuple=True)[0]
            if rows.numel():
                done = done.index_add(0, rows, self.experts[str(self.first + j)](arrived[rows]))
        back = AllToAll.apply(done, recv, send, self.group, self.comm)  # same order as sent
        self.comm["calls"] += 2
        # 5. combine: weight each expert's output and add it to its token
        out = torch.zeros_like(x).index_add(0, token, back * weights[token, slot, None])
        return out.reshape(shape)


# ---------------------------------------------------------------------------------------------
# Model-level experiment: EP x DP against single-process training
# ---------------------------------------------------------------------------------------------

def is_expert(name: str) -> bool:
    """Whether a parameter belongs to an expert (sharded over EP ranks, not replicated)."""
    return name.startswith("experts.") or ".experts." in name


def sync_grads(model: nn.Module, group: dist.ProcessGroup | None = None) -> int:
    """Data-parallel gradient averaging for EP x DP (every EP rank also a DP rank): replicated
    parameters are all-reduced over `group` and divided by its size; each expert lives on one
    rank and already received every rank's contribution through the all-to-all's backward, so
    it is only divided. Returns the bytes all-reduced."""
    world, sent = dist.get_world_size(group), 0
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        if not is_expert(name):
            dist.all_reduce(p.grad, group=group)
            sent += p.grad.numel() * p.grad.element_size()
        p.grad /= world
    return sent


@dataclass(kw_only=True)
class ExpertParallelRun(harness.Technique):
    """The harness model with every MLP a mixture of `n_experts` experts, `top_k` per token
    (Mixtral-style), trained with its experts over the mesh's "ep" ranks and everything else
    data-parallel; without a process group, the single-process reference (`RoutedMoE`). The
    loss adds `aux_weight` x the load-balancing loss and `z_weight` x the router z-loss of every
    layer. Stats: routing per step (tokens per expert and layer, summed over ranks; dropped
    tokens; aux losses), the all-to-all and all-reduce bytes this rank sent, its parameters."""

    n_experts: int = 4
    top_k: int = 2
    capacity_factor: float | None = None
    aux_weight: float = 0.0  # Switch uses 1e-2
    z_weight: float = 0.0  # ST-MoE uses 1e-3
    mesh_dim: str = "ep"

    def __post_init__(self):
        check_moe(self.n_experts, self.top_k, capacity_factor=self.capacity_factor)
        if self.aux_weight < 0 or self.z_weight < 0:
            raise ValueError(f"aux_weight and z_weight must be >= 0, got {self.aux_weight}, "
                             f"{self.z_weight}")

    def model_config(self, setup: harness.Setup) -> configs.ModelConfig:
        return setup.model_config().with_(n_experts=self.n_experts, top_k=self.top_k)

    def build(self, setup: harness.Setup, mesh: DeviceMesh | None) -> None:
        self.group = mesh["ep"].get_group() if mesh is not None else None
        self.rank = dist.get_rank(self.group) if mesh is not None else 0
        self.world = mesh.size() if mesh is not None else 1
        check_moe(self.n_experts, self.top_k, self.world, self.capacity_factor)
        layer = (lambda moe: ExpertParallelMoE(moe, self.group, self.capacity_factor)) \
            if mesh is not None else None
        self.model = build_model(setup, self, layer).to(rank_device() if mesh is not None
                                                        else torch.device("cpu"))
        self.optimizer = harness.make_optimizer(setup, self.model.parameters())
        self.routing, self.allreduce_bytes = [], 0

    def local_batch(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return harness.shard((x, y), self.rank, self.world)

    def forward_backward(self, x: torch.Tensor,
                         y: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        logits, loss = self.model(x, y)
        blocks = self.model.blocks
        if self.aux_weight:
            loss = loss + self.aux_weight * sum(b.mlp.stats.aux for b in blocks)
        if self.z_weight:
            loss = loss + self.z_weight * sum(b.mlp.stats.z for b in blocks)
        loss.backward()
        if self.world > 1:
            self.allreduce_bytes += sync_grads(self.model, self.group)
        self.routing.append(self._routing())
        return logits, loss.detach()

    def _routing(self) -> dict:
        stats = [b.mlp.stats for b in self.model.blocks]
        counts = torch.stack([s.counts for s in stats])
        dropped = torch.tensor(sum(s.dropped for s in stats), device=counts.device)
        if self.world > 1:  # the global batch's routing: sum over the ranks
            dist.all_reduce(counts, group=self.group)
            dist.all_reduce(dropped, group=self.group)
        return {"tokens_per_expert": counts.cpu(), "dropped": int(dropped),
                "aux": [s.aux.item() for s in stats]}

    def _merged(self, get) -> dict[str, torch.Tensor]:
        """Every rank's own experts and the replicated parameters, in reference names."""
        mine = {n: harness.full_tensor(get(p)) for n, p in self.model.named_parameters()}
        if self.world == 1:
            return mine
        parts: list = [None] * self.world
        dist.all_gather_object(parts, mine, group=self.group)
        merged: dict = {}
        for part in parts:
            merged.update({n: t for n, t in part.items() if is_expert(n) or n not in merged})
        return merged

    def gradients(self) -> dict[str, torch.Tensor]:
        return self._merged(lambda p: p.grad)

    def parameters(self) -> dict[str, torch.Tensor]:
        return self._merged(lambda p: p)

    def stats(self) -> dict:
        comm = {k: sum(b.mlp.comm[k] for b in self.model.blocks)
                for k in ("forward_bytes", "backward_bytes", "calls")} if self.world > 1 else {}
        return {"rank": self.rank, "routing": self.routing, "alltoall": comm,
                "allreduce_bytes": self.allreduce_bytes,
                "params_on_rank": sum(p.numel() for p in self.model.parameters())}


def build_model(setup: harness.Setup, run: ExpertParallelRun,
                layer: Callable[[MoE], nn.Module] | None = None) -> Transformer:
    """The seeded harness model, its MLPs mixtures of experts as `run` says, each MoE replaced
    by layer(moe) (default: the single-process `RoutedMoE` with the run's capacity)."""
    torch.manual_seed(setup.seed)
    model = Transformer(run.model_config(setup))
    layer = layer or (lambda moe: RoutedMoE(moe, run.capacity_factor))
    for block in model.blocks:
        block.mlp = layer(block.mlp)
    return model


def estimate_memory(setup: harness.Setup, run: ExpertParallelRun, ep: int) -> MemoryBreakdown:
    """`compute.memory.estimate` for the run's model with dp = ep ranks (fp32, AdamW, this
    rank's share of the global batch)."""
    from ..compute import memory

    return memory.estimate(memory.MemoryInputs(
        model=run.model_config(setup), dtype="fp32", optimizer="adamw", dp=ep, ep=ep,
        micro_batch=setup.global_batch // ep, seq_len=setup.seq_len,
        activations="reference"))


# ---------------------------------------------------------------------------------------------
# Layer-level check: one EP layer against the single-process MoE, forward and backward
# ---------------------------------------------------------------------------------------------

def check_layer(n_experts: int = 4, top_k: int = 2, tokens_per_rank: int = 16, d_model: int = 32,
                d_ff: int = 48, seed: int = 0, group: dist.ProcessGroup | None = None) -> dict:
    """Largest differences between ExpertParallelMoE on this rank's tokens and trainbook.model.MoE
    on all ranks' tokens: outputs, input gradients, this rank's expert gradients and the router
    gradient (summed over the ranks). Loss: sum(out * g) with a fixed random g. Call on every
    rank."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    cfg = configs.get("tiny-mixtral").with_(d_model=d_model, n_heads=4, n_kv_heads=2, d_ff=d_ff,
                                            n_experts=n_experts, top_k=top_k)
    torch.manual_seed(seed)
    ref = MoE(cfg)
    x = torch.randn(world * tokens_per_rank, d_model)
    g = torch.randn_like(x)
    xr = x.clone().requires_grad_(True)
    out_ref = ref(xr)
    (out_ref * g).sum().backward()

    torch.manual_seed(seed)
    ep = ExpertParallelMoE(MoE(cfg), group)
    rows = slice(rank * tokens_per_rank, (rank + 1) * tokens_per_rank)
    xl = x[rows].clone().requires_grad_(True)
    out = ep(xl)
    (out * g[rows]).sum().backward()
    router_grad = ep.router.weight.grad.clone()
    dist.all_reduce(router_grad, group=group)
    ref_params = dict(ref.named_parameters())
    expert_diff = max((p.grad - ref_params[n].grad).abs().max().item()
                      for n, p in ep.named_parameters() if is_expert(n))
    return {"out": (out - out_ref[rows]).abs().max().item(),
            "input_grad": (xl.grad - xr.grad[rows]).abs().max().item(),
            "expert_grad": expert_diff,
            "router_grad": (router_grad - ref.router.weight.grad).abs().max().item(),
            "local_experts": sorted(int(k) for k in ep.experts), "comm": dict(ep.comm)}


def _layer_check_for(options: dict, _setup: harness.Setup) -> dict:
    return check_layer(**options)


def layer_check(**options: Any) -> partial:
    """`check_layer(**options)` as a sweep variant: a picklable callable of the setup."""
    return partial(_layer_check_for, options)
