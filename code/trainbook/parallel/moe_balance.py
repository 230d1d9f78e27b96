"""DeepSeek-V3's routing: sigmoid affinities, group-limited (node-limited) top-k, and load
balancing without an auxiliary loss, by a per-expert bias that only steers the choice.

DeepSeek-V3 (technical report, Section 2.1.2) scores token-expert affinity with a sigmoid,
picks the top k experts from the experts of the best `topk_groups` of `n_groups` groups (a
group is the experts of one node, so a token's dispatch crosses at most that many nodes), and
adds a bias b_i to the affinity for the choice only; the gate weights are the chosen
affinities, normalised. After each step b_i falls by gamma if expert i was overloaded and rises
by gamma if underloaded. `group_limited_route` is checked against Hugging Face transformers'
DeepseekV3TopkRouter in the tests.

Chapter: book/parallelism/expert-parallel ("Routing at scale").
"""

from __future__ import annotations

import torch


def _check_groups(n_experts: int, top_k: int, n_groups: int, topk_groups: int) -> None:
    if n_groups < 1 or n_experts % n_groups:
        raise ValueError(f"{n_experts} experts do not split into {n_groups} groups; use a number "
                         "of groups (nodes) that divides the number of experts")
    if not 1 <= topk_groups <= n_groups:
        raise ValueError(f"topk_groups must be in [1, n_groups={n_groups}], got {topk_groups}")
    per_group = n_experts // n_groups
    if per_group < 2:
        raise ValueError(f"groups are scored by their two best experts: need >= 2 experts per "
                         f"group, got {per_group}")
    if not 1 <= top_k <= topk_groups * per_group:
        raise ValueError(f"top_k {top_k} must be in [1, {topk_groups * per_group}] (the experts "
                         f"of the {topk_groups} groups a token may use)")


def group_limited_route(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int,
                        n_groups: int, topk_groups: int, scaling: float = 1.0,
                        normalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, chosen) for router logits (tokens, E): sigmoid affinities, plus `bias` for the
    choice; groups ranked by the sum of their two best biased affinities; top k among the
    experts of the best `topk_groups` groups; weights = the chosen unbiased affinities,
    normalised to sum 1 (`normalize`) and times `scaling`."""
    tokens, n_experts = logits.shape
    _check_groups(n_experts, top_k, n_groups, topk_groups)
    if bias is not None and bias.shape != (n_experts,):
        raise ValueError(f"bias must have one entry per expert ({n_experts}), got "
                         f"{tuple(bias.shape)}")
    scores = logits.float().sigmoid()
    biased = scores if bias is None else scores + bias
    grouped = biased.view(tokens, n_groups, n_experts // n_groups)
    best_groups = grouped.topk(2, dim=-1).values.sum(-1).topk(topk_groups, dim=-1).indices
    allowed = torch.zeros(tokens, n_groups, dtype=torch.bool, device=logits.device)
    allowed.scatter_(1, best_groups, True)
    allowed = allowed.repeat_interleave(n_experts // n_groups, dim=1)
    chosen = biased.masked_fill(~allowed, float("-inf")).topk(top_k, dim=-1).indices
    weights = scores.gather(1, chosen)
    if normalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, chosen


def update_bias(bias: torch.Tensor, counts: torch.Tensor, gamma: float) -> torch.Tensor:
    """The bias after one step: minus gamma where an expert took more than the mean load, plus
    gamma where it took less (DeepSeek-V3's bias update speed gamma)."""
    if gamma < 0:
        raise ValueError(f"gamma (the bias update speed) must be >= 0, got {gamma}")
    if counts.shape != bias.shape:
        raise ValueError(f"counts {tuple(counts.shape)} and bias {tuple(bias.shape)} differ")
    load = counts.float()
    return bias - gamma * torch.sign(load - load.mean())


def nodes_per_token(chosen: torch.Tensor, n_experts: int, nodes: int) -> torch.Tensor:
    """How many distinct nodes each token's chosen experts live on (experts laid out in equal
    contiguous blocks per node, as expert parallelism places them)."""
    if nodes < 1 or n_experts % nodes:
        raise ValueError(f"{n_experts} experts do not split over {nodes} nodes")
    node = chosen // (n_experts // nodes)
    hit = torch.zeros(chosen.shape[0], nodes, dtype=torch.bool, device=chosen.device)
    hit.scatter_(1, node, True)
    return hit.sum(-1)


def balance_run(steps: int, tokens: int = 1024, n_experts: int = 64, top_k: int = 8,
                n_groups: int = 8, topk_groups: int = 4, gamma: float = 1e-3,
                skew: float = 1.0, seed: int = 0) -> list[dict]:
    """A router with a built-in preference (fixed per-expert logit offsets of scale `skew` on
    top of random token logits) routed for `steps` batches, the bias updated after each.
    Returns per step: max/mean load, the coefficient of variation, nodes per token. The
    router itself never changes: only the bias, which moves the choice, not the weights."""
    if steps < 1 or tokens < 1:
        raise ValueError(f"steps and tokens must be >= 1, got {steps}, {tokens}")
    g = torch.Generator().manual_seed(seed)
    preference = skew * torch.randn(n_experts, generator=g)
    bias = torch.zeros(n_experts)
    out = []
    for step in range(steps):
        logits = torch.randn(tokens, n_experts, generator=g) + preference
        _, chosen = group_limited_route(logits, bias, top_k, n_groups, topk_groups)
        counts = torch.bincount(chosen.reshape(-1), minlength=n_experts)
        load = counts.float()
        out.append({"step": step, "max_over_mean": (load.max() / load.mean()).item(),
                    "cv": (load.std() / load.mean()).item(),
                    "nodes_per_token": nodes_per_token(chosen, n_experts,
                                                       n_groups).float().mean().item()})
        bias = update_bias(bias, counts, gamma)
    return out
