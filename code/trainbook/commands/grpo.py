"""trainbook grpo: group relative policy optimisation from scratch on the arithmetic chat task,
from the stored start policy, rewarded by the verifier: each step samples a group of
completions per prompt, scores them, and pushes up the ones better than their group's mean;
prints greedy pass@1 on the test items before and after. The defaults are the GRPO chapter's
base run (`align.grpo_study.BASE`, the "grpo" run of its KL part; minutes on a CPU); --loss
picks the aggregation (grpo, dapo, dr_grpo), --beta adds the KL penalty to the start policy.

  python -m trainbook grpo
  python -m trainbook grpo --steps 20 --loss dr_grpo --scale none --json
  python -m trainbook grpo --beta 0.04 --updates 2 --eps-high 0.28 --dynamic-sampling

Chapter: book/alignment/grpo
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import TYPE_CHECKING

from . import _args
from .dpo import DATA, MAX_ITEMS, MAX_LR, MAX_STEPS, check_budget, check_out, check_start

if TYPE_CHECKING:
    from ..align.grpo import GRPOConfig

HELP = "GRPO from the stored start policy on the chat task, verifier reward; pass@1 before/after"
MAX_PROMPTS = 4096
MAX_GROUP = 256
MAX_TOKENS = 64
MAX_UPDATES = 64


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..align.grpo import LOSSES, SCALES, GRPOConfig
    from ..align.grpo_study import BASE, STUDY

    d = GRPOConfig(**BASE)
    p.add_argument("--start", default=str(DATA),
                   help="folder holding the start policy dpo-start.json and .safetensors "
                        "(default: the book's book/alignment/data)")
    p.add_argument("--steps", type=_args.positive_int, default=d.steps,
                   help=f"sampling steps (default {d.steps}, at most {MAX_STEPS:,})")
    p.add_argument("--prompts", type=_args.positive_int, default=d.prompts,
                   help=f"prompts per step (default {d.prompts}, at most {MAX_PROMPTS})")
    p.add_argument("--group", type=_args.positive_int, default=d.group,
                   help=f"completions per prompt, at least 2 (default {d.group})")
    p.add_argument("--loss", default=d.loss,
                   help=f"how token losses are averaged: {', '.join(LOSSES)} (default {d.loss})")
    p.add_argument("--scale", default=d.scale,
                   help=f"advantage scaling: {', '.join(SCALES)} (default {d.scale})")
    p.add_argument("--beta", type=_args.finite_float, default=d.beta,
                   help=f"KL coefficient to the start policy; 0: no KL term (default {d.beta:g})")
    p.add_argument("--eps-low", type=_args.finite_float, default=d.eps_low,
                   help=f"clip below 1 - eps-low (default {d.eps_low:g})")
    p.add_argument("--eps-high", type=_args.finite_float, default=d.eps_high,
                   help=f"clip above 1 + eps-high (default {d.eps_high:g}; DAPO: 0.28)")
    p.add_argument("--updates", type=_args.positive_int, default=d.updates,
                   help=f"clipped updates per batch (mu; default {d.updates})")
    p.add_argument("--dynamic-sampling", action="store_true",
                   help="DAPO's filter: draw more prompts until the batch holds groups whose "
                        "rewards differ")
    p.add_argument("--lr", type=_args.positive_float, default=d.lr,
                   help=f"AdamW learning rate, constant (default {d.lr:g}, at most {MAX_LR:g})")
    p.add_argument("--max-grad-norm", type=_args.finite_float, default=d.max_grad_norm,
                   help=f"clip the global gradient norm; 0 does not clip "
                        f"(default {d.max_grad_norm:g})")
    p.add_argument("--temperature", type=_args.positive_float, default=d.temperature,
                   help=f"sampling temperature (default {d.temperature:g})")
    p.add_argument("--max-new-tokens", type=_args.positive_int, default=d.max_new_tokens,
                   help=f"tokens sampled per completion (default {d.max_new_tokens})")
    p.add_argument("--train-items", type=_args.positive_int, default=STUDY["train_items"],
                   help=f"training prompts drawn from (default {STUDY['train_items']})")
    p.add_argument("--eval-items", type=_args.positive_int, default=STUDY["eval_items"],
                   help=f"test items scored before and after (default {STUDY['eval_items']})")
    p.add_argument("--seed", type=_args.non_negative_int, default=d.seed,
                   help=f"seed of the prompts and the samples (default {d.seed})")
    p.add_argument("--out", help="write the trained policy and tokenizer to this new folder as a "
                                 "Hugging Face checkpoint")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def check(args: argparse.Namespace) -> GRPOConfig:
    """The GRPOConfig of the options; ValueError for anything the run would refuse."""
    from ..align.grpo import LOSSES, SCALES, GRPOConfig

    if args.loss not in LOSSES:
        raise ValueError(f"--loss {args.loss!r} is unknown: use one of {', '.join(LOSSES)}")
    if args.scale not in SCALES:
        raise ValueError(f"--scale {args.scale!r} is unknown: use one of {', '.join(SCALES)}")
    check_budget((("--steps", args.steps, MAX_STEPS), ("--prompts", args.prompts, MAX_PROMPTS),
                  ("--group", args.group, MAX_GROUP), ("--updates", args.updates, MAX_UPDATES),
                  ("--max-new-tokens", args.max_new_tokens, MAX_TOKENS),
                  ("--train-items", args.train_items, MAX_ITEMS),
                  ("--eval-items", args.eval_items, MAX_ITEMS)))
    if args.group < 2:
        raise ValueError(f"--group {args.group}: an advantage compares completions of one "
                         "prompt; use at least 2")
    if args.lr > MAX_LR:
        raise ValueError(f"--lr {args.lr:g} would destroy the policy in one step: use at most "
                         f"{MAX_LR:g} (the chapter uses 1e-4)")
    for flag, value in (("--beta", args.beta), ("--eps-high", args.eps_high),
                        ("--max-grad-norm", args.max_grad_norm)):
        if value < 0:
            raise ValueError(f"{flag} must be >= 0, got {value:g}")
    if not 0 <= args.eps_low < 1:
        raise ValueError(f"--eps-low must be in [0, 1) (the ratio's floor is 1 - eps-low), got "
                         f"{args.eps_low:g}")
    if args.temperature > 100:
        raise ValueError(f"--temperature {args.temperature:g} samples uniformly at random: use "
                         "at most 100 (the chapter uses 1)")
    check_start(args.start)
    check_out(args.out)
    return GRPOConfig(steps=args.steps, prompts=args.prompts, group=args.group, loss=args.loss,
                      scale=args.scale, beta=args.beta, eps_low=args.eps_low,
                      eps_high=args.eps_high, updates=args.updates,
                      dynamic_sampling=args.dynamic_sampling, lr=args.lr,
                      max_grad_norm=args.max_grad_norm, temperature=args.temperature,
                      max_new_tokens=args.max_new_tokens, seed=args.seed)


def run(args: argparse.Namespace) -> int:
    cfg = check(args)
    from tqdm.auto import tqdm

    from ..align import grpo, policy, start, task
    from ..align.grpo_study import STUDY

    tok = task.chat_tokenizer()
    items = start.eval_items(args.eval_items)
    model = start.load_start(args.start)
    ref = start.load_start(args.start) if cfg.beta > 0 else None
    before = policy.accuracy(model, tok, items, max_new_tokens=cfg.max_new_tokens)
    train = task.make_problems(args.train_items, 2, seed=STUDY["train_seed"])
    bar = tqdm(total=cfg.steps * cfg.prompts * cfg.group, desc="GRPO completions scored",
               disable=args.json)

    def verifier(item: task.Problem, text: str) -> float:
        bar.update(1)
        return task.verify(item, text)
    t0 = time.perf_counter()
    history = grpo.train(model, tok, train, cfg, ref=ref, verifier=verifier)
    seconds = time.perf_counter() - t0
    bar.update(max(0, bar.total - bar.n))  # completions without <|eos|> are never verified
    bar.close()
    after = policy.accuracy(model, tok, items, max_new_tokens=cfg.max_new_tokens)
    files = []
    if args.out is not None:
        from ..align.hf_io import export

        files = [str(f) for f in export(model, args.out, tok)]
    result = {"config": dataclasses.asdict(cfg), "train_items": args.train_items,
              "eval_items": args.eval_items, "pass1_before": before, "pass1_after": after,
              "reward_first": history[0]["reward"], "reward_last": history[-1]["reward"],
              "generated": sum(h["generated"] for h in history), "seconds": seconds,
              "files": files}
    if "kl" in history[-1]:
        result["kl_last"] = history[-1]["kl"]
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"GRPO ({cfg.loss}): {cfg.steps} steps x {cfg.prompts} prompts x {cfg.group} "
          f"completions, lr {cfg.lr:g}, beta {cfg.beta:g}: {seconds:.1f} s, mean reward "
          f"{result['reward_first']:.3f} -> {result['reward_last']:.3f}")
    print(f"  pass@1 on {args.eval_items} test items: {before:.3f} -> {after:.3f}")
    if files:
        print(f"wrote {args.out}: {', '.join(f.split('/')[-1] for f in files)}")
    return 0
