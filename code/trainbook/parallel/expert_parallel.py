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

Routing utilities (`route`, `load_balancing_loss`, `router_z_loss`, `capacity`, `keep_mask`) are
pure functions; `RoutedMoE` is the single-process layer with capacity and statistics, and
`run_ep` trains a small Mixtral-style model with EP x DP on every rank of a process group.

Chapter: book/parallelism/expert-parallel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .. import configs
from ..launch import rank_device
from ..model import MoE, Transformer
from . import harness

# ---------------------------------------------------------------------------------------------
# Routing
# ---------------------------------------------------------------------------------------------

def check_moe(n_experts: int, top_k: int, ep: int = 1,
              capacity_factor: float | None = None) -> None:
    """Reject layouts the layer cannot run, with a message that says how to fix them."""
    if n_experts < 1 or top_k < 1:
        raise ValueError(f"n_experts and top_k must be >= 1, got {n_experts}, {top_k}")
    if top_k > n_experts:
        raise ValueError(f"top_k {top_k} is larger than the number of experts {n_experts}; "
                         "pick top_k <= n_experts")
    if ep < 1 or n_experts % ep:
        raise ValueError(f"{n_experts} experts do not split over {ep} expert-parallel ranks; "
                         "use a number of ranks that divides the number of experts")
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(f"capacity factor must be positive (or None for no limit), "
                         f"got {capacity_factor}")


def route(logits: torch.Tensor, top_k: int):
    """(weights, chosen, probs): top-k experts per token, softmax over the chosen k logits
    (Mixtral), and the softmax over all experts (for the load-balancing loss)."""
    check_moe(logits.shape[-1], top_k)
    top, chosen = logits.topk(top_k, dim=-1)
    return top.softmax(dim=-1), chosen, logits.softmax(dim=-1)


