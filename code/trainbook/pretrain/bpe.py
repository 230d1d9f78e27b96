"""Byte-level BPE from scratch: GPT-2 pre-tokenisation, the merge loop, special tokens.

The tokenizer GPT-2, RoBERTa, Llama 3 and most open models use. Text is cut into pre-tokens by
the GPT-2 regex (so no merge crosses a word/space/punctuation boundary), each pre-token is its
UTF-8 bytes, and training repeatedly merges the most frequent adjacent pair into a new token.

It is written to agree with Hugging Face `tokenizers` (`BpeTrainer` with a `ByteLevel`
pre-tokenizer) id for id, so the two can be compared exactly: the 256 byte tokens are numbered
in the order of the printable character GPT-2 maps each byte to (`bytes_to_unicode`), special
tokens come first, and among pairs of equal count the one with the smallest (left id, right id)
is merged first, as `BpeTrainer` orders its queue. `train_hf` is that native trainer with the
same settings; `compare` says where two tokenizers differ.

Chapter: book/pretraining/data-tokenization.
"""

from __future__ import annotations

import heapq
import json
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# GPT-2's pre-tokenisation pattern (openai/gpt-2 src/encoder.py; the one tokenizers' ByteLevel
# uses): contractions, an optional space plus letters, plus digits, plus other symbols, then
# runs of whitespace (a run before a word leaves its last space to the word).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


