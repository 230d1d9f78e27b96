"""The reward-model chapter's stored results: the book's reward model and the over-optimisation
sweep, both from the stored start policy (`align.start`, the SFT model the RL chapters share).

A reward model good enough to steer PPO takes minutes of CPU to train here (its accuracy on
the policy's own near misses climbs slowly), longer than a chapter may run, so
`write_reward_model` trains it once with `RECIPE` and stores the weights (safetensors) with a
record: the recipe, the SHA-256 of the weights and of the start policy, the command, date,
versions, machine, the loss curve and the held-out pair accuracies. `load_reward_model` checks
the digest and loads it; the PPO chapter uses it.

`write_overopt` is the over-optimisation study in the manner of Gao et al. (2022): proxy reward
models trained on `OVEROPT["pairs"]` preference pairs (the same steps each, so the small sets
are seen many times over), and the stored reward model, each optimised against by best-of-n
from the start policy (`overoptimization.best_of_n`), with the gold reward (`graded_reward`)
and the KL of every n.

Chapter: book/alignment/reward-models
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from ..bench.gpu_truth import header, read_record, write_record
from ..launch import threads
from . import overoptimization as O
from . import preferences as P
from . import reward, start, task

MEASUREMENT = "reward-model"
NAME = "rm-reward"
# Training pairs: `sampled` items give two samples of the start policy each (ties dropped),
# `constructed` items the answer against a corruption; test pairs the same on the test split.
DATA = {"train_items": 16_000, "sampled": 8_000, "train_seed": 0, "test_items": 512,
        "test_seed": 5}
RECIPE = reward.RMConfig(steps=1600, batch_size=64, lr=3e-4, warmup_steps=10)
EVAL_EVERY = 200
OVEROPT = {"pairs": (64, 512, 4096), "steps": 150, "batch_size": 32, "prompts": 64,
           "samples": 64,
           "ns": (1, 2, 4, 8, 16, 32, 64), "seed": 7}
OVEROPT_NAME = "rm-overopt"


def train_pairs(policy: torch.nn.Module, tok: task.ChatTokenizer,
                items: int = DATA["train_items"], sampled: int = DATA["sampled"]) -> list:
    """Training pairs: two samples of `policy` for each of the first `sampled` of `items`
    training items (ties dropped), the answer against a corruption for the rest."""
    if not 0 <= sampled <= items:
        raise ValueError(f"sampled must be between 0 and items ({items}), got {sampled}")
    problems = task.make_problems(items, seed=DATA["train_seed"])
    out = P.sampled_pairs(policy, tok, problems[:sampled], seed=1) if sampled else []
    return out + (P.constructed_pairs(problems[sampled:], seed=2) if sampled < items else [])


def test_pairs(policy: torch.nn.Module, tok: task.ChatTokenizer) -> dict:
    """Held-out pairs on test items: {"test_sampled", "test_constructed"}."""
    test = task.make_problems(DATA["test_items"], split="test", seed=DATA["test_seed"])
    return {"test_sampled": P.sampled_pairs(policy, tok, test, seed=3),
            "test_constructed": P.constructed_pairs(test, seed=4)}


def preference_data(policy: torch.nn.Module, tok: task.ChatTokenizer) -> dict:
    """The study's pairs: {"train", "test_sampled", "test_constructed"} lists of Pair."""
    return {"train": train_pairs(policy, tok), **test_pairs(policy, tok)}


def accuracies(rm: reward.RewardModel, tok: task.ChatTokenizer, data: dict) -> dict:
    """Held-out pair accuracy on the policy's own samples and on constructed pairs."""
    return {"sampled": reward.pair_accuracy(rm, tok, data["test_sampled"]),
            "constructed": reward.pair_accuracy(rm, tok, data["test_constructed"])}


def _digest(path: Path) -> str:
    from .base import sha256

    return sha256(path)