def expert_counts(chosen: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Assignments per expert (a token routed to k experts counts k times)."""
    return torch.bincount(chosen.reshape(-1), minlength=n_experts)


def load_balancing_loss(probs: torch.Tensor, counts: torch.Tensor, top_k: int) -> torch.Tensor:
    """Switch/GShard auxiliary loss E * sum_i f_i P_i (Fedus et al. 2021, Section 2.2).

    f_i = fraction of the token assignments routed to expert i (counts / (tokens * k); not
    differentiable), P_i = mean router probability of expert i (differentiable). It is 1 when
    routing is perfectly uniform. Each token picks k distinct experts, so f_i <= 1/k and the loss
    is at most E/k, reached when every token routes to the same k experts and the router puts all
    its probability on them (E only for top-1, Switch's case).
    """
    n_experts = probs.shape[-1]
    f = counts.to(probs.dtype) / counts.sum().clamp(min=1)
    return n_experts * (f * probs.reshape(-1, n_experts).mean(0)).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """Mean squared log-sum-exp of the router logits (Zoph et al. 2022, ST-MoE): keeps them
    small."""
    return torch.logsumexp(logits.float(), dim=-1).pow(2).mean()


def capacity(tokens: int, n_experts: int, top_k: int, factor: float | None) -> int:
    """Rows one expert accepts per batch: ceil(factor * tokens * k / E); None means no limit."""
    check_moe(n_experts, top_k, capacity_factor=factor)
    if factor is None:
        return tokens * top_k
    return math.ceil(factor * tokens * top_k / n_experts)


def keep_mask(chosen: torch.Tensor, n_experts: int, cap: int) -> torch.Tensor:
    """Which (token, slot) assignments fit in their expert's capacity.

    Priority as GShard: every token's first choice before any second choice, and within a slot
    earlier tokens first. An assignment is kept when fewer than `cap` rows with higher priority
    went to the same expert; dropped ones contribute nothing (the residual carries the token).
    """
    order = chosen.t().reshape(-1)  # slot-major: all first choices, then all second choices
    one_hot = F.one_hot(order, n_experts)
    rows = torch.arange(len(order), device=order.device)
    position = (one_hot.cumsum(0) - 1)[rows, order]  # rank within its expert
    return (position < cap).view(chosen.shape[1], chosen.shape[0]).t()


@dataclass
class RouteStats:
    """Routing statistics of one MoE layer call (summed over the ranks when global)."""

    counts: torch.Tensor  # assignments per expert, before the capacity limit
    dropped: int  # assignments over capacity
    aux: torch.Tensor  # load-balancing loss (differentiable)
    z: torch.Tensor  # router z-loss (differentiable)


def _route_and_stats(router: nn.Linear, x: torch.Tensor, top_k: int, factor: float | None,
                     distributed: bool = False, group=None):
    """Route flat tokens x; apply capacity; statistics. When distributed, the counts in f_i are
    summed over the ranks of `group`, so the ranks' aux losses average to the global-batch one."""
    logits = router(x)
    weights, chosen, probs = route(logits, top_k)
    n_experts = logits.shape[-1]
    cap = capacity(len(x), n_experts, top_k, factor)
    keep = keep_mask(chosen, n_experts, cap)
    counts = expert_counts(chosen, n_experts)
    global_counts = counts.clone()
    if distributed:
        dist.all_reduce(global_counts, group=group)
    stats = RouteStats(counts, int((~keep).sum()), load_balancing_loss(probs, global_counts, top_k),
                       router_z_loss(logits))
    return weights.to(x.dtype), chosen, keep, stats


class RoutedMoE(nn.Module):
    """The single-process MoE layer with a capacity limit and routing statistics.

    Same parameters and names as `trainbook.model.MoE` (router, experts), built from one; with
    capacity_factor None it computes exactly what MoE computes. The last call's statistics are in
    `self.stats`.
    """

    def __init__(self, moe: MoE, capacity_factor: float | None = None):
        super().__init__()
        check_moe(len(moe.experts), moe.top_k, capacity_factor=capacity_factor)
        self.top_k, self.capacity_factor = moe.top_k, capacity_factor
        self.router, self.experts = moe.router, moe.experts
        self.stats: RouteStats | None = None

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, chosen, keep, self.stats = _route_and_stats(self.router, x, self.top_k,
                                                             self.capacity_factor)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = ((chosen == e) & keep).nonzero(as_tuple=True)
            if token.numel():
                out.index_add_(0, token, expert(x[token]) * weights[token, slot, None])
        return out.reshape(shape)


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
    def forward(ctx, x, send: list[int], recv: list[int], group, counter: dict):
        ctx.send, ctx.recv, ctx.group, ctx.counter = send, recv, group, counter
        return _all_to_all(x, send, recv, group, counter, "forward_bytes")

    @staticmethod
    def backward(ctx, grad):
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

    def __init__(self, moe: MoE, group=None, capacity_factor: float | None = None):
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

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        # 1. route the local tokens; sort the kept assignments by expert (so by destination rank)
        weights, chosen, keep, self.stats = _route_and_stats(self.router, x, self.top_k,
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

@dataclass(frozen=True)
class EPSetup:
    """A tiny Mixtral-style experiment: model shape, experts, global batch, steps, SGD."""

    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    d_ff: int = 64
    n_experts: int = 4
    top_k: int = 2
    seq_len: int = 32
    global_batch: int = 8
    steps: int = 3
    lr: float = 1e-2
    optimizer: str = "sgd"
    capacity_factor: float | None = None
    aux_weight: float = 0.0  # coefficient of the load-balancing loss (Switch uses 1e-2)
    z_weight: float = 0.0  # coefficient of the router z-loss (ST-MoE uses 1e-3)
    seed: int = 0

    def __post_init__(self):
        check_moe(self.n_experts, self.top_k, capacity_factor=self.capacity_factor)
        if self.aux_weight < 0 or self.z_weight < 0:
            raise ValueError(f"aux_weight and z_weight must be >= 0, got {self.aux_weight}, "
                             f"{self.z_weight}")

    def with_(self, **changes) -> EPSetup:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    def model_config(self) -> configs.ModelConfig:
        return configs.get("tiny-mixtral").with_(
            vocab_size=256, n_layers=self.n_layers, d_model=self.d_model, n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads, d_ff=self.d_ff, max_seq_len=self.seq_len,
            n_experts=self.n_experts, top_k=self.top_k)

    def data(self) -> harness.Setup:
        return harness.Setup(seq_len=self.seq_len, global_batch=self.global_batch,
                             steps=self.steps, lr=self.lr, optimizer=self.optimizer, seed=self.seed)


def build_model(spec: EPSetup, layer=None) -> Transformer:
    """The seeded reference model with every MoE replaced by layer(moe) (default RoutedMoE)."""
    torch.manual_seed(spec.seed)
    model = Transformer(spec.model_config())
    layer = layer or (lambda moe: RoutedMoE(moe, spec.capacity_factor))
    for block in model.blocks:
        block.mlp = layer(block.mlp)
    return model


def _loss(model, spec: EPSetup, x, y):
    """Cross-entropy plus the weighted load-balancing and router z-losses of every layer."""
    _, loss = model(x, y)
    if spec.aux_weight:
        loss = loss + spec.aux_weight * sum(b.mlp.stats.aux for b in model.blocks)
    if spec.z_weight:
        loss = loss + spec.z_weight * sum(b.mlp.stats.z for b in model.blocks)
    return loss


def _layer_stats(model) -> dict:
    stats = [b.mlp.stats for b in model.blocks]
    return {"tokens_per_expert": torch.stack([s.counts for s in stats]),
            "dropped": sum(s.dropped for s in stats),
            "aux": [s.aux.item() for s in stats]}


def reference(spec: EPSetup):
    """Single-process training on the whole global batch: (Trace, routing stats of each step)."""
    model = build_model(spec)
    opt = harness.make_optimizer(spec.data(), model.parameters())
    losses, first, stats = [], {}, []
    for step, (x, y) in enumerate(harness.global_batches(spec.data())):
        loss = _loss(model, spec, x, y)
        loss.backward()
        if step == 0:
            first = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        stats.append(_layer_stats(model))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    final = {n: p.detach().clone() for n, p in model.named_parameters()}
    return harness.Trace(losses, first, final), stats


def is_expert(name: str) -> bool:
    """Whether a parameter belongs to an expert (sharded over EP ranks, not replicated)."""
    return name.startswith("experts.") or ".experts." in name


def sync_grads(model: nn.Module, world: int) -> int:
    """Data-parallel gradient averaging for EP x DP (ep == world): replicated parameters are
    all-reduced and divided by the ranks; each expert lives on one rank and already received
    every rank's contribution through the all-to-all's backward, so it is only divided.
    Returns the bytes all-reduced."""
    sent = 0
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        if not is_expert(name):
            dist.all_reduce(p.grad)
            sent += p.grad.numel() * p.grad.element_size()
        p.grad /= world
    return sent


def _ep_model(spec: EPSetup) -> Transformer:
    return build_model(spec, lambda moe: ExpertParallelMoE(moe, None, spec.capacity_factor))


def run_ep(spec: EPSetup, measure_memory: bool = False) -> dict:
    """Train with experts split over all ranks and the rest data-parallel; call on every rank.

    Returns this rank's trace (its own experts plus the replicated parameters, in reference
    names), routing statistics summed over the ranks per step, all-to-all and all-reduce bytes
    this rank sent, and with measure_memory this rank's peak tensor bytes (MemTracker, AdamW) next
    to `compute.memory.estimate`.
    """
    if not dist.is_initialized():
        raise ValueError("run_ep runs inside a process group: use "
                         "trainbook.launch.run(run_ep, nprocs, args=(spec,))")
    rank, world = dist.get_rank(), dist.get_world_size()
    check_moe(spec.n_experts, spec.top_k, world, spec.capacity_factor)
    device = rank_device()
    model = _ep_model(spec).to(device)
    opt = harness.make_optimizer(spec.data(), model.parameters())
    losses, first, stats, allreduce = [], {}, [], 0
    for step, batch in enumerate(harness.global_batches(spec.data())):
        x, y = (t.to(device) for t in harness.shard(batch, rank, world))
        loss = _loss(model, spec, x, y)
        loss.backward()
        allreduce += sync_grads(model, world)
        if step == 0:
            first = {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters()}
        s = _layer_stats(model)
        dist.all_reduce(s["tokens_per_expert"])
        dropped = torch.tensor(s["dropped"], device=device)
        dist.all_reduce(dropped)
        s["dropped"] = int(dropped)
        stats.append(s)
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    comm = {k: sum(b.mlp.comm[k] for b in model.blocks) for k in ("forward_bytes", "backward_bytes",
                                                                 "calls")}
    for s in stats:
        s["tokens_per_expert"] = s["tokens_per_expert"].cpu()
    trace = harness.Trace(losses, first, {n: p.detach().cpu().clone()
                                          for n, p in model.named_parameters()})
    out = {"rank": rank, "trace": trace, "stats": stats, "alltoall": comm,
           "allreduce_bytes": allreduce}
    if measure_memory:
        out["memory"] = measure_rank_memory(spec)
    return out


def measure_rank_memory(spec: EPSetup) -> dict:
    """This rank's peak tensor bytes for one EP x DP AdamW step (MemTracker), and the estimate
    of `compute.memory.estimate` with dp = ep = world for the same model and micro-batch."""
    from ..bench import memory_measure
    from ..compute import memory

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _ep_model(spec)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    x, y = harness.shard(harness.global_batches(spec.data())[0], rank, world)

    def step(model, optimizer, x, y):
        logits, loss = model(x, y)  # logits kept until the step ends, as in train.train
        loss.backward()
        sync_grads(model, world)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del logits

    measured = memory_measure.tracked_peak(model, opt, x, y, step=step)
    est = memory.estimate(memory.MemoryInputs(
        model=spec.model_config(), dtype="fp32", optimizer="adamw", dp=world, ep=world,
        micro_batch=len(x), seq_len=spec.seq_len))
    return {"measured": measured, "estimate": est.as_dict(),
            "params_on_rank": sum(p.numel() for p in model.parameters())}


def merge(results: list[dict]) -> harness.Trace:
    """One Trace in reference names from the per-rank traces: each rank's own experts, and the
    replicated parameters from rank 0 (identical on every rank)."""
    first, final = {}, {}
    for r in results:
        for name, g in r["trace"].first_grads.items():
            if is_expert(name) or name not in first:
                first[name] = g
        for name, p in r["trace"].final_params.items():
            if is_expert(name) or name not in final:
                final[name] = p
    return harness.Trace(results[0]["trace"].losses, first, final)


def sweep(spec: EPSetup, variants: list[dict]) -> list[dict]:
    """run_ep once per variant (EPSetup fields to change, plus measure_memory), in one launch."""
    out = []
    for v in variants:
        v = dict(v)
        measure = v.pop("measure_memory", False)
        out.append(run_ep(spec.with_(**v), measure_memory=measure))
    return out


# ---------------------------------------------------------------------------------------------
# Layer-level check: one EP layer against the single-process MoE, forward and backward
# ---------------------------------------------------------------------------------------------

def check_layer(n_experts: int = 4, top_k: int = 2, tokens_per_rank: int = 16, d_model: int = 32,
                d_ff: int = 48, seed: int = 0) -> dict:
    """Largest differences between ExpertParallelMoE on this rank's tokens and trainbook.model.MoE
    on all ranks' tokens: outputs, input gradients, this rank's expert gradients and the router
    gradient (summed over the ranks). Loss: sum(out * g) with a fixed random g. Call on every
    rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
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
    ep = ExpertParallelMoE(MoE(cfg))
    rows = slice(rank * tokens_per_rank, (rank + 1) * tokens_per_rank)
    xl = x[rows].clone().requires_grad_(True)
    out = ep(xl)
    (out * g[rows]).sum().backward()
    router_grad = ep.router.weight.grad.clone()
    dist.all_reduce(router_grad)
    ref_params = dict(ref.named_parameters())
    expert_diff = max((p.grad - ref_params[n].grad).abs().max().item()
                      for n, p in ep.named_parameters() if is_expert(n))
    return {"out": (out - out_ref[rows]).abs().max().item(),
            "input_grad": (xl.grad - xr.grad[rows]).abs().max().item(),
            "expert_grad": expert_diff,
            "router_grad": (router_grad - ref.router.weight.grad).abs().max().item(),
            "local_experts": sorted(int(k) for k in ep.experts), "comm": dict(ep.comm)}


def layer_sweep(variants: list[dict]) -> list[dict]:
    """check_layer once per variant (its keyword arguments), in one launch."""
    return [check_layer(**v) for v in variants]