@lru_cache(maxsize=1)
def _splitter() -> Any:
    try:
        import regex  # \p{L}, \p{N}: Unicode letters and numbers
        return regex.compile(GPT2_PATTERN)
    except ImportError:  # stdlib re has no \p{..}; same split for text without Nl/No numerals
        return re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+"""
                          r"""|\s+(?!\S)|\s+""")


def pretokenize(text: str) -> list[str]:
    """Cut text into GPT-2 pre-tokens; BPE merges never cross their boundaries."""
    return _splitter().findall(text)


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from the 256 byte values to printable characters (space -> 'Ġ', newline ->
    'Ċ'), so a byte-level token is a readable string in a vocabulary file."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    out, n = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


def _base_order() -> list[int]:
    """Byte values in the order tokenizers numbers its alphabet: by the mapped character."""
    b2u = bytes_to_unicode()
    return sorted(range(256), key=lambda b: b2u[b])


@dataclass
class BPE:
    """A trained byte-level BPE: `tokens[i]` is token i's bytes, `merges` the merged id pairs in
    rank order with the id each produced, `special` the special tokens (ids 0..k-1)."""

    tokens: list[bytes]
    merges: list[tuple[tuple[int, int], int]]
    special: tuple[str, ...] = ()
    _cache: dict[str, list[int]] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._rank = {}
        for rank, (pair, new) in enumerate(self.merges):
            self._rank.setdefault(pair, (rank, new))  # a repeated pair keeps its first rank
        self._byte_id = {t[0]: i for i, t in enumerate(self.tokens)
                         if i >= len(self.special) and len(t) == 1}
        self._special_id = {s: i for i, s in enumerate(self.special)}
        self._special_re = (re.compile("|".join(map(re.escape, sorted(self.special, key=len,
                                                                      reverse=True))))
                            if self.special else None)

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def vocab(self) -> dict[str, int]:
        """token string -> id in the byte-to-character form tokenizers writes (first id wins)."""
        b2u = bytes_to_unicode()
        out: dict[str, int] = {}
        for i, t in enumerate(self.tokens):
            s = self.special[i] if i < len(self.special) else "".join(b2u[b] for b in t)
            out.setdefault(s, i)
        return out

    def truncate(self, vocab_size: int) -> BPE:
        """The BPE that training with a smaller vocab_size gives: merges are learned one after
        another, so it is this one's merges up to the one that made token vocab_size - 1."""
        base = 256 + len(self.special)
        if not base <= vocab_size <= self.vocab_size:
            raise ValueError(f"vocab_size must be in [{base}, {self.vocab_size}] to truncate "
                             f"this tokenizer, got {vocab_size}")
        merges = []
        for pair, new in self.merges:
            if vocab_size == base:
                break
            merges.append((pair, new))
            if new == vocab_size - 1:
                break
        return BPE(self.tokens[:vocab_size], merges, self.special)

    def merge_strings(self) -> list[tuple[str, str]]:
        """The merges as (left, right) token strings, in rank order."""
        b2u = bytes_to_unicode()
        s = ["".join(b2u[b] for b in t) for t in self.tokens]
        return [(s[a], s[b]) for (a, b), _ in self.merges]

    def _encode_word(self, word: str) -> list[int]:
        ids = self._cache.get(word)
        if ids is not None:
            return ids
        ids = [self._byte_id[b] for b in word.encode("utf-8")]
        while len(ids) > 1:  # merge the lowest-ranked pair present, all its occurrences
            best = min(self._rank.get(p, (len(self.merges), -1)) for p in zip(ids, ids[1:]))
            if best[1] < 0:
                break
            rank, new = best
            pair = self.merges[rank][0]
            out, i = [], 0
            while i < len(ids):
                if i + 1 < len(ids) and (ids[i], ids[i + 1]) == pair:
                    out.append(new)
                    i += 2
                else:
                    out.append(ids[i])
                    i += 1
            ids = out
        self._cache[word] = ids
        return ids

    def encode(self, text: str) -> list[int]:
        """Token ids: special tokens matched first, the rest pre-tokenised and merged by rank."""
        if not isinstance(text, str):
            raise ValueError(f"encode takes a str, got {type(text).__name__}")
        pieces = [(False, text)]
        if self._special_re is not None:
            pieces, pos = [], 0
            for m in self._special_re.finditer(text):
                pieces += [(False, text[pos:m.start()]), (True, m.group())]
                pos = m.end()
            pieces.append((False, text[pos:]))
        out: list[int] = []
        for is_special, piece in pieces:
            if is_special:
                out.append(self._special_id[piece])
            else:
                for word in pretokenize(piece):
                    out += self._encode_word(word)
        return out

    def decode(self, ids: Iterable[int]) -> str:
        """Concatenate the tokens' bytes and decode (invalid UTF-8 becomes U+FFFD)."""
        raw = bytearray()
        for i in ids:
            i = int(i)
            if not 0 <= i < len(self.tokens):
                raise ValueError(f"token id {i} is outside the vocabulary of {len(self.tokens)}")
            raw += self.tokens[i]
        return raw.decode("utf-8", errors="replace")

    def to_hf(self) -> Tokenizer:
        """The same vocabulary and merges as a `tokenizers.Tokenizer` (save it with .save())."""
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        tok = Tokenizer(models.BPE(vocab=self.vocab(), merges=self.merge_strings()))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        if self.special:
            tok.add_special_tokens([AddedToken(s, special=True) for s in self.special])
        return tok

    @classmethod
    def from_hf(cls, tok: Tokenizer) -> BPE:
        """Read a byte-level BPE `tokenizers.Tokenizer` (vocabulary, merges, special tokens)."""
        spec = json.loads(tok.to_str())
        model = spec.get("model", {})
        if model.get("type") != "BPE":
            raise ValueError(f"not a BPE tokenizer (model type {model.get('type')!r})")
        u2b = {u: b for b, u in bytes_to_unicode().items()}
        vocab: dict[str, int] = model["vocab"]
        special = tuple(t["content"] for t in sorted(spec.get("added_tokens", []),
                                                     key=lambda t: t["id"]))
        if [vocab.get(s) for s in special] != list(range(len(special))):
            raise ValueError("special tokens must have the first ids (0, 1, ...)")
        tokens: list[bytes] = [b""] * len(vocab)
        for s, i in vocab.items():
            if i < len(special):
                tokens[i] = s.encode("utf-8")
            else:
                try:
                    tokens[i] = bytes(u2b[c] for c in s)
                except KeyError:
                    raise ValueError(f"token {s!r} is not byte-level (GPT-2 byte characters); "
                                     "only ByteLevel BPE tokenizers can be read") from None
        merges = []
        for m in model["merges"]:
            a, b = m.split(" ") if isinstance(m, str) else m
            merges.append(((vocab[a], vocab[b]), vocab[a + b]))
        return cls(tokens, merges, special)

    def save(self, path: str | Path) -> None:
        """Write a tokenizer.json that `tokenizers.Tokenizer.from_file` loads."""
        self.to_hf().save(str(path))

    @classmethod
    def from_file(cls, path: str | Path) -> BPE:
        from tokenizers import Tokenizer
        if not Path(path).is_file():
            raise ValueError(f"no tokenizer file at {path}; train one with "
                             "`python -m trainbook tokenizer train`")
        return cls.from_hf(Tokenizer.from_file(str(path)))


