"""trainbook ppo: RLHF with PPO on the arithmetic chat task, from the stored start policy against
the stored reward model (or the verifier), with the stability knobs as variants on one seed;
prints each run's pass@1 before and after, reward, KL and clip fraction, and stores the runs.

  python -m trainbook ppo --out ppo                         # every variant: ppo/ppo-runs.json
  python -m trainbook ppo --variants baseline,"no KL penalty" --rounds 60 --out /tmp/ppo
  python -m trainbook ppo --variants baseline --lr 1e-5 --kl-coef 0.1 --json

Chapter: book/alignment/ppo
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING

from . import _args

if TYPE_CHECKING:
    from ..align.ppo import PPOConfig

HELP = "PPO (RLHF) from the stored start policy against the stored reward model; variants"
DATA = "book/alignment/data"
MAX_ROUNDS = 10_000
MAX_BATCH = 4096


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..align.ppo_study import BASE as d
    from ..align.ppo_study import VARIANTS

    p.add_argument("--start", default=DATA,
                   help=f"folder holding the start policy dpo-start.* (default {DATA})")
    p.add_argument("--reward", default=DATA,
                   help=f"folder holding the reward model rm-reward.* (default {DATA})")
    p.add_argument("--out", required=True, help="folder to write ppo-runs.json to (the book's "
                   "stored runs: `python -m trainbook records regen ppo-runs`)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated runs, each the base with one change: "
                        f"{', '.join(VARIANTS)} (default: all)")
    p.add_argument("--rounds", type=_args.positive_int, default=d.rounds,
                   help=f"rollout-and-update rounds (default {d.rounds}, at most {MAX_ROUNDS})")
    p.add_argument("--batch-size", type=_args.positive_int, default=d.batch_size,
                   help=f"prompts per round (default {d.batch_size}, at most {MAX_BATCH})")
    p.add_argument("--minibatch-size", type=_args.positive_int, default=d.minibatch_size,
                   help=f"sequences per update (default {d.minibatch_size})")
    p.add_argument("--ppo-epochs", type=_args.positive_int, default=d.ppo_epochs,
                   help=f"passes over each round's batch (default {d.ppo_epochs})")
    p.add_argument("--lr", type=_args.positive_float, default=d.lr,
                   help=f"Adam learning rate (default {d.lr:g})")
    p.add_argument("--kl-coef", type=_args.finite_float, default=d.kl_coef,
                   help=f"beta of the per-token KL penalty (default {d.kl_coef:g})")
    p.add_argument("--clip", type=_args.positive_float, default=d.clip,
                   help=f"epsilon of the clipped objective (default {d.clip:g})")
    p.add_argument("--seed", type=_args.non_negative_int, default=d.seed,
                   help=f"seed of prompts, samples and minibatches (default {d.seed})")
    p.add_argument("--workers", type=_args.positive_int, default=1,
                   help="run the variants in this many processes, one thread each (default 1)")
    p.add_argument("--json", action="store_true", help="print the record as JSON")


def check(args: argparse.Namespace) -> tuple[tuple[str, ...], PPOConfig]:
    """(variants, base PPOConfig) of the options; ValueError for anything the run would refuse."""
    from ..align.ppo_study import BASE, VARIANTS

    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        raise ValueError(f"--variants: unknown variant {unknown[0] if unknown else '(none)'!r}; "
                         f"choose from {', '.join(VARIANTS)}")
    for flag, value, most in (("--rounds", args.rounds, MAX_ROUNDS),
                              ("--batch-size", args.batch_size, MAX_BATCH)):
        if value > most:
            raise ValueError(f"{flag} {value} is more than this CPU-sized task needs: use at "
                             f"most {most:,}")
    if args.workers > 64:
        raise ValueError(f"--workers {args.workers}: use at most 64 processes")
    if args.kl_coef < 0:
        raise ValueError(f"--kl-coef must be >= 0, got {args.kl_coef}")
    if args.minibatch_size > args.batch_size:
        raise ValueError(f"--minibatch-size {args.minibatch_size} must not be larger than "
                         f"--batch-size {args.batch_size}")
    _args.check_writable(args.out, "--out", folder=True)
    for flag, folder, name in (("--start", args.start, "dpo-start.json"),
                               ("--reward", args.reward, "rm-reward.json")):
        if not (Path(folder) / name).is_file():
            raise ValueError(f"{flag} {folder} holds no {name}: give the folder of the stored "
                             "models (book/alignment/data)")
    base = BASE.with_(rounds=args.rounds, batch_size=args.batch_size,
                      minibatch_size=args.minibatch_size, ppo_epochs=args.ppo_epochs,
                      lr=args.lr, kl_coef=args.kl_coef, clip=args.clip, seed=args.seed)
    return variants, base


def run(args: argparse.Namespace) -> int:
    variants, base = check(args)
    from tqdm.auto import tqdm

    from ..align import ppo_study as S

    bar = tqdm(total=len(variants) * base.rounds, desc="PPO rounds",
               disable=args.json or args.workers > 1)
    path = S.write_runs(args.out, args.start, variants, base, reward_folder=args.reward,
                        on_round=lambda r, s: bar.update(1), workers=args.workers)
    bar.close()
    record = json.loads(path.read_text())
    if args.json:
        print(json.dumps(record, indent=1))
        return 0
    print(f"PPO: {base.rounds} rounds x {base.batch_size} prompts; base "
          f"{ {k: v for k, v in dataclasses.asdict(base).items()} }")
    print(f"{'variant':24s} {'pass@1':>15s} {'score':>7s} {'gold':>6s} {'KL':>7s} "
          f"{'clipfrac':>8s}")
    for name, r in record["runs"].items():
        last = r["history"][-1]
        p0, p1 = r["pass1"][0]["pass1"], r["pass1"][-1]["pass1"]
        print(f"{name:24s} {p0:6.3f} -> {p1:5.3f} {last['score']:7.3f} {last['gold']:6.3f} "
              f"{last['kl_exact']:7.3f} {last['clipfrac']:8.3f}"
              + ("  diverged" if last["diverged"] else ""))
    print(f"wrote {path}")
    return 0
