"""Text, tokenizers, packing and a deterministic, resumable, rank-sharded loader.

The corpus ships inside the package (nothing is downloaded). Tokenizers: bytes (256 ids, no
training) or byte-level BPE trained here with Hugging Face `tokenizers`. Documents are packed
into fixed-length blocks; `ShardedLoader` gives every rank its slice of each global batch in
an order fixed by (seed, epoch) and can save and restore its position exactly.

Chapter: book/start/first-run.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tokenizers import Tokenizer

CORPORA = {"tinyshakespeare": "tinyshakespeare.txt"}
CORPUS_SHA256 = {
    "tinyshakespeare": "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed",
}


def load_corpus(name: str = "tinyshakespeare") -> str:
    """The text of a shipped corpus (checked against its recorded sha256), or of a UTF-8 text
    file: your own data, or a cleaned corpus that an earlier stage wrote (book/start/lifecycle)."""
    if name in CORPORA:
        raw = resources.files("trainbook.corpus").joinpath(CORPORA[name]).read_bytes()
        if hashlib.sha256(raw).hexdigest() != CORPUS_SHA256[name]:
            raise RuntimeError(f"corpus {name} is corrupt (sha256 mismatch); reinstall trainbook")
        return raw.decode("utf-8")
    path = Path(name)
    if not path.is_file():
        raise ValueError(f"unknown corpus {name!r}: give a shipped corpus "
                         f"({', '.join(CORPORA)}) or the path of a UTF-8 text file")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"corpus {name} is not UTF-8 text ({e}); convert it, e.g. with iconv "
                         "-t UTF-8") from None
    if not text.strip():
        raise ValueError(f"corpus {name} is empty; give a file with text to train on")
    return text


def _corpus_key(name: str) -> str:
    """A file-name-safe key for a corpus: its name if shipped, else stem and content hash (two
    files of the same name never share a cached tokenizer)."""
    if name in CORPORA:
        return name
    digest = hashlib.sha256(load_corpus(name).encode("utf-8")).hexdigest()[:12]
    return f"{Path(name).stem}-{digest}"


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, nothing to train, never out of vocabulary."""

    kind = "bytes"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class BPETokenizer:
    """Byte-level BPE (GPT-2 style) trained locally with Hugging Face `tokenizers`."""

    kind = "bpe"

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer

    @classmethod
    def train(cls, text: str, vocab_size: int) -> BPETokenizer:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        if not 256 < vocab_size <= 65536:
            raise ValueError(f"BPE vocab_size must be in (256, 65536], got {vocab_size}; "
                             "use ByteTokenizer for 256")
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
        return cls(tok)

    @classmethod
    def from_file(cls, path: str | Path) -> BPETokenizer:
        from tokenizers import Tokenizer
        return cls(Tokenizer.from_file(str(path)))

    def save(self, path: str | Path) -> None:
        self._tok.save(str(path))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids])

    @property
    def unk(self) -> tuple[str, int] | None:
        """The model's unknown token and its id (WordLevel, WordPiece, a BPE with one), or None
        (byte-level BPE encodes any text)."""
        token = getattr(self._tok.model, "unk_token", None)
        ident = self._tok.token_to_id(token) if token else None
        return (token, ident) if ident is not None else None


MAX_UNK_SHARE = 0.01  # a tokenizer made for this kind of text leaves almost nothing unknown


def check_unknown_share(tokenizer: ByteTokenizer | BPETokenizer, ids: torch.Tensor,
                        what: str = "the corpus") -> float:
    """The share of `ids` that are the tokenizer's unknown token; a ValueError above
    MAX_UNK_SHARE: a model trained on them learns to predict the unknown token, and its loss
    looks excellent while it learns nothing of the text."""
    unk = getattr(tokenizer, "unk", None)
    if unk is None or not len(ids):
        return 0.0
    share = (ids == unk[1]).double().mean().item()
    if share > MAX_UNK_SHARE:
        raise ValueError(f"the tokenizer maps {share:.1%} of {what}'s tokens to its unknown token "
                         f"{unk[0]!r} (at most {MAX_UNK_SHARE:.0%} is plausible): it was not made "
                         "for this text; train one on it (python -m trainbook tokenizer train "
                         "--input CORPUS --out tokenizer.json) or use --tokenizer bpe")
    return share


