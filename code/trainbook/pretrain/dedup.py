"""Exact and near-duplicate removal: normalised-text hashes, MinHash signatures, LSH banding.

Exact duplicates share the hash of their normalised text (case, punctuation and whitespace
removed). Near duplicates are found as web-scale pipelines find them: each document becomes its
set of word n-gram shingles, a MinHash signature of `bands * rows` minima estimates the Jaccard
similarity of two sets (each minimum agrees with probability s), and two documents become
candidates when all `rows` minima of any one of `bands` bands agree, which happens with
probability 1 - (1 - s^rows)^bands: the S-curve. Candidates are joined transitively into
clusters, and each cluster keeps its first document.

Chapter: book/pretraining/data-tokenization.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

_WORD = re.compile(r"\w+(?:'\w+)*")
_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)
# published settings (bands, rows): FineWeb (Penedo et al. 2024): 112 hashes "split into 14
# buckets of 8 hashes each", word 5-grams. Lee et al. 2022 (App. A) and RefinedWeb (Penedo et
# al. 2023, App. G): 9,000 hashes, 5-grams, 450 bands of 20 rows (see the chapter on the
# "20 buckets of 450" wording).
PUBLISHED = {"fineweb": (14, 8), "lee2022-refinedweb": (450, 20)}


def normalize(text: str) -> str:
    """NFKC, lower case, punctuation dropped, whitespace collapsed: the text exact dedup hashes."""
    text = unicodedata.normalize("NFKC", text).lower()
    return " ".join(_WORD.findall(text))


def exact_key(text: str) -> str:
    """The hash of the normalised text: documents with equal keys are exact duplicates."""
    return hashlib.sha256(normalize(text).encode("utf-8")).hexdigest()


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (wrapping arithmetic): a fast, well-mixed hash."""
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


@lru_cache(maxsize=1 << 20)
def _word_hash(word: str) -> int:
    return int.from_bytes(hashlib.blake2b(word.encode("utf-8"), digest_size=8).digest(), "little")


