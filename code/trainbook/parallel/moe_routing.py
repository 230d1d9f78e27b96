"""Mixture-of-experts routing: top-k choice, the auxiliary losses, capacity and token dropping.

Pure functions on router logits (`route`, `expert_counts`, `load_balancing_loss` in Switch's
convention, `router_z_loss`, `capacity`, `keep_mask`) and `RoutedMoE`, the single-process MoE
layer with a capacity limit and routing statistics, which the expert-parallel layer must match.

Chapter: book/parallelism/expert-parallel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..model import MoE

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


def route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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


def route_and_stats(router: nn.Linear, x: torch.Tensor, top_k: int, factor: float | None,
                    distributed: bool = False, group: dist.ProcessGroup | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, RouteStats]:
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, chosen, keep, self.stats = route_and_stats(self.router, x, self.top_k,
                                                             self.capacity_factor)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = ((chosen == e) & keep).nonzero(as_tuple=True)
            if token.numel():
                out.index_add_(0, token, expert(x[token]) * weights[token, slot, None])
        return out.reshape(shape)