def _check(vocab_size: int, special_tokens: Sequence[str], min_frequency: int) -> None:
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise ValueError(f"vocab_size must be a whole number, got {vocab_size!r}")
    if vocab_size > 1 << 24:
        raise ValueError(f"vocab_size {vocab_size} is beyond any real vocabulary; use at most "
                         f"{1 << 24:,}")
    if vocab_size < 256 + len(special_tokens):
        raise ValueError(f"vocab_size {vocab_size} is below the 256 byte tokens plus "
                         f"{len(special_tokens)} special tokens; use at least "
                         f"{256 + len(special_tokens)}")
    if min_frequency < 0:
        raise ValueError(f"min_frequency must be >= 0, got {min_frequency}")
    if len(set(special_tokens)) != len(special_tokens) or "" in special_tokens:
        raise ValueError(f"special tokens must be distinct and non-empty, got {special_tokens}")


def word_counts(texts: Iterable[str]) -> Counter:
    """Pre-token frequencies over an iterable of texts (each text pre-tokenised on its own)."""
    if isinstance(texts, str):
        raise ValueError("pass an iterable of texts (e.g. [text] or text.splitlines(True)), "
                         "not a single str")
    counts: Counter = Counter()
    for t in texts:
        counts.update(pretokenize(t))
    return counts


TIE_BREAKS = ("ids", "bytes")


