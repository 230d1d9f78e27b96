"""The DPO chapter's stored study: DPO at several beta, IPO, SimPO, and GRPO on the same budget,
all from the stored start policy (`align.start`) on the same preference pairs.

`write_study` samples `STUDY["samples"]` completions of each of `STUDY["prompts"]` training
prompts with the start policy, pairs a verified answer with a wrong one where a prompt has both
(`dpo.preference_pairs`), and trains a fresh copy of the start policy on those pairs per run. Each
run records its per-step history (`dpo.train`), the chosen and rejected log-probabilities of a
fixed set of pairs every few steps (`dpo.evaluate_pairs`), and greedy pass@1 on the evaluation
items before and after. A GRPO run (`align.grpo`) is given the same number of generated
completions as the pairs cost, which is how DPO's offline data and RL's online samples compare
on one budget. The runs take minutes on a CPU, so the chapter reads the stored record
(`read_study`) and tests/test_dpo.py re-runs one point.

Chapter: book/alignment/dpo
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from ..bench.gpu_truth import header, read_record, write_record
from . import dpo, grpo, policy, preferences, start, task

STUDY = {"prompts": 1024, "samples": 4, "pair_seed": 3, "steps": 30, "batch_size": 32,
         "lr": 1e-5, "track_pairs": 64, "track_every": 5, "eval_items": 500}
# name -> DPOConfig overrides; "dpo" is the chapter's main run
RUNS = {
    "dpo": {},
    "dpo beta 0.03": {"beta": 0.03},
    "dpo beta 0.3": {"beta": 0.3},
    "dpo beta 1": {"beta": 1.0},
    "dpo lr 1e-4": {"lr": 1e-4, "steps": 60},
    "ipo": {"loss": "ipo"},
    "simpo": {"loss": "simpo", "beta": 2.0},
}
GRPO_RUN = {"prompts": 16, "group": 8, "lr": 1e-4}  # steps: the pairs' budget / (prompts * G)
MEASUREMENT = "dpo-study"


def config(name: str) -> dpo.DPOConfig:
    """The DPOConfig of a run of RUNS."""
    if name not in RUNS:
        raise ValueError(f"run must be one of {', '.join(RUNS)}, got {name!r}")
    base = dict(steps=STUDY["steps"], batch_size=STUDY["batch_size"], lr=STUDY["lr"])
    return dpo.DPOConfig(**{**base, **RUNS[name]})


def one_run(name: str, pairs: list[preferences.Pair], tok: task.ChatTokenizer,
            items: list[task.Problem], folder: str | Path) -> dict:
    """Train a fresh start policy (stored in `folder`) with run `name` on the pairs; its history,
    the tracked pairs' log-probabilities and pass@1 on `items`."""
    cfg = config(name)
    model, ref = start.load_start(folder), start.load_start(folder)
    track = pairs[:STUDY["track_pairs"]]
    tracked = []

    def snapshot(step: int) -> None:
        tracked.append({"step": step, **dpo.evaluate_pairs(model, ref, tok, track, cfg.beta)})

    t0 = time.perf_counter()
    history = dpo.train(model, ref, tok, pairs, cfg, on_step=lambda k: snapshot(k)
                        if k % STUDY["track_every"] == 0 or k == cfg.steps else None)
    return {"config": dataclasses.asdict(cfg), "history": history, "tracked": tracked,
            "pass1": policy.accuracy(model, tok, items), "seconds": time.perf_counter() - t0}


def write_study(path: str | Path, runs: tuple[str, ...] = tuple(RUNS), grpo_run: bool = True
                ) -> Path:
    """Run the study and store it as JSON at `path`, from the start policy stored beside it
    (see the module docstring)."""
    path = Path(path)
    folder = path.parent
    tok = task.chat_tokenizer()
    items = start.eval_items(STUDY["eval_items"])
    model = start.load_start(folder)
    train_items = task.make_problems(STUDY["prompts"], 2, seed=STUDY["pair_seed"])
    pairs, generated = dpo.preference_pairs(model, tok, train_items, STUDY["samples"],
                                            seed=STUDY["pair_seed"])
    cmd = (f'python -c "from trainbook.align import dpo_study; '
           f'dpo_study.write_study({str(path)!r})"')
    record = header(MEASUREMENT, cmd, torch.device("cpu"), "small")
    record.update(study=STUDY, start=start.start_record(folder)["sha256"],
                  pass1_start=policy.accuracy(model, tok, items), pairs=len(pairs),
                  generated=generated, runs={})
    for name in runs:
        record["runs"][name] = one_run(name, pairs, tok, items, folder)
    if grpo_run:
        steps = generated // (GRPO_RUN["prompts"] * GRPO_RUN["group"])
        cfg = grpo.GRPOConfig(steps=steps, **GRPO_RUN)
        t0 = time.perf_counter()
        g_model = start.load_start(folder)
        hist = grpo.train(g_model, tok, task.make_problems(STUDY["prompts"], 2,
                                                           seed=STUDY["pair_seed"]), cfg)
        record["grpo"] = {"config": dataclasses.asdict(cfg), "history": hist,
                          "generated": sum(h["generated"] for h in hist),
                          "pass1": policy.accuracy(g_model, tok, items),
                          "seconds": time.perf_counter() - t0}
    return write_record(path.parent, path.stem, record)


def read_study(path: str | Path) -> dict:
    """The stored study (a ValueError naming `write_study` if there is none)."""
    return read_record(path, MEASUREMENT, "trainbook.align.dpo_study.write_study")
