"""Contamination: which test items the training data already contains, by n-gram overlap.

A model that saw a test item in training can answer it from memory, and its score then says
nothing about the skill the benchmark measures. The check every large report runs is textual:
cut the training data and each test item into word n-grams of the normalised text (lower case,
punctuation and spacing dropped: `pretrain.dedup.normalize` and `shingles`, the same n-grams
near-duplicate removal uses) and flag an item when some of its n-grams occur in training. GPT-3
used word n-grams of up to 13 words and Llama 2 token n-grams; the choice of n is the whole game.
Too short, and n-grams common to any text flag clean items (on arithmetic, "58 65" occurs
whenever one line ends in 58 and the next starts with 65); too long, and an item shorter than n
can never match. Here an item of m < n words is looked up whole (its one m-gram), so a short
item is flagged only if it occurs verbatim.

`overlap` reports, per test item, its n-grams, how many occur in training, and whether it is
flagged; `plant` copies chosen test items into a training text, which is how the chapter shows
the check finds exactly what was planted.

Chapter: book/alignment/evaluation
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..pretrain.dedup import normalize, shingles

GPT3_MAX_N = 13  # GPT-3 (Brown et al. 2020, Appendix C): n-grams of at most 13 words


@dataclass(frozen=True)
class Overlap:
    """One test item against the training data."""

    words: int  # the item's words after normalisation
    n: int  # the n-gram size used: min(n, words)
    ngrams: int  # the item's distinct n-grams
    found: int  # how many of them occur in training

    @property
    def fraction(self) -> float:
        return self.found / self.ngrams if self.ngrams else 0.0

    @property
    def flagged(self) -> bool:
        return self.found > 0


def _texts(name: str, texts) -> list[str]:
    if isinstance(texts, str) or not isinstance(texts, Sequence) or not texts or \
            not all(isinstance(t, str) for t in texts):
        raise ValueError(f"{name} must be a non-empty list of strings (one per document)")
    return list(texts)


def overlap(train_texts: Sequence[str], test_texts: Sequence[str],
            n: int = GPT3_MAX_N) -> list[Overlap]:
    """Each test item's word n-grams looked up in the training documents' n-grams (n-grams
    never cross documents; a long training text is one document)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a whole number of words >= 1, got {n!r}")
    train, test = _texts("train_texts", train_texts), _texts("test_texts", test_texts)
    index: dict[int, np.ndarray] = {}
    out = []
    for text in test:
        words = len(normalize(text).split())
        if words == 0:
            raise ValueError(f"test item {text!r} has no words after normalisation")
        m = min(n, words)
        if m not in index:
            index[m] = np.unique(np.concatenate([shingles(t, m) for t in train
                                                 if len(normalize(t).split()) >= m] or
                                                [np.zeros(0, dtype=np.uint64)]))
        grams = shingles(text, m)
        found = int(np.isin(grams, index[m], assume_unique=True).sum())
        out.append(Overlap(words, m, len(grams), found))
    return out


def flagged_share(rows: Sequence[Overlap]) -> float:
    """The share of test items flagged as contaminated."""
    if not rows:
        raise ValueError("no overlap rows")
    return sum(r.flagged for r in rows) / len(rows)


def plant(train_text: str, test_lines: Sequence[str], k: int, seed: int = 0
          ) -> tuple[str, list[int]]:
    """The training text with k of the test lines inserted at random line boundaries, and the
    indices of the planted lines: contamination made on purpose, to check the check."""
    if not isinstance(train_text, str) or not train_text:
        raise ValueError("train_text must be a non-empty string")
    lines = _texts("test_lines", test_lines)
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= len(lines):
        raise ValueError(f"k must be a whole number in 0..{len(lines)}, got {k!r}")
    rng = random.Random(seed)
    chosen = sorted(rng.sample(range(len(lines)), k))
    body = train_text.splitlines(keepends=True)
    for i in chosen:
        body.insert(rng.randrange(len(body) + 1), lines[i].rstrip("\n") + "\n")
    return "".join(body), chosen