def shingles(text: str, n: int = 5) -> np.ndarray:
    """The distinct word n-grams of the normalised text, as 64-bit hashes (a document shorter
    than n words is one shingle: all its words)."""
    if n < 1:
        raise ValueError(f"shingle size n must be >= 1, got {n}")
    words = normalize(text).split()
    if not words:
        return np.zeros(0, dtype=np.uint64)
    h = np.array([_word_hash(w) for w in words], dtype=np.uint64)
    m = max(1, len(words) - n + 1)
    acc = np.zeros(m, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(min(n, len(words))):  # a polynomial in the n word hashes: order matters
            acc = acc * np.uint64(0x9E3779B97F4A7C15) + h[j:j + m]
    return np.unique(_mix64(acc))


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """|A & B| / |A | B| of two shingle sets (1.0 for two empty sets)."""
    union = np.union1d(a, b).size
    return 1.0 if union == 0 else np.intersect1d(a, b).size / union


@lru_cache(maxsize=16)
def _seeds(num_perm: int, seed: int) -> np.ndarray:
    out = np.random.default_rng(seed).integers(0, 2**63, size=num_perm, dtype=np.uint64)
    out.flags.writeable = False
    return out


def minhash(sh: np.ndarray, num_perm: int = 112, seed: int = 0) -> np.ndarray:
    """MinHash signature: for each of num_perm seeded hash functions, the minimum hash over the
    shingles. Two signatures agree in one position with probability J(A, B)."""
    if num_perm < 1:
        raise ValueError(f"num_perm must be >= 1, got {num_perm}")
    if sh.size == 0:
        return np.full(num_perm, _M64, dtype=np.uint64)
    return _mix64(sh[None, :] ^ _seeds(num_perm, seed)[:, None]).min(axis=1)


def signatures(docs: Sequence[str], num_perm: int = 112, n: int = 5, seed: int = 0
               ) -> np.ndarray:
    """(len(docs), num_perm) MinHash signatures of the documents' word n-gram shingles."""
    return minhash_many([shingles(d, n) for d in docs], num_perm, seed)


def minhash_many(sets: Sequence[np.ndarray], num_perm: int = 112, seed: int = 0) -> np.ndarray:
    """`minhash` of many shingle sets at once (a segmented minimum over their concatenation):
    (len(sets), num_perm)."""
    if num_perm < 1:
        raise ValueError(f"num_perm must be >= 1, got {num_perm}")
    out = np.full((len(sets), num_perm), _M64, dtype=np.uint64)
    seeds = _seeds(num_perm, seed)[:, None]
    i = 0
    while i < len(sets):  # chunks of about 2^16 shingles bound the (num_perm, chunk) temporary
        j, size = i, 0
        while j < len(sets) and (size == 0 or size + sets[j].size <= 1 << 16):
            size += sets[j].size
            j += 1
        chunk = [k for k in range(i, j) if sets[k].size]
        if chunk:
            flat = np.concatenate([sets[k] for k in chunk])
            starts = np.cumsum([0] + [sets[k].size for k in chunk[:-1]])
            out[chunk] = np.minimum.reduceat(_mix64(flat[None, :] ^ seeds), starts, axis=1).T
        i = j
    return out


def p_candidate(s: float | np.ndarray, bands: int, rows: int) -> float | np.ndarray:
    """The S-curve: probability that two documents of Jaccard similarity s share a bucket in at
    least one of `bands` bands of `rows` MinHashes: 1 - (1 - s^rows)^bands."""
    _check_banding(bands, rows)
    return 1.0 - (1.0 - np.asarray(s, dtype=float) ** rows) ** bands


def threshold(bands: int, rows: int) -> float:
    """The similarity where the S-curve crosses 1/2: (1 - 2^(-1/bands))^(1/rows), close to the
    usual rule of thumb (1/bands)^(1/rows)."""
    _check_banding(bands, rows)
    return (1.0 - 0.5 ** (1.0 / bands)) ** (1.0 / rows)


def best_banding(target: float, num_perm: int) -> tuple[int, int]:
    """(bands, rows) with bands * rows <= num_perm whose S-curve best separates pairs below and
    above `target`: least area of false positives (P below target) plus false negatives
    (1 - P above it), as datasketch's MinHashLSH chooses its parameters."""
    if not 0 < target < 1:
        raise ValueError(f"target similarity must be in (0, 1), got {target}")
    if num_perm < 1:
        raise ValueError(f"num_perm must be >= 1, got {num_perm}")
    s = np.linspace(0, 1, 1001)
    best, where = np.inf, (1, 1)
    for b in range(1, num_perm + 1):
        for r in range(1, num_perm // b + 1):
            p = p_candidate(s, b, r)
            err = np.where(s < target, p, 1 - p).mean()  # uniform grid: the mean is the area
            if err < best:
                best, where = err, (b, r)
    return where


def _check_banding(bands: int, rows: int) -> None:
    if bands < 1 or rows < 1:
        raise ValueError(f"bands and rows must be >= 1, got bands={bands}, rows={rows}")


def caught(sig_a: np.ndarray, sig_b: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """Whether LSH makes each pair of signatures (rows of sig_a, sig_b) candidates: all `rows`
    values of some band equal."""
    _check_banding(bands, rows)
    k = bands * rows
    if sig_a.shape[-1] < k:
        raise ValueError(f"signatures have {sig_a.shape[-1]} MinHashes; bands * rows = {k}")
    eq = (sig_a[..., :k] == sig_b[..., :k]).reshape(*sig_a.shape[:-1], bands, rows)
    return eq.all(-1).any(-1)


def _find(parent: list[int], i: int) -> int:
    while parent[i] != i:
        parent[i] = parent[parent[i]]
        i = parent[i]
    return i


def lsh_clusters(sigs: np.ndarray, bands: int, rows: int, min_similarity: float | None = None
                 ) -> list[list[int]]:
    """Clusters (of 2 or more documents) joined transitively through shared LSH buckets. With
    min_similarity, a bucket pair is joined only if its signatures agree on that fraction."""
    _check_banding(bands, rows)
    if sigs.ndim != 2 or sigs.shape[1] < bands * rows:
        raise ValueError(f"need signatures of at least bands * rows = {bands * rows} MinHashes, "
                         f"got shape {tuple(sigs.shape)}")
    parent = list(range(len(sigs)))
    for band in range(bands):
        key = np.zeros(len(sigs), dtype=np.uint64)  # one 64-bit bucket key per band
        with np.errstate(over="ignore"):
            for col in sigs[:, band * rows:(band + 1) * rows].T:
                key = _mix64(key * np.uint64(0x9E3779B97F4A7C15) + col)
        _, inverse, counts = np.unique(key, return_inverse=True, return_counts=True)
        for bucket in np.flatnonzero(counts > 1):
            members = np.flatnonzero(inverse == bucket).tolist()
            for j in members[1:]:
                i = members[0]
                if min_similarity is None or (sigs[i] == sigs[j]).mean() >= min_similarity:
                    parent[_find(parent, j)] = _find(parent, i)
    groups: dict[int, list[int]] = defaultdict(list)
    for i in range(len(sigs)):
        groups[_find(parent, i)].append(i)
    return sorted((g for g in groups.values() if len(g) > 1), key=lambda g: g[0])


@dataclass
class DedupResult:
    """What deduplication kept and why the rest went."""

    keep: list[int]  # indices of the kept documents, in order
    exact: list[list[int]] = field(default_factory=list)  # groups of exact duplicates
    near: list[list[int]] = field(default_factory=list)  # MinHash clusters (after exact dedup)

    def removed(self, n_docs: int) -> dict[str, int]:
        return {"documents": n_docs, "exact": sum(len(g) - 1 for g in self.exact),
                "near": sum(len(g) - 1 for g in self.near), "kept": len(self.keep)}


def deduplicate(docs: Sequence[str], bands: int = 14, rows: int = 8, n: int = 5,
                min_similarity: float | None = None, seed: int = 0,
                near: bool = True) -> DedupResult:
    """Exact dedup on normalised-text hashes, then MinHash LSH near-dedup on what is left; each
    group keeps its first document."""
    _check_banding(bands, rows)
    if min_similarity is not None and not 0 <= min_similarity <= 1:
        raise ValueError(f"min_similarity must be in [0, 1], got {min_similarity}")
    first: dict[str, int] = {}
    groups: dict[int, list[int]] = defaultdict(list)
    for i, d in enumerate(docs):
        groups[first.setdefault(exact_key(d), i)].append(i)
    exact = [g for g in groups.values() if len(g) > 1]
    survivors = sorted(groups)
    clusters: list[list[int]] = []
    if near and len(survivors) > 1:
        sigs = signatures([docs[i] for i in survivors], bands * rows, n, seed)
        clusters = [[survivors[i] for i in c]
                    for c in lsh_clusters(sigs, bands, rows, min_similarity)]
    dropped = {i for c in clusters for i in c[1:]}
    return DedupResult([i for i in survivors if i not in dropped], exact, clusters)


def perturb(text: str, fraction: float, vocabulary: Sequence[str],
            rng: np.random.Generator) -> str:
    """Replace round(fraction * words) randomly chosen words of the normalised text by random
    words from `vocabulary`: a planted near duplicate of controlled similarity."""
    if not 0 <= fraction <= 1:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    words = normalize(text).split()
    k = round(fraction * len(words))
    for i in rng.choice(len(words), size=k, replace=False):
        words[i] = vocabulary[rng.integers(len(vocabulary))]
    return " ".join(words)
