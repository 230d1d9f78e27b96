"""The routers of mixture-of-experts models and the load-balancing loss as people write it.

Three routers cover the models people train. Mixtral takes the top k router logits and a softmax
over just those k (Jiang et al. 2024, Section 2.1; `trainbook.parallel.moe_routing.route`).
Switch and GShard take the softmax over all E experts first and weight each chosen expert by its
probability (Fedus et al. 2021, Section 2.1: top-1, y = p_i(x) E_i(x)); with k > 1 the weights
then sum to less than 1 (Qwen-MoE's `norm_topk_prob=False`). DeepSeek-V3 scores each expert with
a sigmoid, chooses by score plus a balancing bias, and normalises the chosen scores
(technical report, Section 2.1.2; `trainbook.parallel.moe_balance.group_limited_route`).

The balancing loss has one shape, E * sum_i f_i P_i (f_i: share of the assignments expert i
got, not differentiable; P_i: mean router probability of expert i), written three ways:

- Switch (Section 2.2, eq. 4), top-1: f_i from the argmax; 1 when routing is uniform. With top k
  and f_i the share of the T k assignments, as Part 5's `load_balancing_loss`, still 1.
- Hugging Face Mixtral (`load_balancing_loss_func`): counts every top-k pick over T tokens, so f_i
  sums to k and the loss is k at balance; and it pools f and P over all layers before the
  product, which is not the mean of the layers' losses.
- DeepSeek-V3's complementary sequence-wise loss (eqs. 17-20): f_i and P_i per sequence, from the
  normalised sigmoid scores, averaged over the sequences; 1 at balance (times its alpha).

`load_stats` measures a load distribution: busiest over mean, normalised entropy, dead experts.

Chapter: book/frontier/moe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..parallel import moe_balance as mb
from ..parallel import moe_routing as mr

ROUTERS = ("mixtral", "switch", "sigmoid")
HF_MIXTRAL_AUX_COEF = 0.001  # transformers' MixtralConfig().router_aux_loss_coef (the tests check)
DEAD_SHARE = 0.1  # an expert is dead when it gets under a tenth of the uniform share 1/E


@dataclass
class Routing:
    """One routing decision for a batch of tokens."""

    weights: torch.Tensor  # (tokens, k): the gate weight of each chosen expert
    chosen: torch.Tensor  # (tokens, k): expert indices
    probs: torch.Tensor  # (tokens, E): the distribution P_i averages (softmax, or normalised
    # sigmoid scores for DeepSeek-V3)


def _check_logits(logits: torch.Tensor, top_k: int) -> int:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError("router logits must be a (tokens, experts) tensor, got "
                         f"{tuple(getattr(logits, 'shape', ()))}")
    n_experts = logits.shape[1]
    if n_experts < 2:
        raise ValueError(f"a router needs at least 2 experts, got {n_experts}")
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise ValueError(f"top_k must be a whole number, got {top_k!r}")
    mr.check_moe(n_experts, top_k)
    return n_experts


def route(logits: torch.Tensor, top_k: int, router: str = "mixtral",
          bias: torch.Tensor | None = None) -> Routing:
    """Route tokens by their router logits (tokens, E) to top_k experts each.

    "mixtral": softmax over the k largest logits; "switch": the k largest softmax
    probabilities, unnormalised; "sigmoid": DeepSeek-V3's sigmoid scores, chosen by score plus
    `bias` (the aux-loss-free balancing bias; only this router takes one), weights the chosen
    scores normalised to sum 1."""
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {router!r}")
    _check_logits(logits, top_k)
    if bias is not None and router != "sigmoid":
        raise ValueError("a balancing bias steers DeepSeek-V3's sigmoid router; use "
                         "router='sigmoid' or drop the bias")
    if router == "mixtral":
        weights, chosen, probs = mr.route(logits, top_k)
        return Routing(weights, chosen, probs)
    if router == "switch":
        probs = logits.float().softmax(-1)
        weights, chosen = probs.topk(top_k, dim=-1)
        return Routing(weights, chosen, probs)
    weights, chosen = mb.group_limited_route(logits, bias, top_k, n_groups=1, topk_groups=1)
    scores = logits.float().sigmoid()
    return Routing(weights, chosen, scores / scores.sum(-1, keepdim=True))


def switch_loss(logits: torch.Tensor) -> torch.Tensor:
    """Switch's auxiliary loss without its alpha, as printed for top-1 routing (Fedus et al.
    2021, Section 2.2, eqs. 4-6): N sum_i f_i P_i with f_i the fraction of the T tokens whose
    argmax is expert i and P_i the mean softmax probability of expert i."""
    n_experts = _check_logits(logits, 1)
    probs = logits.float().softmax(-1)
    return mr.load_balancing_loss(probs, mr.expert_counts(probs.argmax(-1), n_experts), 1)


def topk_loss(probs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Switch's loss with top-k routing: f_i the share of the T k assignments (Part 5's
    `load_balancing_loss`), so it stays 1 at balance whatever k."""
    if probs.dim() != 2 or chosen.dim() != 2 or probs.shape[0] != chosen.shape[0]:
        raise ValueError(f"need probs (tokens, E) and chosen (tokens, k) for the same tokens, "
                         f"got {tuple(probs.shape)} and {tuple(chosen.shape)}")
    return mr.load_balancing_loss(probs, mr.expert_counts(chosen, probs.shape[1]),
                                  chosen.shape[1])


