"""The PPO chapter's stored runs: PPO from the start policy against the stored reward model, the
same run against the verifier, and the knobs of its stability, each changed alone on one seed.

Every variant starts from the stored start policy (`align.start`) with the stored reward model
(`align.reward_study`) and `ppo.PPOConfig` as in `BASE` with the variant's changes
(`VARIANTS`); the prompts, the sampling and the minibatch order come from the same seeds, so
two variants differ only by the knob. The record keeps every round's metrics (`KEEP`) and the
greedy pass@1 every `EVAL_EVERY` rounds on the evaluation items of the DPO and GRPO chapters
(`start.eval_items`: the same 500 test items, so the start policy's pass@1 is theirs). `BASE`
samples `BUDGET` completions in all (rounds x batch_size), the budget on which the DPO chapter
compared DPO with GRPO. A run takes about a minute of CPU, the set more than a chapter may run,
so `write_runs` stores them.

Chapter: book/alignment/ppo
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..bench.gpu_truth import header, read_record, write_record
from ..launch import threads
from . import policy, ppo, reward_study, start, task

MEASUREMENT = "ppo-runs"
NAME = "ppo-runs"
BUDGET = 4096  # sampled completions: dpo_study's pairs cost this, and its GRPO run got it
BASE = ppo.PPOConfig(rounds=BUDGET // 64, batch_size=64, lr=3e-5)
VARIANTS: dict[str, dict] = {
    "baseline": {},
    "verifier reward": {},  # the task's own reward instead of the reward model
    "k3 penalty": {"kl_estimator": "k3"},
    "no KL penalty": {"kl_coef": 0.0},
    "lr x10": {"lr": 3e-4},
    "no clipping": {"clip": float("inf"), "clip_value": float("inf")},
    "no advantage whitening": {"whiten_advantages": False},
    "whitened rewards": {"whiten_rewards": True},
}
TRAIN = {"items": 8000, "seed": 0}
EVAL_ITEMS, EVAL_EVERY = start.EVAL_ITEMS, 16
KEEP = ("score", "gold", "accuracy", "kl_k1", "kl_k3", "kl_exact", "kl_k1_std", "kl_k3_std",
        "entropy", "clipfrac", "approx_kl", "ratio_max", "explained_variance", "vf_loss",
        "pg_loss", "grad_norm", "eos_rate", "length", "diverged")


def _plain(d: dict) -> dict:
    """JSON has no infinity: write it as the string "inf"."""
    return {k: "inf" if v == float("inf") else v for k, v in d.items()}


def eval_items() -> list[task.Problem]:
    """The DPO and GRPO chapters' evaluation items (`start.eval_items`)."""
    return start.eval_items(EVAL_ITEMS)


def config(variant: str, base: ppo.PPOConfig = BASE) -> ppo.PPOConfig:
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
    return base.with_(**VARIANTS[variant])


@threads(1)
def run_variant(variant: str, reward_folder: str | Path, start_folder: str | Path,
                base: ppo.PPOConfig = BASE,
                on_round: Callable[[int, dict], None] | None = None) -> dict:
    """One variant from the stored start policy and reward model: its metrics and pass@1."""
    cfg = config(variant, base)
    tok = task.chat_tokenizer()
    model = start.load_start(start_folder)
    rm = task.verify if variant == "verifier reward" else \
        reward_study.load_reward_model(reward_folder, start_folder)
    train = task.make_problems(TRAIN["items"], seed=TRAIN["seed"])
    test = eval_items()
    evals = [{"round": 0, "pass1": policy.accuracy(model, tok, test)}]

    def callback(r: int, stats: dict) -> None:
        if (r + 1) % EVAL_EVERY == 0 or r + 1 == cfg.rounds or stats["diverged"]:
            evals.append({"round": r + 1, "pass1": 0.0 if stats["diverged"] else
                          policy.accuracy(model, tok, test)})
        if on_round is not None:
            on_round(r, stats)

    t0 = time.perf_counter()
    out = ppo.run(model, rm, tok, train, cfg, callback=callback)
    return {"config": _plain(dataclasses.asdict(cfg)), "changes": _plain(VARIANTS[variant]),
            "history": [{k: h[k] for k in ("round", *KEEP)} for h in out.history],
            "pass1": evals, "seconds": time.perf_counter() - t0}


def write_runs(folder: str | Path, start_folder: str | Path,
               variants: tuple[str, ...] = tuple(VARIANTS), base: ppo.PPOConfig = BASE,
               name: str = NAME, reward_folder: str | Path | None = None,
               on_round: Callable[[int, dict], None] | None = None,
               workers: int = 1) -> Path:
    """Run the variants and store `<name>.json` in `folder` (the reward model is read from
    `reward_folder`, by default `folder`). workers > 1 runs the variants in that many
    processes (`on_round` is then not called)."""
    reward_folder = folder if reward_folder is None else reward_folder
    Path(folder).mkdir(parents=True, exist_ok=True)
    for v in variants:
        config(v, base)  # every name checked before any work
    if workers == 1:
        runs = {v: run_variant(v, reward_folder, start_folder, base, on_round) for v in variants}
    else:  # one process per variant (spawned: no OpenMP state forked), each on one thread
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as ex:
            futures = {v: ex.submit(run_variant, v, reward_folder, start_folder, base)
                       for v in variants}
            runs = {v: f.result() for v, f in futures.items()}
    cmd = f"python -m trainbook ppo --out {folder} --start {start_folder} --variants " + \
        ",".join(variants)
    record = header(MEASUREMENT, cmd, torch.device("cpu"), "small")
    record.update(base=_plain(dataclasses.asdict(base)),
                  train=TRAIN, eval={"items": EVAL_ITEMS, "every": EVAL_EVERY,
                                     "set": "start.eval_items"},
                  reward_model_sha256=reward_study.reward_record(reward_folder)["sha256"],
                  start_sha256=start.start_record(start_folder)["sha256"], runs=runs)
    return write_record(folder, name, record)


def read_runs(folder: str | Path, name: str = NAME) -> dict:
    return read_record(Path(folder) / f"{name}.json", MEASUREMENT,
                       "trainbook.align.ppo_study.write_runs")
