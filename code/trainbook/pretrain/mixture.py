"""Data mixtures: source weights (by size, with a temperature), epochs per source, and a
deterministic, resumable blend of sources.

A pretraining run draws each sample from one of several sources (web, code, books, ...) with a
chosen weight. Weights proportional to size give every token the same chance; a temperature
T > 1 (p_i proportional to n_i^(1/T)) flattens them towards uniform, so small sources are
repeated (more epochs) and large ones are not exhausted. `blend` turns weights into the source of
every sample: "greedy" is Megatron-LM's BlendedDataset rule (take the source furthest behind its
target count; exact to within one sample at every prefix), "random" draws independently. The
schedule is a pure function of (weights, seed, position), so resuming needs only the position,
and ranks can take disjoint slices of it.

Chapter: book/pretraining/data-tokenization.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

# GPT-3's mixture, Brown et al. 2020, Table 2.2: tokens, weight in the training mix, epochs
# elapsed when training for 300B tokens (as printed).
GPT3_MIX = {
    "Common Crawl (filtered)": (410e9, 0.60, 0.44),
    "WebText2": (19e9, 0.22, 2.9),
    "Books1": (12e9, 0.08, 1.9),
    "Books2": (55e9, 0.08, 0.43),
    "Wikipedia": (3e9, 0.03, 3.4),
}
METHODS = ("greedy", "random")


def _positive(sizes: Mapping[str, float], what: str) -> None:
    if not sizes:
        raise ValueError(f"{what}: need at least one source")
    bad = {k: v for k, v in sizes.items() if not v > 0}
    if bad:
        raise ValueError(f"{what} must be positive, got {bad}")


def temperature_weights(sizes: Mapping[str, float], temperature: float = 1.0
                        ) -> dict[str, float]:
    """Sampling weights p_i proportional to n_i^(1/T): T = 1 proportional to size, T -> inf
    uniform (the temperature sampling of multilingual models: XLM, mT5's alpha = 1/T)."""
    _positive(sizes, "source sizes")
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    w = {k: float(v) ** (1.0 / temperature) for k, v in sizes.items()}
    total = sum(w.values())
    return {k: v / total for k, v in w.items()}


def epochs(weights: Mapping[str, float], sizes: Mapping[str, float], total: float
           ) -> dict[str, float]:
    """Passes over each source when `total` tokens are drawn with these weights:
    weight * total / size."""
    _positive(sizes, "source sizes")
    if set(weights) != set(sizes):
        raise ValueError(f"weights name {sorted(weights)}, sizes name {sorted(sizes)}; "
                         "give both for the same sources")
    return {k: weights[k] * total / sizes[k] for k in sizes}


def _normalised(weights: Mapping[str, float]) -> tuple[list[str], np.ndarray]:
    _positive(weights, "weights")
    names = list(weights)
    w = np.array([weights[k] for k in names], dtype=float)
    return names, w / w.sum()


def blend(weights: Mapping[str, float], start: int, count: int, method: str = "greedy",
          seed: int = 0) -> np.ndarray:
    """Source index (into list(weights)) of samples start .. start + count - 1.

    greedy: sample i goes to the source with the largest w_s * max(i, 1) - taken_s, so every
    prefix is within about one sample of its target (Megatron-LM's `build_blending_indices`,
    megatron/core/datasets/helpers.cpp; first source on ties).
    random: independent draws from one seeded stream, so any slice is reproducible.
    """
    if method not in METHODS:
        raise ValueError(f"method {method!r} is unknown; use one of {METHODS}")
    if start < 0 or count < 0:
        raise ValueError(f"start and count must be >= 0, got {start}, {count}")
    _, w = _normalised(weights)
    if method == "random":
        u = np.random.default_rng(seed).random(start + count)[start:]  # the same draws per i
        return np.minimum(np.searchsorted(np.cumsum(w), u, side="right"), len(w) - 1)
    taken = np.zeros(len(w))
    out = np.empty(start + count, dtype=np.int64)
    for i in range(start + count):  # replayed from 0: the counts up to `start` are the state
        s = int(np.argmax(w * max(i, 1) - taken))
        taken[s] += 1
        out[i] = s
    return out[start:]


def sample_ids(weights: Mapping[str, float], sizes: Mapping[str, int], start: int, count: int,
               method: str = "greedy", seed: int = 0) -> list[tuple[str, int]]:
    """(source, item) of samples start .. start + count - 1: the source from `blend`, the item
    the next one of that source's order, a fresh permutation of its items per epoch drawn from
    (seed, source, epoch). Deterministic in the position alone: resume by position, shard by
    slicing."""
    names, _ = _normalised(weights)
    if set(sizes) != set(names):
        raise ValueError(f"sizes name {sorted(sizes)}, weights name {sorted(names)}")
    _positive(sizes, "source sizes")
    src = blend(weights, 0, start + count, method, seed)
    out = []
    seen = np.zeros(len(names), dtype=np.int64)
    orders: dict[tuple[int, int], np.ndarray] = {}
    for i, s in enumerate(src):
        epoch, k = divmod(int(seen[s]), int(sizes[names[s]]))
        seen[s] += 1
        if i < start:
            continue
        if (s, epoch) not in orders:
            orders[s, epoch] = np.random.default_rng([seed, s, epoch]).permutation(
                int(sizes[names[s]]))
        out.append((names[s], int(orders[s, epoch][k])))
    return out
