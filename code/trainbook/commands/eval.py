"""trainbook eval: score a model on the book's arithmetic task, the way the evaluation chapter
does.

MODEL is a checkpoint (the trainer's step-NNNNNN.pt file or DCP folder, or import-hf's file), a
Hugging Face model folder, or `base`, the book's shipped base model (a folder named base is
`./base`); it must use the book's chat tokenizer (the task's ids). On --items
test items (seed --seed) it prints: multiple choice by log-likelihood (acc, acc_norm, acc_bytes
and lm-eval's standard errors; choices bare and ended by a newline), the held-out loss of the
raw lines (nats per token, perplexity, bits per byte), greedy accuracy in the --form asked
(chat: the chat template, raw: `07+58=`) with its 95% Wilson interval, and, with --samples n,
pass@k at --temperature for each --k. --lm-eval also runs lm-evaluation-harness on the same items
(the model exported to a temporary folder) and prints both sides.

  python -m trainbook eval base --items 500 --form raw --samples 10 --k 1 5 10
  python -m trainbook eval hf-model --lm-eval --json

Chapter: book/alignment/evaluation
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ._args import non_negative_int, positive_float, positive_int

HELP = "score a model on the arithmetic task: multiple choice, loss, accuracy, pass@k"
FORMS = ("chat", "raw")
SHIPPED = "base"  # MODEL naming the book's shipped base model (trainbook.align.base)


def add_arguments(p: argparse.ArgumentParser) -> None:
    # optional in the parser so that a missing MODEL is reported by check_args in one line
    p.add_argument("model", nargs="?", metavar="MODEL",
                   help="a checkpoint file or DCP folder, a Hugging Face model folder, or "
                        "'base' (the book's shipped base model)")
    p.add_argument("--items", type=positive_int, default=200,
                   help="test items to score (default 200)")
    p.add_argument("--seed", type=non_negative_int, default=1,
                   help="which test items, and the sampling seed (default 1)")
    p.add_argument("--choices", type=positive_int, default=4,
                   help="choices per multiple-choice item, 2 to 9 (default 4)")
    p.add_argument("--form", choices=FORMS, default="chat",
                   help="how generation asks: chat template (default) or raw `07+58=`")
    p.add_argument("--samples", type=non_negative_int, default=0,
                   help="samples per item for pass@k (default 0: greedy only)")
    p.add_argument("--temperature", type=positive_float, default=1.0,
                   help="sampling temperature for pass@k (default 1.0)")
    p.add_argument("--k", type=positive_int, nargs="+", default=[1],
                   help="the k of pass@k, each at most --samples (default 1)")
    p.add_argument("--lm-eval", action="store_true",
                   help="also run lm-evaluation-harness on the same items and compare")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def check_args(args: argparse.Namespace) -> None:
    if not 2 <= args.choices <= 9:
        raise ValueError(f"--choices must be between 2 and 9, got {args.choices}")
    if args.samples and max(args.k) > args.samples:
        raise ValueError(f"--k {max(args.k)} exceeds --samples {args.samples}: pass@k needs at "
                         "least k samples per item")
    if not args.samples and args.k != [1]:
        raise ValueError("--k needs --samples n (pass@k is estimated from n samples per item)")
    if args.items > 10_000:
        raise ValueError(f"--items {args.items}: the 2-digit test split has about 1,000 "
                         "distinct items; use at most 10000 (items repeat beyond that)")
    if args.model is None:
        raise ValueError("eval needs MODEL: give a checkpoint file or a Hugging Face model "
                         "folder, e.g. python -m trainbook eval model.pt")
    if args.model != SHIPPED and not Path(args.model).exists():
        raise ValueError(f"MODEL {args.model}: no such file or folder; give a checkpoint or a "
                         "Hugging Face model folder (or base, the book's base model)")


def load(path: str) -> tuple:
    """(model, tokenizer) of a checkpoint, a Hugging Face folder or the shipped base model."""
    from ..align import base, hf_io, hf_tokenizer, task
    from .export_hf import load as load_checkpoint

    if path == SHIPPED:
        return base.base_model(), task.chat_tokenizer()
    p = Path(path)
    if p.is_dir() and (p / "config.json").is_file():
        return hf_io.import_hf(p), hf_tokenizer.load_tokenizer(p)
    model, tok, _ = load_checkpoint(path)
    return model, tok


def _print(card: dict, rows: list[dict] | None) -> None:
    print(f"{card['items']} test items")
    for name, mc in card["multiple_choice"].items():
        print(f"multiple choice ({name} choices): " + ", ".join(
            f"{m} {mc[m]:.3f} +- {mc[m + '_stderr']:.3f}" for m in ("acc", "acc_norm",
                                                                   "acc_bytes")))
    h = card["heldout"]
    print(f"held-out raw lines: {h['nats_per_token']:.4f} nats/token, perplexity "
          f"{h['perplexity']:.3f}, {h['bits_per_byte']:.4f} bits/byte")
    g = card["greedy"]
    print(f"greedy accuracy ({card['form']} form): {g['accuracy']:.3f} (95% Wilson "
          f"{g['wilson_95'][0]:.3f}-{g['wilson_95'][1]:.3f})")
    if "sampled" in card:
        s = card["sampled"]
        print(f"{s['samples']} samples per item at temperature {s['temperature']:g}: " +
              ", ".join(f"pass@{k} {v:.3f}" for k, v in s["pass_at_k"].items()))
    for r in rows or []:
        diff = r["difference"]
        print(f"lm-eval {r['task']} {r['metric']}: " + (
            f"ours {r['ours']:.6g}, lm-eval {r['lm_eval']:.6g}, " if r["ours"] is not None
            else "") + f"difference {diff:.2e}")


def run(args: argparse.Namespace) -> int:
    import torch

    from ..align import evaluation as E
    from ..align import lm_eval_check as C
    from ..align import task

    check_args(args)
    model, tok = load(args.model)
    items = task.make_problems(args.items, 2, args.seed, "test")
    card = E.scorecard(model, tok, items, args.choices, args.seed, args.form, args.samples,
                       args.temperature, args.k, torch.Generator().manual_seed(args.seed))
    rows = None
    if args.lm_eval:
        result = C.check(C.CheckItems(args.items, args.seed, args.choices), model)
        rows = C.compare(result["ours"], result["lm_eval"])
    if args.json:
        print(json.dumps({**card, "lm_eval": rows}, indent=1))
    else:
        _print(card, rows)
    return 0
