"""trainbook reward-model: train the book's reward model (Bradley-Terry on preference pairs of the
arithmetic chat task) from the stored start policy, report its held-out pair accuracy and store
it with its record; --overopt then runs the best-of-n over-optimisation study against it and
proxies trained on fewer pairs.

  python -m trainbook reward-model --out rm            # rm/rm-reward.*
  python -m trainbook reward-model --overopt --out rm  # rm/rm-overopt.json, against rm/rm-reward.*
  python -m trainbook reward-model --steps 400 --center-coef 0.01 --out /tmp/rm

The book's stored results are regenerated with `python -m trainbook records regen rm-reward`
(and rm-overopt): no command writes into the book's data unless told to.

Chapter: book/alignment/reward-models
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING

from . import _args

if TYPE_CHECKING:
    from ..align.reward import RMConfig

HELP = "train the reward model (Bradley-Terry) from the stored start policy; --overopt: best-of-n"
DATA = "book/alignment/data"
MAX_STEPS = 100_000
MAX_BATCH = 4096


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..align.reward_study import RECIPE as d

    p.add_argument("--start", default=DATA,
                   help=f"folder holding the start policy dpo-start.* (default {DATA})")
    p.add_argument("--out", required=True,
                   help="folder to write rm-reward.safetensors/.json (or rm-overopt.json) to")
    p.add_argument("--reward", default=None,
                   help="with --overopt: folder holding the reward model rm-reward.* "
                        "(default: --out)")
    p.add_argument("--steps", type=_args.positive_int, default=d.steps,
                   help=f"optimizer steps (default {d.steps}, at most {MAX_STEPS:,})")
    p.add_argument("--batch-size", type=_args.positive_int, default=d.batch_size,
                   help=f"pairs per step (default {d.batch_size}, at most {MAX_BATCH})")
    p.add_argument("--lr", type=_args.positive_float, default=d.lr,
                   help=f"learning rate of AdamW (default {d.lr:g})")
    p.add_argument("--center-coef", type=_args.finite_float, default=d.center_coef,
                   help="trl's center_rewards_coefficient; 0 is off (default 0)")
    p.add_argument("--margin", action="store_true",
                   help="subtract each pair's gold-reward gap inside the sigmoid")
    p.add_argument("--seed", type=_args.non_negative_int, default=d.seed,
                   help=f"seed of the batch order (default {d.seed})")
    p.add_argument("--overopt", action="store_true",
                   help="instead of training, run the best-of-n study against the stored "
                        "reward model in --out and write rm-overopt.json")
    p.add_argument("--json", action="store_true", help="print the record as JSON")


def check(args: argparse.Namespace) -> RMConfig:
    """The RMConfig of the options; ValueError for anything the run would refuse."""
    from ..align.reward import RMConfig

    for flag, value, most in (("--steps", args.steps, MAX_STEPS),
                              ("--batch-size", args.batch_size, MAX_BATCH)):
        if value > most:
            raise ValueError(f"{flag} {value} is more than this CPU-sized task needs: use at "
                             f"most {most:,}")
    if args.center_coef < 0:
        raise ValueError(f"--center-coef must be >= 0 (0: off), got {args.center_coef}")
    _args.check_writable(args.out, "--out", folder=True)
    if not (Path(args.start) / "dpo-start.json").is_file():
        raise ValueError(f"--start {args.start} holds no dpo-start.json: give the folder of the "
                         "stored start policy (book/alignment/data)")
    if args.reward is not None and not args.overopt:
        raise ValueError("--reward names the reward model --overopt runs against: add "
                         "--overopt, or drop --reward")
    reward = args.out if args.reward is None else args.reward
    if args.overopt and not (Path(reward) / "rm-reward.json").is_file():
        flag = "--out" if args.reward is None else "--reward"
        raise ValueError(f"--overopt needs a reward model in {flag} {reward}: run "
                         f"`python -m trainbook reward-model --out {reward}` first")
    return RMConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                    center_coef=args.center_coef, use_margin=args.margin, seed=args.seed)


def run(args: argparse.Namespace) -> int:
    cfg = check(args)
    from ..align import reward_study as S

    if args.overopt:
        reward = args.out if args.reward is None else args.reward
        record = json.loads(S.write_overopt(args.out, args.start, reward).read_text())
        if args.json:
            print(json.dumps(record, indent=1))
            return 0
        for name, proxy in record["proxies"].items():
            print(f"{name}: held-out accuracy {proxy['sampled']:.3f} (policy samples), "
                  f"{proxy['constructed']:.3f} (constructed)")
            for pt in proxy["curve"]:
                print(f"  n={pt['n']:3d}  KL {pt['kl']:.3f} (formula {pt['kl_formula']:.3f})  "
                      f"proxy {pt['proxy']:7.3f}  gold {pt['gold']:.3f}")
        return 0
    path = S.write_reward_model(args.out, args.start, cfg)
    record = json.loads(path.read_text())
    if args.json:
        print(json.dumps(record, indent=1))
        return 0
    print(f"reward model: {cfg.steps} steps x {cfg.batch_size} pairs of {record['train_pairs']}, "
          f"{record['train_seconds']:.0f} s; {dataclasses.asdict(cfg)}")
    for row in record["accuracy"]:
        print(f"  step {row['step']:6d}  held-out accuracy {row['sampled']:.3f} (policy "
              f"samples), {row['constructed']:.3f} (constructed)")
    print(f"wrote {path} and {path.with_suffix('.safetensors')}")
    return 0
