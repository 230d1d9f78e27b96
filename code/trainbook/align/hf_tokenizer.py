"""Tokenizers to and from a Hugging Face model folder: the files `transformers.AutoTokenizer`
loads, written for each of the book's tokenizers, and the tokenizer a folder or a checkpoint
holds read back.

The chat tokenizer writes its own files (`task.ChatTokenizer.save_pretrained`: the chat template
and the special tokens' roles); a BPE trained by the book is already a `tokenizers.Tokenizer`;
`ByteTokenizer`, which has no Hugging Face form of its own, becomes a byte-level BPE without
merges whose ids are the byte values. A trainer checkpoint records its tokenizer as the trainer's
--tokenizer setting (bytes, bpe or a file): `tokenizer_of` rebuilds it (a BPE is trained again on
the same corpus, which gives the same merges) so that `export-hf` can ship it.

Chapter: book/alignment/evaluation
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..data import BPETokenizer, ByteTokenizer
from . import task


def as_folder(path: object, what: str) -> Path:
    """A path given as a str or Path, or a ValueError naming the argument."""
    if not isinstance(path, (str, Path)) or not str(path):
        raise ValueError(f"{what} must be a folder path, got {path!r}")
    return Path(path)


def hf_tokenizer(tokenizer: object) -> Any:
    """The Hugging Face `tokenizers.Tokenizer` of one of the book's tokenizers: the chat
    tokenizer's own, a trained BPE's own, or for `ByteTokenizer` a byte-level BPE with no merges
    whose ids are the byte values (the same ids for every text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from ..pretrain.bpe import bytes_to_unicode

    if isinstance(tokenizer, task.ChatTokenizer):
        return tokenizer.hf
    if isinstance(tokenizer, BPETokenizer):
        return tokenizer._tok
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    if isinstance(tokenizer, ByteTokenizer):
        vocab = {ch: b for b, ch in bytes_to_unicode().items()}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        return tok
    raise ValueError(f"cannot save a {type(tokenizer).__name__} as a Hugging Face tokenizer; "
                     "give a ChatTokenizer, BPETokenizer, ByteTokenizer or tokenizers.Tokenizer")


def save_tokenizer(tokenizer: object, folder: str | Path) -> list[Path]:
    """tokenizer.json and tokenizer_config.json that `AutoTokenizer` loads (the chat tokenizer
    writes its template and special tokens; others are plain text tokenizers)."""
    folder = as_folder(folder, "folder")
    if isinstance(tokenizer, task.ChatTokenizer):
        return tokenizer.save_pretrained(folder)
    tok = hf_tokenizer(tokenizer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20,
              "add_bos_token": False, "clean_up_tokenization_spaces": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    return [folder / "tokenizer.json", folder / "tokenizer_config.json"]


def load_tokenizer(folder: str | Path) -> Any:
    """The tokenizer of a model folder: a ChatTokenizer if it is the book's chat tokenizer,
    else a BPETokenizer around its tokenizer.json; None if the folder has none."""
    folder = as_folder(folder, "folder")
    if not (folder / "tokenizer.json").is_file():
        return None
    from ..data import load_tokenizer_file

    tok = load_tokenizer_file(folder / "tokenizer.json")
    return _as_chat(tok._tok) or tok


def tokenizer_of(state: dict, choice: str | None = None) -> Any:
    """The tokenizer to ship with a checkpoint's weights: `choice` ("chat", "bytes", or the
    path of a tokenizer.json or of a model folder), else the one the checkpoint records (the
    tokenizer.json an import stored, or the trainer's --tokenizer: bytes, a file, or a BPE
    trained again, deterministically, on its corpus). None when neither says."""
    from ..data import load_tokenizer_file, make_tokenizer

    if choice is not None:
        if choice == "chat":
            return task.chat_tokenizer()
        if choice == "bytes":
            return ByteTokenizer()
        path = Path(choice)
        if path.is_dir():
            found = load_tokenizer(path)
            if found is None:
                raise ValueError(f"tokenizer folder {choice} has no tokenizer.json")
            return found
        if not path.is_file():
            raise ValueError(f"tokenizer {choice!r} is not chat, bytes, a tokenizer.json file or "
                             "a model folder; give one of those")
        tok = load_tokenizer_file(path)
        return _as_chat(tok._tok) or tok
    if state.get("tokenizer_json"):
        from tokenizers import Tokenizer

        tok = Tokenizer.from_str(state["tokenizer_json"])
        return _as_chat(tok) or BPETokenizer(tok)
    train = state.get("train_config") or {}
    kind = train.get("tokenizer")
    if kind is None:
        return None
    if kind in ("bytes", "bpe"):
        return make_tokenizer(kind, train.get("vocab_size", 1024),
                              train.get("corpus", "tinyshakespeare"), train.get("cache_dir"))
    if not Path(kind).is_file():
        raise ValueError(f"the checkpoint was trained with tokenizer file {kind}, which is not "
                         "on this machine; pass the tokenizer (--tokenizer PATH, or chat)")
    tok = load_tokenizer_file(kind)
    return _as_chat(tok._tok) or tok


def _as_chat(tok) -> task.ChatTokenizer | None:
    """The ChatTokenizer around a tokenizers.Tokenizer if it is the book's chat tokenizer."""
    try:
        return task.ChatTokenizer(tok)
    except ValueError:
        return None
