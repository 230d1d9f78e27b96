"""Heuristic quality filters: Gopher's document rules and repetition rules, C4's line rules.

Cheap, explainable rules that web-scale pipelines (C4, MassiveText, RefinedWeb, FineWeb) run
before anything learned: a document is dropped when one statistic leaves a range tuned on web
pages. Each function returns one flag per rule (True: the rule removes the document), so a
chapter can say what each rule removes. Also here: the shipped corpus cut into documents (one
speech each) and planted junk documents that each violate one rule.

Thresholds: Rae et al. 2021 (Gopher), Appendix A.1.1 and Table A1; Raffel et al. 2020 (T5), C4
in Section 2.2. Counting details (what a word is, overlaps of repeated n-grams) follow the
datatrove implementations FineWeb uses; the papers leave them open.

Chapter: book/pretraining/data-tokenization.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence

import numpy as np

# Gopher quality filter (Rae et al. 2021, App. A.1.1)
GOPHER_QUALITY = {"min_words": 50, "max_words": 100_000, "min_mean_word_length": 3.0,
                  "max_mean_word_length": 10.0, "max_symbol_ratio": 0.1,
                  "max_bullet_lines": 0.9, "max_ellipsis_lines": 0.3, "min_alpha_words": 0.8,
                  "min_stop_words": 2}
STOP_WORDS = frozenset({"the", "be", "to", "of", "and", "that", "have", "with"})
# Gopher repetition filter (Rae et al. 2021, Table A1): upper bounds on duplicated fractions
GOPHER_REPETITION = {"dup_lines": 0.30, "dup_paragraphs": 0.30, "dup_line_chars": 0.20,
                     "dup_paragraph_chars": 0.20,
                     "top_ngram_chars": {2: 0.20, 3: 0.18, 4: 0.16},
                     "dup_ngram_chars": {5: 0.15, 6: 0.14, 7: 0.13, 8: 0.12, 9: 0.11, 10: 0.10}}
# C4 (Raffel et al. 2020, Sec. 2.2): lines that end in terminal punctuation and have >= 5 words;
# pages with >= 3 sentences, no "lorem ipsum", no curly bracket; no line mentioning javascript.
C4 = {"min_words_per_line": 5, "min_sentences": 3}
_TERMINAL = (".", "!", "?", '"', "\u201d", "\u2019")
_BULLETS = ("\u2022", "\u2023", "\u25cf", "-", "*")
_SPEAKER = re.compile(r"^[^\n:]{1,40}:$")


def speeches(text: str | None = None) -> list[str]:
    """The shipped corpus as documents: one speech each (a speaker line "NAME:" and its text).
    Blocks without a body (a speaker line alone) are left out."""
    if text is None:
        from ..data import load_corpus
        text = load_corpus()
    blocks = [b.strip("\n") for b in text.split("\n\n")]
    return [b for b in blocks if b.strip() and not (_SPEAKER.match(b) and "\n" not in b)]


def _words(text: str) -> list[str]:
    return text.split()


def gopher_quality(text: str) -> dict[str, bool]:
    """Gopher's quality rules; True where the rule removes the document."""
    g = GOPHER_QUALITY
    words = _words(text)
    n = len(words)
    lines = [ln for ln in text.splitlines() if ln.strip()] or [""]
    mean_len = sum(map(len, words)) / n if n else 0.0
    return {
        "word count": not g["min_words"] <= n <= g["max_words"],
        "mean word length": not g["min_mean_word_length"] <= mean_len <= g["max_mean_word_length"],
        "hash ratio": n > 0 and text.count("#") / n > g["max_symbol_ratio"],
        "ellipsis ratio": n > 0 and (text.count("...") + text.count("\u2026")) / n
        > g["max_symbol_ratio"],
        "bullet lines": sum(ln.lstrip().startswith(_BULLETS) for ln in lines) / len(lines)
        > g["max_bullet_lines"],
        "ellipsis lines": sum(ln.rstrip().endswith(("...", "\u2026")) for ln in lines)
        / len(lines) > g["max_ellipsis_lines"],
        "alphabetic words": n == 0 or sum(any(c.isalpha() for c in w) for w in words) / n
        < g["min_alpha_words"],
        "stop words": len(STOP_WORDS & {w.lower().strip(".,;:!?'\"") for w in words})
        < g["min_stop_words"],
    }


def _dup_fractions(parts: list[str]) -> tuple[float, float]:
    """(fraction of parts that repeat an earlier one, fraction of characters in them)."""
    seen: set[str] = set()
    dup = dup_chars = 0
    for p in parts:
        if p in seen:
            dup += 1
            dup_chars += len(p)
        seen.add(p)
    total = sum(len(p) for p in parts)
    return (dup / len(parts) if parts else 0.0), (dup_chars / total if total else 0.0)


def _ngrams(words: list[str], n: int) -> list[tuple[str, ...]]:
    return list(zip(*(words[i:] for i in range(n))))


def top_ngram_char_fraction(words: list[str], n: int) -> float:
    """Characters in the most frequent word n-gram (all its occurrences) over all characters."""
    total = sum(map(len, words))
    grams = Counter(_ngrams(words, n))
    if not grams or not total:
        return 0.0
    gram, count = grams.most_common(1)[0]
    return count * sum(map(len, gram)) / total if count > 1 else 0.0


