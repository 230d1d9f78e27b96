"""trainbook dpo: direct preference optimisation (or IPO, SimPO) from scratch on the arithmetic
chat task, from the stored start policy: sample completions of the training prompts, pair a
right one with a wrong one where the policy's samples disagree (the verifier labels them),
train on the pairs, and print greedy pass@1 on the test items before and after. The defaults
are the DPO chapter's main run (`align.dpo_study`, "dpo"; a minute or two on a CPU).

  python -m trainbook dpo
  python -m trainbook dpo --loss ipo --beta 0.1 --steps 60 --json
  python -m trainbook dpo --loss simpo --beta 2 --gamma 0.5 --out dpo-model

Chapter: book/alignment/dpo
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
    from ..align.dpo import DPOConfig

HELP = "DPO, IPO or SimPO from the stored start policy on the chat task; pass@1 before and after"
DATA = Path(__file__).resolve().parents[3] / "book" / "alignment" / "data"
MAX_STEPS = 100_000
MAX_BATCH = 4096
MAX_ITEMS = 1_000_000
MAX_SAMPLES = 256
MAX_LR = 1.0
NAMES = {"sigmoid": "DPO", "ipo": "IPO", "simpo": "SimPO"}  # dpo.LOSSES


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..align.dpo import LOSSES
    from ..align.dpo_study import STUDY, config

    d = config("dpo")
    p.add_argument("--start", default=str(DATA),
                   help="folder holding the start policy dpo-start.json and .safetensors "
                        "(default: the book's book/alignment/data)")
    p.add_argument("--loss", default=d.loss,
                   help=f"{', '.join(LOSSES)} (DPO, IPO, SimPO; default {d.loss})")
    p.add_argument("--beta", type=_args.positive_float, default=d.beta,
                   help=f"DPO's beta, IPO's tau, SimPO's beta (default {d.beta:g})")
    p.add_argument("--gamma", type=_args.finite_float, default=d.gamma,
                   help=f"SimPO's target margin (default {d.gamma:g})")
    p.add_argument("--steps", type=_args.positive_int, default=d.steps,
                   help=f"optimizer steps (default {d.steps}, at most {MAX_STEPS:,})")
    p.add_argument("--batch-size", type=_args.positive_int, default=d.batch_size,
                   help=f"pairs per step (default {d.batch_size}, at most {MAX_BATCH})")
    p.add_argument("--lr", type=_args.positive_float, default=d.lr,
                   help=f"peak learning rate of AdamW (default {d.lr:g}, at most {MAX_LR:g})")
    p.add_argument("--warmup-steps", type=_args.non_negative_int, default=d.warmup_steps,
                   help=f"linear warmup steps (default {d.warmup_steps})")
    p.add_argument("--prompts", type=_args.positive_int, default=STUDY["prompts"],
                   help=f"training prompts to sample pairs from (default {STUDY['prompts']})")
    p.add_argument("--samples", type=_args.positive_int, default=STUDY["samples"],
                   help=f"completions sampled per prompt, at least 2 (default {STUDY['samples']})")
    p.add_argument("--eval-items", type=_args.positive_int, default=STUDY["eval_items"],
                   help=f"test items scored before and after (default {STUDY['eval_items']})")
    p.add_argument("--pair-seed", type=_args.non_negative_int, default=STUDY["pair_seed"],
                   help=f"seed of the training prompts and their samples "
                        f"(default {STUDY['pair_seed']})")
    p.add_argument("--seed", type=_args.non_negative_int, default=d.seed,
                   help=f"seed of the batch order (default {d.seed})")
    p.add_argument("--out", help="write the trained policy and tokenizer to this new folder as a "
                                 "Hugging Face checkpoint")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def check_start(folder: str) -> None:
    """ValueError unless `folder` holds the stored start policy (record and weights)."""
    path = Path(folder)
    if not (path / "dpo-start.json").is_file() or not (path / "dpo-start.safetensors").is_file():
        raise ValueError(f"--start {folder} holds no dpo-start.json and dpo-start.safetensors: "
                         "give the folder of the stored start policy (the repository's "
                         "book/alignment/data)")


def check_budget(pairs: tuple[tuple[str, int, int], ...]) -> None:
    """ValueError for a count past what this CPU-sized task needs."""
    for flag, value, most in pairs:
        if value > most:
            raise ValueError(f"{flag} {value} is more than this CPU-sized task needs: use at "
                             f"most {most:,}")


def check_out(out: str | None) -> None:
    """ValueError unless --out can be created as a new, empty folder."""
    _args.check_writable(out, "--out", folder=True)
    if out is not None and Path(out).is_dir() and any(Path(out).iterdir()):
        raise ValueError(f"--out {out} is not an empty folder; give a new folder")


def check(args: argparse.Namespace) -> DPOConfig:
    """The DPOConfig of the options; ValueError for anything the run would refuse."""
    from ..align.dpo import LOSSES, DPOConfig

    if args.loss not in LOSSES:
        raise ValueError(f"--loss {args.loss!r} is unknown: use one of {', '.join(LOSSES)}")
    check_budget((("--steps", args.steps, MAX_STEPS), ("--batch-size", args.batch_size, MAX_BATCH),
                  ("--prompts", args.prompts, MAX_ITEMS), ("--samples", args.samples, MAX_SAMPLES),
                  ("--eval-items", args.eval_items, MAX_ITEMS)))
    if args.samples < 2:
        raise ValueError(f"--samples {args.samples}: a pair needs two completions of a prompt; "
                         "use at least 2")
    if args.lr > MAX_LR:
        raise ValueError(f"--lr {args.lr:g} would destroy the policy in one step: use at most "
                         f"{MAX_LR:g} (the chapter uses 1e-5)")
    if args.gamma < 0:
        raise ValueError(f"--gamma must be >= 0 (SimPO's target margin), got {args.gamma:g}")
    check_start(args.start)
    check_out(args.out)
    return DPOConfig(loss=args.loss, beta=args.beta, gamma=args.gamma, steps=args.steps,
                     batch_size=args.batch_size, lr=args.lr, warmup_steps=args.warmup_steps,
                     seed=args.seed)


def run(args: argparse.Namespace) -> int:
    cfg = check(args)
    from tqdm.auto import tqdm

    from ..align import dpo, policy, start, task

    tok = task.chat_tokenizer()
    items = start.eval_items(args.eval_items)
    model = start.load_start(args.start)
    ref = start.load_start(args.start) if cfg.loss != "simpo" else None
    before = policy.accuracy(model, tok, items)
    prompts = task.make_problems(args.prompts, 2, seed=args.pair_seed)
    pairs, generated = dpo.preference_pairs(model, tok, prompts, args.samples,
                                            seed=args.pair_seed)
    if not pairs:
        raise ValueError(f"the start policy's {args.samples} samples agreed on every one of the "
                         f"{args.prompts} prompts, so there is no pair to train on; give more "
                         "--prompts or --samples")
    name = NAMES[cfg.loss]
    bar = tqdm(total=cfg.steps, desc=f"{name} steps", disable=args.json)
    t0 = time.perf_counter()
    history = dpo.train(model, ref, tok, pairs, cfg,
                        on_step=lambda k: bar.update(1) if k > 0 else None)
    seconds = time.perf_counter() - t0
    bar.close()
    after = policy.accuracy(model, tok, items)
    files = []
    if args.out is not None:
        from ..align.hf_io import export

        files = [str(f) for f in export(model, args.out, tok)]
    last = history[-1]
    result = {"config": dataclasses.asdict(cfg), "prompts": args.prompts,
              "samples": args.samples, "generated": generated, "pairs": len(pairs),
              "eval_items": args.eval_items, "pass1_before": before, "pass1_after": after,
              "first_loss": history[0]["loss"], "last_loss": last["loss"],
              "margin": last["margin"], "reward_accuracy": last["reward_accuracy"],
              "seconds": seconds, "files": files}
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{name}: {len(pairs)} pairs from {generated} samples of {args.prompts} prompts; "
          f"{cfg.steps} steps x {cfg.batch_size} pairs, lr {cfg.lr:g}, beta {cfg.beta:g}: "
          f"{seconds:.1f} s, loss {history[0]['loss']:.3f} -> {last['loss']:.3f}")
    print(f"  pass@1 on {args.eval_items} test items: {before:.3f} -> {after:.3f}")
    if files:
        print(f"wrote {args.out}: {', '.join(f.split('/')[-1] for f in files)}")
    return 0
