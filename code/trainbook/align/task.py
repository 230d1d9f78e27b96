"""The verifiable task and the chat format every Part 7 chapter trains and scores on.

A model small enough to train on a laptop CPU cannot chat, but it can learn multi-digit
addition, and a completion there is right or wrong by exact match: a reward nobody has to learn.
`make_problems` draws problems "a+b" with operands written at a fixed width (`digits`, zero
padded), so every prompt of a task has the same length and a batch needs no padding;
the answer is the plain sum. Train and test problems are disjoint by a hash of the operands, so
no test item is ever in training data (the evaluation chapter checks that with n-grams).

The chat format is the usual one reduced to its parts: `<|bos|><|user|>07+58<|assistant|>65<|eos|>`.
`ChatTokenizer` is byte-level (one token per character, the five special tokens first) and is a
real Hugging Face `tokenizers` tokenizer with a chat template, so the same ids come out of
`transformers` after export. Pretraining text is the raw form `07+58=65` one per line: a base
model learns arithmetic from it but has never seen the chat tokens, which is what supervised
fine-tuning then teaches.

Chapter: book/alignment/evaluation
"""

from __future__ import annotations

import json
import random
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer

SPECIAL = ("<|pad|>", "<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>")
PAD, BOS, EOS, USER, ASSISTANT = range(len(SPECIAL))
VOCAB_SIZE = 256 + len(SPECIAL)  # every byte, no merges: one token per character
TEST_SHARE = 10  # one operand pair in TEST_SHARE is a test item
# The template transformers renders (apply_chat_template): the same ids as ChatTokenizer.chat_ids.
CHAT_TEMPLATE = ("{{ '<|bos|>' }}{% for m in messages %}{% if m['role'] == 'user' %}"
                 "{{ '<|user|>' + m['content'] }}{% else %}{{ '<|assistant|>' + m['content'] + "
                 "'<|eos|>' }}{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")


@dataclass(frozen=True)
class Problem:
    """One task item: the user's prompt and the one right answer."""

    prompt: str
    answer: str


