"""trainbook tokenizer: byte-level BPE. `train` writes a tokenizer.json trained from scratch
(trainbook.pretrain.bpe) or with Hugging Face tokenizers (--impl hf); `encode` prints a text's
token ids; `stats` measures bytes per token of one or more tokenizers; `compare` trains both
ways on the same text and reports whether vocabularies, merges and token ids agree (exit status
1 if not). Without --input the shipped corpus is used: its first 90% to train, its last 10% to
measure. Files from either trainer load with tokenizers.Tokenizer.from_file.

Chapter: book/pretraining/data-tokenization.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from ..data import load_corpus
from ..pretrain import bpe
from ..report import table
from ._args import check_writable, non_negative_int, positive_int

HELP = "byte-level BPE: train (from scratch or tokenizers), encode, bytes per token, compare"
HELD_OUT = 0.1  # the shipped corpus's last 10% is held out for stats and compare


ACTIONS = ("train", "encode", "stats", "compare")
MAX_VOCAB = 1 << 21  # beyond any real vocabulary (Gemma's 256K); keeps sizes in range for Rust
NEEDS = {"train": ("vocab_size", "out"), "encode": ("tokenizer",), "stats": ("tokenizer",),
         "compare": ("vocab_size",)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    # one parser with a positional action (not nested subparsers), so that an unknown option is
    # reported by name whatever the action
    p.add_argument("action", metavar="{train,encode,stats,compare}",
                   help="train a BPE; encode a text; bytes per token; scratch vs tokenizers")
    p.add_argument("--vocab-size", type=positive_int, default=None,
                   help="train, compare: tokens in the vocabulary (special + 256 bytes + merges)")
    p.add_argument("--special-token", action="append", default=[], metavar="TOKEN",
                   help="train, compare: a special token (repeatable), given the first ids")
    p.add_argument("--min-frequency", type=non_negative_int, default=0,
                   help="train, compare: stop when the most frequent pair occurs fewer times")
    p.add_argument("--impl", choices=("scratch", "hf"), default="scratch",
                   help="train: scratch (trainbook.pretrain.bpe) or hf (tokenizers' BpeTrainer)")
    p.add_argument("--out", default=None, help="train: where to write the tokenizer.json")
    p.add_argument("--tokenizer", nargs="+", default=None, metavar="FILE",
                   help="encode (one), stats (one or more): tokenizer.json files")
    p.add_argument("--text", default=None, help="encode: the text to encode")
    p.add_argument("--input", nargs="+", default=None, metavar="FILE",
                   help="UTF-8 text files to train on, encode or measure (default: the shipped "
                        "corpus, its first 90%% to train and its last 10%% to measure)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def _check_args(args: argparse.Namespace) -> None:
    if args.action not in ACTIONS:
        raise ValueError(f"unknown action {args.action!r}; use one of {', '.join(ACTIONS)}")
    for need in NEEDS[args.action]:
        if getattr(args, need) is None:
            flag = "--" + need.replace("_", "-")
            raise ValueError(f"tokenizer {args.action} needs {flag} (see `python -m trainbook "
                             "tokenizer --help`)")
    if args.vocab_size is not None and args.vocab_size > MAX_VOCAB:
        raise ValueError(f"--vocab-size {args.vocab_size} is beyond any real vocabulary; "
                         f"use at most {MAX_VOCAB:,}")
    if args.action == "encode":
        if (args.text is None) == (args.input is None):
            raise ValueError("tokenizer encode needs one of --text or --input")
        if len(args.tokenizer) != 1:
            raise ValueError(f"tokenizer encode takes one --tokenizer, got {len(args.tokenizer)}")
    check_writable(args.out, "--out")


def _read(files: list[str] | None, part: str) -> str:
    """The text of the files, or the shipped corpus's training part / held-out part."""
    if files:
        out = []
        for f in files:
            path = Path(f)
            if not path.is_file():
                raise ValueError(f"no file at {f}; give UTF-8 text files")
            try:
                out.append(path.read_text(encoding="utf-8"))
            except UnicodeDecodeError:
                raise ValueError(f"{f} is not UTF-8 text") from None
        text = "".join(out)
    else:
        corpus = load_corpus()
        cut = int(len(corpus) * (1 - HELD_OUT))
        text = corpus[:cut] if part == "train" else corpus[cut:]
    if not text:
        raise ValueError("the input is empty; give a file with some text")
    return text


def _load(path: str) -> object:
    from tokenizers import Tokenizer
    if not Path(path).is_file():
        raise ValueError(f"no tokenizer at {path}; give a tokenizer.json, e.g. one written by "
                         "`python -m trainbook tokenizer train --vocab-size N --out FILE`")
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # a malformed file: say which
        why = " ".join(str(e).split())
        raise ValueError(f"{path} is not a tokenizer.json that tokenizers can read ({why}); give "
                         "one written by `python -m trainbook tokenizer train`") from None


def _train(args: argparse.Namespace) -> int:
    text = _read(args.input, "train")
    seqs = text.splitlines(keepends=True)
    t0 = time.perf_counter()
    if args.impl == "scratch":
        tok = bpe.train_bpe(seqs, args.vocab_size, args.special_token, args.min_frequency)
        hf = tok.to_hf()
    else:
        hf = bpe.train_hf(seqs, args.vocab_size, args.special_token, args.min_frequency)
    seconds = time.perf_counter() - t0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    hf.save(args.out)
    out = {"out": args.out, "impl": args.impl, "vocab_size": hf.get_vocab_size(),
           "train_bytes": len(text.encode("utf-8")), "seconds": seconds,
           "bytes_per_token_train": bpe.bytes_per_token(hf.encode, text)}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"wrote {args.out}: {out['vocab_size']} tokens ({args.impl}, {seconds:.2f} s on "
              f"{out['train_bytes']:,} bytes), {out['bytes_per_token_train']:.3f} bytes/token "
              "on the training text")
    return 0


def _encode(args: argparse.Namespace) -> int:
    tok = _load(args.tokenizer[0])
    text = args.text if args.text is not None else _read(args.input, "all")
    enc = tok.encode(text)
    if args.json:
        print(json.dumps({"ids": enc.ids, "tokens": enc.tokens,
                          "bytes_per_token": bpe.bytes_per_token(tok.encode, text)}))
    else:
        print(" ".join(map(str, enc.ids)))
        print(f"{len(enc.ids)} tokens, {len(text.encode('utf-8'))} bytes")
    return 0


def _stats(args: argparse.Namespace) -> int:
    text = _read(args.input, "held-out")
    rows = []
    for path in args.tokenizer:
        tok = _load(path)
        n = len(tok.encode(text).ids)
        rows.append({"tokenizer": path, "vocab_size": tok.get_vocab_size(), "tokens": n,
                     "bytes": len(text.encode("utf-8")),
                     "bytes_per_token": len(text.encode("utf-8")) / n})
    print(json.dumps(rows, indent=2) if args.json else table(rows))
    return 0


def _compare(args: argparse.Namespace) -> int:
    text = _read(args.input, "train")
    seqs = text.splitlines(keepends=True)
    ours = bpe.train_bpe(seqs, args.vocab_size, args.special_token, args.min_frequency)
    theirs = bpe.train_hf(seqs, args.vocab_size, args.special_token, args.min_frequency)
    held = text if args.input else _read(None, "held-out")
    out = bpe.compare(ours, theirs, held)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for k, v in out.items():
            print(f"{k}: {v}")
    return 0 if out["same_merges"] and out["same_vocab"] else 1


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    return {"train": _train, "encode": _encode, "stats": _stats, "compare": _compare}[
        args.action](args)