def make_tokenizer(kind: str = "bpe", vocab_size: int = 1024, corpus: str = "tinyshakespeare",
                   cache_dir: str | Path | None = None) -> ByteTokenizer | BPETokenizer:
    """'bytes'; 'bpe', a BPE of `vocab_size` trained on `corpus` (cached as JSON in cache_dir
    if given); or the path of a tokenizer saved as Hugging Face `tokenizers` JSON (its own
    vocabulary: `vocab_size` is then ignored)."""
    if kind == "bytes":
        return ByteTokenizer()
    if kind != "bpe":
        return load_tokenizer_file(kind)
    if cache_dir is not None:
        path = Path(cache_dir) / f"bpe-{_corpus_key(corpus)}-{vocab_size}.json"
        if path.exists():
            return BPETokenizer.from_file(path)
    tok = BPETokenizer.train(load_corpus(corpus), vocab_size)
    if cache_dir is not None:  # atomic: ranks sharing the cache never read a half-written file
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tok.save(tmp)
        os.replace(tmp, path)
    return tok


def load_tokenizer_file(path: str | Path) -> BPETokenizer:
    """A tokenizer saved by `tokenizers` (`Tokenizer.save`, or `BPE.to_hf().save` of
    trainbook.pretrain.bpe). Raises ValueError naming the file and the fix."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"unknown tokenizer {str(path)!r}: use 'bytes', 'bpe' or the path of a "
                         "tokenizer.json saved by Hugging Face tokenizers")
    try:
        return BPETokenizer.from_file(p)
    except Exception as e:  # tokenizers raises its own Exception type for a malformed file
        raise ValueError(f"cannot read {str(path)!r} as a tokenizers JSON file ({e}); save one "
                         "with Tokenizer.save") from None


def pack(tokens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Cut a token stream into blocks of seq_len + 1 (inputs and shifted targets), stride seq_len.

    Consecutive blocks share one token, so every token is a target exactly once; the tail that
    does not fill a block is dropped.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    n = (len(tokens) - 1) // seq_len
    if n < 1:
        raise ValueError(f"{len(tokens)} tokens are too few for one block of seq_len {seq_len}")
    idx = torch.arange(n)[:, None] * seq_len + torch.arange(seq_len + 1)
    return tokens[idx]


@dataclass
class Dataset:
    """Packed train and validation blocks (each row: seq_len + 1 token ids)."""

    train: torch.Tensor
    val: torch.Tensor
    tokenizer: object
    seq_len: int


def build_dataset(tokenizer: ByteTokenizer | BPETokenizer, seq_len: int,
                  corpus: str = "tinyshakespeare", val_fraction: float = 0.1) -> Dataset:
    """Tokenize a corpus, split off the last `val_fraction` of the text, and pack both parts."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    text = load_corpus(corpus)
    cut = int(len(text) * (1 - val_fraction))
    enc = lambda t: torch.tensor(tokenizer.encode(t), dtype=torch.long)  # noqa: E731
    train_ids = enc(text[:cut])
    check_unknown_share(tokenizer, train_ids)
    return Dataset(pack(train_ids, seq_len), pack(enc(text[cut:]), seq_len), tokenizer, seq_len)


class ShardedLoader:
    """Deterministic batches of packed blocks, sharded by rank, with a saveable position.

    Each epoch is a permutation of all blocks drawn from (seed, epoch). A global batch is
    `batch_size * world_size` consecutive blocks of it; rank r takes rows [r*B, (r+1)*B). So
    the union over ranks of a step's batches is the same whatever the world size, and the
    state (epoch, step) is all it takes to resume.
    """

    def __init__(self, blocks: torch.Tensor, batch_size: int, rank: int = 0, world_size: int = 1,
                 seed: int = 0):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if batch_size * world_size > len(blocks):
            raise ValueError(f"a global batch of {batch_size * world_size} blocks needs more than "
                             f"the {len(blocks)} blocks available; lower batch size or seq_len")
        self.blocks, self.batch_size, self.rank, self.world_size, self.seed = \
            blocks, batch_size, rank, world_size, seed
        self.epoch, self.step = 0, 0

    @property
    def steps_per_epoch(self) -> int:
        return len(self.blocks) // (self.batch_size * self.world_size)

    def _order(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.blocks), generator=g)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (batch_size, seq_len); advances the position."""
        if self.step >= self.steps_per_epoch:
            self.epoch, self.step = self.epoch + 1, 0
        global_b = self.batch_size * self.world_size
        start = self.step * global_b + self.rank * self.batch_size
        rows = self._order(self.epoch)[start:start + self.batch_size]
        self.step += 1
        block = self.blocks[rows]
        return block[:, :-1], block[:, 1:]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "step": self.step, "seed": self.seed,
                "batch_size": self.batch_size, "world_size": self.world_size}

    def load_state_dict(self, state: dict) -> None:
        for k in ("seed", "batch_size", "world_size"):
            if state[k] != getattr(self, k):
                raise ValueError(f"loader state was saved with {k}={state[k]}, this loader has "
                                 f"{getattr(self, k)}; resume with the same settings")
        self.epoch, self.step = state["epoch"], state["step"]