def train_bpe(texts: Iterable[str], vocab_size: int, special_tokens: Sequence[str] = (),
              min_frequency: int = 0, tie_break: str = "ids") -> BPE:
    """Train byte-level BPE until the vocabulary (special + 256 bytes + merges) has vocab_size
    tokens, or no pair occurs at least min_frequency times.

    Pair counts are kept up to date incrementally: a merge rewrites only the words that contain
    the pair and adjusts the counts of the pairs around it. A max-heap with lazy deletion finds
    the most frequent pair. Ties go to the smallest (left id, right id), as in `BpeTrainer`;
    tie_break="bytes" orders them by the tokens' bytes instead, to show what the rule changes.
    """
    special_tokens = tuple(special_tokens)
    _check(vocab_size, special_tokens, min_frequency)
    if tie_break not in TIE_BREAKS:
        raise ValueError(f"tie_break {tie_break!r} is unknown; use one of {TIE_BREAKS}")
    counts = word_counts(texts)
    tokens = [s.encode("utf-8") for s in special_tokens] + [bytes([b]) for b in _base_order()]
    known = {t: i for i, t in enumerate(tokens) if i >= len(special_tokens)}
    byte_id = {t[0]: i for t, i in known.items()}
    words = [[byte_id[b] for b in w.encode("utf-8")] for w in counts]
    freq = list(counts.values())

    pair_count: dict[tuple[int, int], int] = defaultdict(int)
    where: dict[tuple[int, int], set[int]] = defaultdict(set)
    for wi, w in enumerate(words):
        for p in zip(w, w[1:]):
            pair_count[p] += freq[wi]
            where[p].add(wi)
    def key(p: tuple[int, int]) -> tuple:
        return p if tie_break == "ids" else (tokens[p[0]], tokens[p[1]])

    heap = [(-c, key(p), p) for p, c in pair_count.items()]
    heapq.heapify(heap)
    merges: list[tuple[tuple[int, int], int]] = []
    n_special = len(special_tokens)
    while len(known) + n_special < vocab_size and heap:
        neg, _, pair = heapq.heappop(heap)
        count = pair_count.get(pair, 0)
        if -neg != count:  # stale entry: its count fell since it was pushed
            if count > 0:
                heapq.heappush(heap, (-count, key(pair), pair))
            continue
        if count < 1 or min_frequency > count:
            break
        a, b = pair
        new_bytes = tokens[a] + tokens[b]
        new = known.get(new_bytes)
        if new is None:  # two merge paths can spell the same bytes: reuse the id (as tokenizers)
            new = len(tokens)
            tokens.append(new_bytes)
            known[new_bytes] = new
        merges.append((pair, new))
        delta: dict[tuple[int, int], int] = defaultdict(int)
        for wi in where.pop(pair, ()):
            w, f = words[wi], freq[wi]
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    out.append(new)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            if len(out) == len(w):
                continue  # a stale position: the pair left this word in an earlier merge
            for p in zip(w, w[1:]):
                delta[p] -= f
            for p in zip(out, out[1:]):
                delta[p] += f
                where[p].add(wi)
            words[wi] = out
        for p, d in delta.items():
            if d:
                pair_count[p] += d
                if d > 0:
                    heapq.heappush(heap, (-pair_count[p], key(p), p))
        pair_count.pop(pair, None)
    return BPE(tokens, merges, special_tokens)


def train_hf(texts: Iterable[str], vocab_size: int, special_tokens: Sequence[str] = (),
             min_frequency: int = 0) -> Tokenizer:
    """The native trainer with the settings `train_bpe` implements: tokenizers' `BpeTrainer` on
    a `ByteLevel` pre-tokenizer (GPT-2 regex, no prefix space), all 256 bytes in the alphabet."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    special_tokens = tuple(special_tokens)
    _check(vocab_size, special_tokens, min_frequency)
    if isinstance(texts, str):
        raise ValueError("pass an iterable of texts, not a single str")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=list(special_tokens), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def compare(ours: BPE, theirs: Tokenizer, text: str = "") -> dict[str, Any]:
    """Where two byte-level BPEs differ: vocabularies, merges (the first differing rank) and,
    given a text, the token ids they produce for it."""
    other = BPE.from_hf(theirs)
    a, b = ours.merge_strings(), other.merge_strings()
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if first is None and len(a) != len(b):
        first = min(len(a), len(b))
    out: dict[str, Any] = {
        "vocab_size": (ours.vocab_size, theirs.get_vocab_size()),
        "same_vocab": ours.vocab() == theirs.get_vocab(),
        "merges": (len(a), len(b)),
        "same_merges": first is None,
        "first_different_merge": first,
        "repeated_token_merges": len(ours.merges) - len({n for _, n in ours.merges}),
    }
    if text:
        mine, native = ours.encode(text), theirs.encode(text).ids
        out["same_ids"] = mine == native
        out["tokens"] = (len(mine), len(native))
    return out


def bytes_per_token(encode: Any, text: str) -> float:
    """UTF-8 bytes of text per token the encoder produces for it (higher: shorter sequences)."""
    if not text:
        raise ValueError("bytes_per_token needs a non-empty text")
    ids = encode(text)
    ids = getattr(ids, "ids", ids)  # a tokenizers Encoding or a list of ids
    return len(text.encode("utf-8")) / len(ids)
