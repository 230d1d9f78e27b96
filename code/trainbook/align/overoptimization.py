"""Reward-model over-optimisation with best-of-n: the proxy keeps rising, the gold reward turns.

Gao et al. (2022, "Scaling Laws for Reward Model Overoptimization") optimise a policy against a
learned proxy reward model and measure a "gold" reward the proxy was trained to imitate; as the
policy moves away from where it started (measured by KL), the proxy score keeps rising while
the gold score rises, peaks and falls. Best-of-n sampling is the cheapest optimiser they study:
draw n completions, keep the one the proxy scores highest.

`best_of_n` computes the whole curve from one set of N samples per prompt, without resampling:
for each prompt the N samples define an empirical distribution (identical completions merged,
with their counts), and the best-of-n policy on it is exact: a completion y is chosen with
probability F(y)^n - F_<(y)^n, where F(y) is the share of samples whose proxy score is at most
y's and F_< the share strictly below (drawing n with replacement, keeping the best). Its
expected proxy and gold rewards and its KL from the sampling policy follow by summation. The
commonly used formula KL_bon = log n - (n - 1)/n (`kl_bon_formula`; Stiennon et al. 2020, used
by Gao et al.) is the continuous case, where no two samples tie; Beirami et al. (2024) prove it
is an upper bound in general. A small model's answers repeat a lot, so the two differ here and
the chapter shows both.

Chapter: book/alignment/reward-models
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .policy import sample
from .reward import RewardModel
from .task import EOS, ChatTokenizer, Problem, encode_prompts


def kl_bon_formula(n: int) -> float:
    """log n - (n - 1)/n: KL(best-of-n || base) when no two samples tie (an upper bound)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a whole number >= 1, got {n!r}")
    return math.log(n) - (n - 1) / n


def bon_distribution(proxy: Sequence[float], counts: Sequence[int], n: int) -> list[float]:
    """Probabilities that best-of-n (with replacement from the empirical distribution of
    distinct completions with these proxy scores and counts) returns each completion. Distinct
    completions with the same score share their chance in proportion to their counts."""
    if len(proxy) != len(counts) or not proxy or min(counts) < 1:
        raise ValueError("need one positive count per proxy score, and at least one")
    total = sum(counts)
    out = []
    for s, c in zip(proxy, counts):
        at_most = sum(k for t, k in zip(proxy, counts) if t <= s) / total
        below = sum(k for t, k in zip(proxy, counts) if t < s) / total
        tied = sum(k for t, k in zip(proxy, counts) if t == s)
        out.append((at_most ** n - below ** n) * c / tied)
    return out


@dataclass
class BoNPoint:
    """Best-of-n at one n, averaged over prompts: proxy and gold rewards, the KL from the
    sampling policy (exact on the empirical distribution) and the formula's."""

    n: int
    proxy: float
    gold: float
    kl: float
    kl_formula: float


def curve(proxy: Sequence[Sequence[float]], gold: Sequence[Sequence[float]],
          texts: Sequence[Sequence[str]], ns: Sequence[int]) -> list[BoNPoint]:
    """The best-of-n curve from N samples per prompt: proxy[i][j], gold[i][j] and texts[i][j]
    of sample j of prompt i (identical texts are one completion with a count)."""
    if not proxy or not len(proxy) == len(gold) == len(texts):
        raise ValueError("proxy, gold and texts need one row per prompt, and at least one row")
    if not ns or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in ns):
        raise ValueError(f"ns must be whole numbers >= 1, got {list(ns)!r}")
    points = []
    for n in ns:
        tot_p = tot_g = tot_kl = 0.0
        for p_row, g_row, t_row in zip(proxy, gold, texts):
            if not len(p_row) == len(g_row) == len(t_row) or not p_row:
                raise ValueError("each prompt needs as many proxy, gold and text entries")
            merged: dict[str, list] = {}
            for p, g, t in zip(p_row, g_row, t_row):
                merged.setdefault(t, [p, g, 0])[2] += 1
            ps, gs, cs = zip(*merged.values())
            probs = bon_distribution(ps, cs, n)
            N = len(p_row)
            tot_p += sum(q * p for q, p in zip(probs, ps))
            tot_g += sum(q * g for q, g in zip(probs, gs))
            tot_kl += sum(q * math.log(q / (c / N)) for q, c in zip(probs, cs) if q > 0)
        m = len(proxy)
        points.append(BoNPoint(n, tot_p / m, tot_g / m, tot_kl / m, kl_bon_formula(n)))
    return points


@torch.no_grad()
def best_of_n(policy: nn.Module, rms: dict[str, RewardModel], tok: ChatTokenizer,
              items: Sequence[Problem], samples: int, ns: Sequence[int],
              gold: Callable[[Problem, str], float], temperature: float = 1.0,
              seed: int = 0) -> dict[str, list[BoNPoint]]:
    """Draw `samples` completions per item from `policy`, score each with every proxy reward
    model in `rms` and with the `gold` reward (a completion without `<|eos|>` gets gold 0), and
    return each proxy's best-of-n curve for every n in `ns` (each at most `samples`)."""
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"samples must be a whole number >= 1, got {samples!r}")
    if any(n > samples for n in ns):
        raise ValueError(f"every n must be at most samples={samples}, got {max(ns)}")
    if not items:
        raise ValueError("no items to sample for")
    if not rms or not all(isinstance(rm, RewardModel) for rm in rms.values()):
        raise ValueError("rms must map names to RewardModels (at least one)")
    g = torch.Generator().manual_seed(seed)
    prompts = encode_prompts(tok, items)
    budget = max(len(p.answer) for p in items) + 2
    P = {name: [[] for _ in items] for name in rms}
    G = [[] for _ in items]
    T = [[] for _ in items]
    for _ in range(samples):
        roll = sample(policy, tok, prompts, budget, temperature, generator=g)
        ids, _ = roll.sequences()
        for name, rm in rms.items():
            for i, s in enumerate(rm(ids.to(next(rm.parameters()).device)).tolist()):
                P[name][i].append(s)
        for i, (p, c) in enumerate(zip(items, roll.completions)):
            G[i].append(gold(p, roll.texts[i]) if c[-1:] == [EOS] else 0.0)
            T[i].append(tok.decode(c, skip_special=False))
    return {name: curve(P[name], G, T, ns) for name in rms}
