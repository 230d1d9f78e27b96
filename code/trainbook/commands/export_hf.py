"""trainbook export-hf: a trainer checkpoint as a Hugging Face model folder.

Reads a checkpoint (the trainer's step-NNNNNN.pt file or DCP folder, or the file import-hf
writes), writes config.json, model.safetensors, generation_config.json and the tokenizer
files to --out (a new or empty folder), then loads the folder with transformers'
AutoModelForCausalLM and prints the largest logit difference from the reference model on a
random batch (fp32; skip with --no-check). The tokenizer is the one the checkpoint was trained
with (bytes, a tokenizers JSON file, or its BPE retrained on its corpus, which gives the same
merges), or --tokenizer: chat (the book's chat tokenizer), bytes, or a tokenizer.json file or
model folder.

  python -m trainbook export-hf --checkpoint ckpt/step-000200.pt --out hf-model
  python -m trainbook export-hf --checkpoint sft.pt --out hf-chat --tokenizer chat

Chapter: book/alignment/evaluation
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ._args import check_writable

HELP = "write a checkpoint as a Hugging Face folder (config, safetensors, tokenizer)"
CHECK_BATCH = (2, 16)  # sequences x tokens of the logit check
TOLERANCE = 1e-5  # fp32: the largest logit difference the check accepts


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, metavar="PATH",
                   help="a trainer checkpoint (step-NNNNNN.pt or DCP folder) or import-hf's file")
    p.add_argument("--out", required=True, help="the folder to write (new or empty)")
    p.add_argument("--tokenizer", default=None,
                   help="chat, bytes, or a tokenizer.json / model folder (default: the "
                        "checkpoint's own)")
    p.add_argument("--no-check", action="store_true",
                   help="skip loading the folder with transformers to compare logits")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def check_tokenizer_choice(choice: str | None) -> None:
    if choice is None or choice in ("chat", "bytes") or Path(choice).exists():
        return
    raise ValueError(f"--tokenizer {choice!r} is not chat, bytes, or an existing tokenizer.json "
                     "or model folder; give one of those")


def check_out_folder(out: str, option: str = "--out") -> None:
    """A folder that can be created, and is new or empty (no stale files mix in)."""
    check_writable(out, option, folder=True)
    path = Path(out)
    if path.is_dir() and any(path.iterdir()):
        raise ValueError(f"{option} {out} is a folder with files in it; give a new or empty "
                         "folder")


def check_checkpoint(path: str, option: str = "--checkpoint") -> None:
    if not Path(path).exists():
        raise ValueError(f"{option} {path}: no such file or folder; give a step-NNNNNN.pt file "
                         "or DCP folder written by train --ckpt-dir, or import-hf's file")


def load(path: str, tokenizer: str | None = None) -> tuple:
    """(model, tokenizer or None, state) of a checkpoint; the tokenizer per
    `hf_tokenizer.tokenizer_of`."""
    from ..align.hf_tokenizer import tokenizer_of
    from ..failures.ckpt_tools import load_model

    model, state = load_model(path)
    return model.eval(), tokenizer_of(state, tokenizer), state


def logit_check(model: object, folder: Path) -> float:
    """The largest logit difference between the reference model and transformers' load."""
    import torch

    from ..align import hf_io

    g = torch.Generator().manual_seed(0)
    t = min(CHECK_BATCH[1], model.cfg.max_seq_len)
    ids = torch.randint(0, model.cfg.vocab_size, (CHECK_BATCH[0], t), generator=g)
    return hf_io.logit_gap(model, folder, ids)


def run(args: argparse.Namespace) -> int:
    from ..align import hf_io

    check_tokenizer_choice(args.tokenizer)
    check_out_folder(args.out)
    check_checkpoint(args.checkpoint)
    model, tok, state = load(args.checkpoint, args.tokenizer)
    files = hf_io.export(model, args.out, tok)
    gap = None if args.no_check else logit_check(model, Path(args.out))
    out = {"wrote": str(args.out), "files": [f.name for f in files],
           "model": model.cfg.name, "flavour": model.cfg.flavour,
           "tokenizer": type(tok).__name__ if tok is not None else None,
           "max_logit_difference": gap, "step": state.get("step")}
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"wrote {args.out}: {', '.join(out['files'])}")
        if tok is None:
            print("no tokenizer: the checkpoint records none; pass --tokenizer")
        if gap is not None:
            print(f"transformers loads it: largest logit difference {gap:.2e} (fp32)")
    if gap is not None and gap > TOLERANCE:
        raise ValueError(f"the exported model's logits differ by {gap:.2e} (> {TOLERANCE:g}): "
                         "the export is wrong; report it with the checkpoint's model config")
    return 0