def dup_ngram_char_fraction(words: list[str], n: int) -> float:
    """Characters in words covered by an n-gram that repeats an earlier one, over all
    characters (each word counted once however many repeats cover it)."""
    grams = _ngrams(words, n)
    total = sum(map(len, words))
    if len(set(grams)) == len(grams) or not total:
        return 0.0
    seen: set[tuple[str, ...]] = set()
    covered = [False] * len(words)
    for i, g in enumerate(grams):
        if g in seen:
            covered[i:i + n] = [True] * n
        seen.add(g)
    return sum(len(w) for w, c in zip(words, covered) if c) / total


def gopher_repetition(text: str) -> dict[str, bool]:
    """Gopher's repetition rules; True where the rule removes the document."""
    r = GOPHER_REPETITION
    lines = [ln for ln in text.splitlines() if ln.strip()]
    paras = [p for p in re.split(r"\n{2,}", text) if p.strip()]
    line_frac, line_chars = _dup_fractions(lines)
    para_frac, para_chars = _dup_fractions(paras)
    words = [w.lower() for w in _words(text)]
    out = {"duplicate lines": line_frac > r["dup_lines"],
           "duplicate paragraphs": para_frac > r["dup_paragraphs"],
           "duplicate line chars": line_chars > r["dup_line_chars"],
           "duplicate paragraph chars": para_chars > r["dup_paragraph_chars"]}
    for n, limit in r["top_ngram_chars"].items():
        out[f"top {n}-gram"] = top_ngram_char_fraction(words, n) > limit
    repeats = True  # a repeated n-gram contains a repeated shorter one: stop at the first none
    for n, limit in r["dup_ngram_chars"].items():
        frac = dup_ngram_char_fraction(words, n) if repeats else 0.0
        repeats = frac > 0
        out[f"duplicate {n}-grams"] = frac > limit
    return out


def c4_clean(text: str) -> tuple[str, dict[str, bool]]:
    """C4's rules: keep the lines that end in terminal punctuation, have at least 5 words and do
    not mention javascript; then drop the page (flags) if under 3 sentences remain, or it has
    "lorem ipsum" or a curly bracket. Returns (kept lines, flags)."""
    kept = [ln for ln in text.splitlines()
            if ln.rstrip().endswith(_TERMINAL) and len(ln.split()) >= C4["min_words_per_line"]
            and "javascript" not in ln.lower()]
    cleaned = "\n".join(kept)
    sentences = [s for s in re.split(r"[.!?]+", cleaned) if s.strip()]
    flags = {"lorem ipsum": "lorem ipsum" in text.lower(), "curly bracket": "{" in text,
             "too few sentences": len(sentences) < C4["min_sentences"]}
    return cleaned, flags


def rules(text: str) -> dict[str, bool]:
    """Every page-level rule of this module (Gopher quality, Gopher repetition, C4)."""
    return {**{f"gopher: {k}": v for k, v in gopher_quality(text).items()},
            **{f"repetition: {k}": v for k, v in gopher_repetition(text).items()},
            **{f"c4: {k}": v for k, v in c4_clean(text)[1].items()}}


JUNK_KINDS = ("keyword list", "hashtags", "ellipsis teasers", "bullet menu", "boilerplate",
              "numbers table", "code", "lorem ipsum")


def junk_documents(docs: Sequence[str], per_kind: int, seed: int = 0) -> dict[str, list[str]]:
    """Planted low-quality documents built from the corpus's own words and lines, `per_kind` of
    each kind in JUNK_KINDS; each is aimed at one rule and has at least 60 words, so that the
    length rule is not what catches it."""
    if per_kind < 1:
        raise ValueError(f"per_kind must be >= 1, got {per_kind}")
    rng = np.random.default_rng(seed)
    lines = [ln for d in docs for ln in d.splitlines()[1:] if len(ln.split()) >= 6]
    vocab = sorted({w.strip(".,;:!?'\"-").lower() for d in docs for w in d.split()} - STOP_WORDS
                   - {""})
    if len(lines) < 10 or len(vocab) < 100:
        raise ValueError("junk_documents needs documents with at least 10 lines of 6+ words "
                         "and 100 distinct words")

    def words(k: int) -> list[str]:
        return [vocab[i] for i in rng.integers(len(vocab), size=k)]

    def line() -> str:
        return lines[rng.integers(len(lines))]

    def make(kind: str) -> str:
        if kind == "keyword list":
            return ", ".join(w.capitalize() for w in words(70))
        if kind == "hashtags":
            return "\n".join(line() + " " + " ".join("#" + w for w in words(3)) for _ in range(8))
        if kind == "ellipsis teasers":
            return "\n".join(" ".join(line().split()[:7]) + "..." for _ in range(12))
        if kind == "bullet menu":
            return "\n".join("\u2022 " + " ".join(words(5)) for _ in range(14))
        if kind == "boilerplate":
            one = line()
            return "\n".join([line(), *[one] * 12, line()])
        if kind == "numbers table":
            rows = [" ".join(str(x) for x in rng.integers(0, 10_000, size=6)) for _ in range(10)]
            return "\n".join(f"{w} {r}" for w, r in zip(words(10), rows))
        if kind == "code":
            return "\n".join(f"function {a}({b}) {{ return {b}.{c}(\"{line()}\"); }}"
                             for a, b, c in zip(words(8), words(8), words(8)))
        return "Lorem ipsum dolor sit amet. " + " ".join(line() for _ in range(8))

    return {kind: [make(kind) for _ in range(per_kind)] for kind in JUNK_KINDS}