def hf_mixtral_loss(layer_logits: list[torch.Tensor] | tuple[torch.Tensor, ...],
                    top_k: int) -> torch.Tensor:
    """Hugging Face's Mixtral `load_balancing_loss_func` (no attention mask), from scratch: the
    softmax's top k of every layer counted over all layers' T L tokens (so f_i sums to k), P_i
    the softmax averaged over them, E sum_i f_i P_i. It is k times `topk_loss` of the layers'
    tokens pooled; for one layer, exactly k times `topk_loss`."""
    if not isinstance(layer_logits, (list, tuple)) or not layer_logits:
        raise ValueError("give a list with one (tokens, E) tensor of router logits per layer")
    n_experts = {_check_logits(t, top_k) for t in layer_logits}
    if len(n_experts) > 1:
        raise ValueError(f"every layer must have the same number of experts, got {n_experts}")
    probs = torch.cat([t.float().softmax(-1) for t in layer_logits])
    return top_k * topk_loss(probs, probs.topk(top_k, dim=-1).indices)


def sequence_loss(probs: torch.Tensor, chosen: torch.Tensor, seq_len: int) -> torch.Tensor:
    """DeepSeek-V3's complementary sequence-wise balance loss without its alpha (Section 2.1.2,
    eqs. 17-20): per sequence of T tokens, f_i = E/(k T) times the number of the sequence's tokens
    that chose expert i, P_i = the mean over the sequence of the normalised scores s'_i; sum_i
    f_i P_i, averaged over the sequences. Tokens are in sequence order (batch-major)."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive whole number, got {seq_len!r}")
    if probs.dim() != 2 or probs.shape[0] % seq_len:
        raise ValueError(f"{probs.shape[0] if probs.dim() == 2 else '?'} tokens do not split "
                         f"into sequences of {seq_len}; pass the tokens of whole sequences")
    n_seq = probs.shape[0] // seq_len
    losses = [topk_loss(p, c) for p, c in zip(probs.split(seq_len), chosen.split(seq_len))]
    return torch.stack(losses).sum() / n_seq


def load_stats(counts: torch.Tensor) -> dict[str, float]:
    """How balanced a load is, from assignments per expert (E,): busiest over mean
    (1 balanced, E/k when every token goes to the same k), the entropy of the shares over
    ln E (1 balanced), the coefficient of variation, and the dead experts (share under
    DEAD_SHARE / E)."""
    if not isinstance(counts, torch.Tensor) or counts.dim() != 1 or counts.numel() < 2:
        raise ValueError("counts must be a 1-D tensor with one entry per expert (at least 2)")
    c = counts.double()
    if (c < 0).any() or c.sum() == 0:
        raise ValueError("counts must be non-negative and not all zero")
    share = c / c.sum()
    nz = share[share > 0]
    return {"max_over_mean": (c.max() / c.mean()).item(),
            "entropy": (-(nz * nz.log()).sum() / math.log(len(c))).item(),
            "cv": (c.std() / c.mean()).item(),
            "dead": int((share < DEAD_SHARE / len(c)).sum())}