def _whole(name: str, value, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be a whole number >= {least}, got {value!r}")
    return value


def check_fields(obj: object, positive: Sequence[str] = (),
                 non_negative: Sequence[str] = ()) -> None:
    """Raise ValueError naming the first field of a settings dataclass that is not a number of
    the right sign (whole where the default is whole). For the settings classes of Part 7."""
    for name in (*positive, *non_negative):
        value = getattr(obj, name)
        whole = isinstance(type(obj).__dataclass_fields__[name].default, int)
        kind = (int,) if whole else (int, float)
        bad = isinstance(value, bool) or not isinstance(value, kind) or value < 0 or \
            (value == 0 and name in positive) or value != value
        if bad:
            sign = "positive" if name in positive else "non-negative"
            raise ValueError(f"{type(obj).__name__}.{name} must be a {sign} "
                             f"{'whole number' if whole else 'number'}, got {value!r}")


def split_of(a: int, b: int) -> str:
    """'test' for one operand pair in TEST_SHARE (by CRC32, stable across runs and machines)."""
    return "test" if zlib.crc32(f"{a},{b}".encode()) % TEST_SHARE == 0 else "train"


def problem(a: int, b: int, digits: int) -> Problem:
    """The item a+b with both operands written at `digits` width."""
    return Problem(f"{a:0{digits}d}+{b:0{digits}d}", str(a + b))


def make_problems(n: int, digits: int = 2, seed: int = 0, split: str = "train") -> list[Problem]:
    """n problems of the split, drawn with replacement from all operand pairs below 10**digits.

    Raises ValueError for a bad count, width or split, or a test split asked for more distinct
    items than exist."""
    _whole("n", n, 1)
    _whole("digits", digits, 1)
    if digits > 6:
        raise ValueError(f"digits={digits} makes prompts longer than the models here; use 1..6")
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    rng, top, out = random.Random(f"{seed}-{digits}-{split}"), 10 ** digits, []
    while len(out) < n:
        a, b = rng.randrange(top), rng.randrange(top)
        if split_of(a, b) == split:
            out.append(problem(a, b, digits))
    return out


def all_problems(digits: int, split: str) -> list[Problem]:
    """Every item of a split, in operand order (small widths only: 10**(2*digits) pairs)."""
    _whole("digits", digits, 1)
    if digits > 3:
        raise ValueError(f"all_problems enumerates 10**{2 * digits} pairs; use digits <= 3 or "
                         "make_problems to sample")
    top = 10 ** digits
    return [problem(a, b, digits) for a in range(top) for b in range(top)
            if split_of(a, b) == split]


def verify(item: Problem, completion: str) -> float:
    """The reward: 1.0 if the completion is exactly the answer (surrounding space ignored)."""
    return float(completion.strip() == item.answer)


def raw_line(item: Problem) -> str:
    """The pretraining form of an item: `07+58=65`."""
    return f"{item.prompt}={item.answer}"


def pretraining_text(n: int, digits: int = 2, seed: int = 0) -> str:
    """n training items in raw form, one per line: the base model's corpus."""
    return "".join(raw_line(p) + "\n" for p in make_problems(n, digits, seed, "train"))


class ChatTokenizer:
    """Byte-level tokenizer with the chat special tokens, backed by Hugging Face `tokenizers`."""

    pad_id, bos_id, eos_id, user_id, assistant_id = PAD, BOS, EOS, USER, ASSISTANT
    special = SPECIAL

    def __init__(self, tok: Tokenizer):
        got = [tok.token_to_id(s) for s in SPECIAL]
        if got != list(range(len(SPECIAL))) or tok.get_vocab_size() != VOCAB_SIZE:
            raise ValueError(f"not a chat tokenizer: special ids {got}, vocabulary "
                             f"{tok.get_vocab_size()}; build one with chat_tokenizer()")
        self.hf = tok

    @property
    def vocab_size(self) -> int:
        return VOCAB_SIZE

    def encode(self, text: str) -> list[int]:
        """Ids of text, without adding any token. As in Hugging Face `tokenizers` by default, a
        special token's string inside the text becomes that special token (a user who types
        `<|eos|>` ends the turn): sanitise untrusted text before it reaches a template."""
        if not isinstance(text, str):
            raise ValueError(f"encode takes a str, got {type(text).__name__}")
        return self.hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def prompt_ids(self, prompt: str) -> list[int]:
        """`<|bos|><|user|>prompt<|assistant|>`: what a model continues with its answer."""
        return [BOS, USER, *self.encode(prompt), ASSISTANT]

    def chat_ids(self, prompt: str, response: str) -> tuple[list[int], list[int]]:
        """The ids of a whole exchange and its loss mask: 1 on the response and its `<|eos|>`
        (the tokens the assistant produces), 0 on the rest."""
        head, tail = self.prompt_ids(prompt), [*self.encode(response), EOS]
        return head + tail, [0] * len(head) + [1] * len(tail)

    def save_pretrained(self, folder: str | Path) -> list[Path]:
        """tokenizer.json and tokenizer_config.json, which `transformers.AutoTokenizer` loads
        (with the chat template and the special tokens' roles)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.hf.save(str(folder / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIAL[BOS],
                  "eos_token": SPECIAL[EOS], "pad_token": SPECIAL[PAD],
                  "chat_template": CHAT_TEMPLATE, "model_max_length": 1 << 20,
                  "add_bos_token": False, "clean_up_tokenization_spaces": False}
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
        return [folder / "tokenizer.json", folder / "tokenizer_config.json"]

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> ChatTokenizer:
        from tokenizers import Tokenizer

        path = Path(folder) / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{folder} has no tokenizer.json; save one with save_pretrained")
        return cls(Tokenizer.from_file(str(path)))


def chat_tokenizer() -> ChatTokenizer:
    """The byte-level chat tokenizer: the five special tokens (ids 0-4), then the 256 bytes."""
    from ..pretrain.bpe import train_hf

    return ChatTokenizer(train_hf([], VOCAB_SIZE, SPECIAL))


def encode_prompts(tok: ChatTokenizer, items: Sequence[Problem]) -> list[list[int]]:
    """Chat prompts of the items, ready for `policy.sample`."""
    return [tok.prompt_ids(p.prompt) for p in items]