@threads(1)
def write_reward_model(folder: str | Path, start_folder: str | Path,
                       cfg: reward.RMConfig = RECIPE, name: str = NAME) -> Path:
    """Train the reward model from the start policy in `start_folder` and store
    `<name>.safetensors` and `<name>.json` in `folder`."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = task.chat_tokenizer()
    policy = start.load_start(start_folder)
    data = preference_data(policy, tok)
    rm = reward.RewardModel(policy)
    curve, losses, t0 = [], [], time.perf_counter()
    for k in range(0, cfg.steps, EVAL_EVERY):  # the same steps, evaluated every EVAL_EVERY
        part = dataclasses.replace(cfg, steps=min(EVAL_EVERY, cfg.steps - k), seed=cfg.seed + k,
                                   warmup_steps=cfg.warmup_steps if k == 0 else 0)
        losses += reward.train_rm(rm, tok, data["train"], part)
        curve.append({"step": k + part.steps, **accuracies(rm, tok, data)})
    weights = folder / f"{name}.safetensors"
    save_file({k: v.contiguous() for k, v in rm.state_dict().items()}, str(weights))
    cmd = f"python -m trainbook reward-model --out {folder} --start {start_folder}"
    record = header(MEASUREMENT, cmd, torch.device("cpu"), "small")
    record.update(recipe=dataclasses.asdict(cfg), data=DATA, eval_every=EVAL_EVERY,
                  train_pairs=len(data["train"]), test_pairs={
                      k: len(data[f"test_{k}"]) for k in ("sampled", "constructed")},
                  start_sha256=start.start_record(start_folder)["sha256"],
                  sha256=_digest(weights), losses=losses, accuracy=curve,
                  train_seconds=time.perf_counter() - t0)
    return write_record(folder, name, record)


def reward_record(folder: str | Path, name: str = NAME) -> dict:
    return read_record(Path(folder) / f"{name}.json", MEASUREMENT,
                       "trainbook.align.reward_study.write_reward_model")


def load_reward_model(folder: str | Path, start_folder: str | Path,
                      name: str = NAME) -> reward.RewardModel:
    """The stored reward model, after checking its weights against the record's SHA-256."""
    from safetensors.torch import load_file

    record = reward_record(folder, name)
    weights = Path(folder) / f"{name}.safetensors"
    if not weights.is_file() or _digest(weights) != record["sha256"]:
        raise ValueError(f"{weights} is missing or does not match the SHA-256 in {name}.json; "
                         "write it again with `python -m trainbook reward-model`")
    rm = reward.RewardModel(start.load_start(start_folder))
    rm.load_state_dict(load_file(str(weights)))
    return rm.eval()


def overopt_curves(policy: torch.nn.Module, rms: dict[str, reward.RewardModel],
                   tok: task.ChatTokenizer) -> dict[str, list[dict]]:
    """Best-of-n against each reward model from `policy` on the study's test prompts (one set
    of samples for all), as dicts."""
    items = task.make_problems(OVEROPT["prompts"], split="test", seed=OVEROPT["seed"])
    curves = O.best_of_n(policy, rms, tok, items, OVEROPT["samples"], OVEROPT["ns"],
                         P.graded_reward, seed=OVEROPT["seed"])
    return {name: [dataclasses.asdict(p) for p in points] for name, points in curves.items()}


@threads(1)
def write_overopt(folder: str | Path, start_folder: str | Path,
                  reward_folder: str | Path | None = None) -> Path:
    """Train the proxies, run best-of-n against each and the stored reward model (in
    `reward_folder`, by default `folder`), store `rm-overopt.json` in `folder`."""
    reward_folder = folder if reward_folder is None else reward_folder
    tok = task.chat_tokenizer()
    policy = start.load_start(start_folder)
    data = preference_data(policy, tok)
    rms, proxies = {}, {}
    order = torch.randperm(len(data["train"]), generator=torch.Generator().manual_seed(0))
    cfg = dataclasses.replace(RECIPE, steps=OVEROPT["steps"], batch_size=OVEROPT["batch_size"])
    for n in OVEROPT["pairs"]:
        rm = rms[f"{n} pairs"] = reward.RewardModel(policy)
        reward.train_rm(rm, tok, [data["train"][i] for i in order[:n]], cfg)
        proxies[f"{n} pairs"] = {"pairs": n, "steps": cfg.steps, **accuracies(rm, tok, data)}
    rms["stored reward model"] = load_reward_model(reward_folder, start_folder)
    rec = reward_record(reward_folder)
    proxies["stored reward model"] = {"pairs": rec["train_pairs"],
                                      "steps": rec["recipe"]["steps"],
                                      **accuracies(rms["stored reward model"], tok, data)}
    for name, points in overopt_curves(policy, rms, tok).items():
        proxies[name]["curve"] = points
    cmd = f"python -m trainbook reward-model --overopt --out {folder} --start {start_folder}"
    record = header("reward-overopt", cmd, torch.device("cpu"), "small")
    record.update(settings={k: list(v) if isinstance(v, tuple) else v
                            for k, v in OVEROPT.items()}, proxies=proxies)
    return write_record(folder, OVEROPT_NAME, record)


def overopt_record(folder: str | Path) -> dict:
    return read_record(Path(folder) / f"{OVEROPT_NAME}.json", "reward-overopt",
                       "trainbook.align.reward_study.write_overopt")
