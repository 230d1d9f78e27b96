"""trainbook sft: supervised fine-tuning of the book's base model on the arithmetic chat task,
with the task score before and after (raw-form and chat-form greedy accuracy on the test split,
held-out loss on its answers). Options choose the loss mask (assistant tokens or all), padded or
packed rows (with document boundaries, or naive), and the optimizer settings of
`trainbook.align.sft.SFTConfig`, by default the chapter's recommended budget (`sft.RECIPE`:
1,000 steps, 4 epochs of 8,000 items, minutes on a CPU); --out writes the fine-tuned model as
a Hugging Face folder.

Chapter: book/alignment/sft
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from . import _args

if TYPE_CHECKING:
    from ..align.sft import SFTConfig

HELP = "fine-tune the base model on the chat task (SFT) and score it before and after"
MAX_STEPS = 100_000
MAX_BATCH = 4096
MAX_ITEMS = 1_000_000


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..align.sft import RECIPE, RECIPE_ITEMS

    d = RECIPE
    p.add_argument("--steps", type=_args.positive_int, default=d.steps,
                   help=f"optimizer steps (default {d.steps}, at most {MAX_STEPS:,})")
    p.add_argument("--batch-size", type=_args.positive_int, default=d.batch_size,
                   help=f"examples per step (default {d.batch_size}, at most {MAX_BATCH})")
    p.add_argument("--lr", type=_args.positive_float, default=d.lr,
                   help=f"peak learning rate of AdamW (default {d.lr:g})")
    p.add_argument("--warmup-steps", type=_args.non_negative_int, default=d.warmup_steps,
                   help=f"linear warmup steps (default {d.warmup_steps})")
    p.add_argument("--max-grad-norm", type=_args.finite_float, default=d.max_grad_norm,
                   help="clip the global gradient norm to this; 0 does not clip (default 0; "
                        "transformers and trl clip at 1.0)")
    p.add_argument("--loss-on", default="assistant",
                   help="assistant (the answer and <|eos|>) or all tokens (default assistant)")
    p.add_argument("--packing", default="padded",
                   help="padded rows, or packed rows with document boundaries or naive "
                        "(default padded)")
    p.add_argument("--capacity", type=_args.positive_int, default=64,
                   help="tokens per packed row (default 64)")
    p.add_argument("--train-items", type=_args.positive_int, default=RECIPE_ITEMS,
                   help=f"training items drawn from the train split (default {RECIPE_ITEMS})")
    p.add_argument("--test-items", type=_args.positive_int, default=500,
                   help="test items scored before and after (default 500)")
    p.add_argument("--seed", type=_args.non_negative_int, default=d.seed,
                   help="seed of the batch order (default 0)")
    p.add_argument("--out", help="write the fine-tuned model and tokenizer to this new folder "
                                 "as a Hugging Face checkpoint")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def check(args: argparse.Namespace) -> SFTConfig:
    """The SFTConfig of the options; ValueError for anything the run would refuse."""
    from ..align.sft import SFTConfig
    from ..align.sft_data import LOSS_ON
    from ..align.sft_study import PACKING

    if args.loss_on not in LOSS_ON:
        raise ValueError(f"--loss-on {args.loss_on!r} is unknown: use one of {', '.join(LOSS_ON)}")
    if args.packing not in PACKING:
        raise ValueError(f"--packing {args.packing!r} is unknown: use one of "
                         f"{', '.join(PACKING)}")
    for flag, value, most in (("--steps", args.steps, MAX_STEPS),
                              ("--batch-size", args.batch_size, MAX_BATCH),
                              ("--train-items", args.train_items, MAX_ITEMS),
                              ("--test-items", args.test_items, MAX_ITEMS)):
        if value > most:
            raise ValueError(f"{flag} {value} is more than this CPU-sized task needs: use at "
                             f"most {most:,}")
    if args.max_grad_norm < 0:
        raise ValueError(f"--max-grad-norm must be >= 0 (0: no clipping), got {args.max_grad_norm}")
    if args.packing != "padded" and args.capacity < 16:
        raise ValueError(f"--capacity {args.capacity} is shorter than one example; use at least 16")
    _args.check_writable(args.out, "--out", folder=True)
    if args.out is not None and Path(args.out).is_dir() and any(Path(args.out).iterdir()):
        raise ValueError(f"--out {args.out} is not an empty folder; give a new folder")
    return SFTConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                     warmup_steps=args.warmup_steps, max_grad_norm=args.max_grad_norm,
                     seed=args.seed)


def run(args: argparse.Namespace) -> int:
    cfg = check(args)
    from ..align import base, sft_study, task

    recipe = base.BaseRecipe()
    tok = task.chat_tokenizer()
    train = task.make_problems(args.train_items, recipe.digits, seed=1, split="train")
    test = task.make_problems(args.test_items, recipe.digits, seed=0, split="test")
    model = base.base_model(recipe)
    before = sft_study.score(model, tok, test)
    from tqdm.auto import tqdm

    bar = tqdm(total=cfg.steps, desc="SFT steps", disable=args.json)
    t0 = time.perf_counter()
    losses = sft_study.finetune(model, tok, train, cfg, args.loss_on, args.packing,
                                args.capacity, on_step=lambda k: bar.update(1))
    seconds = time.perf_counter() - t0
    bar.close()
    after = sft_study.score(model, tok, test)
    files = []
    if args.out is not None:
        from ..align.hf_io import export

        files = [str(f) for f in export(model, args.out, tok)]
    result = {"config": dataclasses.asdict(cfg), "loss_on": args.loss_on,
              "packing": args.packing, "train_items": args.train_items,
              "test_items": args.test_items,
              "epochs": sft_study.epochs(cfg, args.train_items), "before": before,
              "after": after, "first_loss": losses[0], "last_loss": losses[-1],
              "seconds": seconds, "files": files}
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"SFT: {cfg.steps} steps x {cfg.batch_size} examples ({result['epochs']:.2f} epochs "
          f"of {args.train_items}), lr {cfg.lr:g}, loss on {args.loss_on} tokens, "
          f"{args.packing} rows: {seconds:.1f} s, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    for key in before:
        print(f"  {key:14s} {before[key]:8.3f} -> {after[key]:8.3f}")
    if files:
        print(f"wrote {args.out}: {', '.join(f.split('/')[-1] for f in files)}")
    return 0
