"""The GRPO chapter's stored studies, all from the stored start policy (`align.start`).

Four parts, each a JSON record written by `write_part` (they run in parallel processes):

- "kl": GRPO with and without the KL term (beta 0 and 0.04), pass@1 on the evaluation items
  every `eval_every` steps; the chapter's headline run.
- "dapo": DAPO's changes with two updates per batch (mu = 2, so the ratio leaves 1 and the clip
  acts): the symmetric clip 0.2, clip-higher (0.2, 0.28), and clip-higher with dynamic sampling;
  clip fractions, entropy, completions generated and pass@1.
- "length": the aggregations' length bias on a task variant where length can vary: the start
  policy is first fine-tuned (`padded_start`) to follow its answer with 0 to `MAX_PAD` spaces
  (the verifier ignores them; trailing, so the digits keep their positions), then trained by
  GRPO with each aggregation ("grpo", "dapo", "dr_grpo", all with the group std); the record
  holds each step's mean completion length of right and wrong answers.
- "r1": the DeepSeek-R1 recipe at small scale: the start policy is the cold-start SFT model;
  GRPO with the verifier is the RL stage; rejection sampling keeps the RL model's verified
  samples of training prompts (`rejection_sample`); the start policy fine-tuned on them is the
  next round's SFT model; as a control, the same fine-tuning on the answer key of all the
  prompts. pass@1 of each stage.

Chapter: book/alignment/grpo
"""

from __future__ import annotations

import copy
import dataclasses
import random
import time
from pathlib import Path

import torch

from ..bench.gpu_truth import header, read_record, write_record
from . import grpo, policy, sft, start, task

STUDY = {"train_items": 2000, "train_seed": 3, "eval_items": 500, "eval_every": 10}
BASE = dict(steps=40, prompts=16, group=8, lr=1e-4)
PARTS = {
    "kl": {"grpo": {}, "grpo + kl 0.04": {"beta": 0.04}},
    "dapo": {"clip 0.2": {"updates": 2}, "clip-higher 0.28": {"updates": 2, "eps_high": 0.28},
             "clip-higher + dynamic sampling": {"updates": 2, "eps_high": 0.28,
                                                "dynamic_sampling": True}},
    "length": {"grpo": {"loss": "grpo"}, "dapo": {"loss": "dapo"},
               "dr_grpo": {"loss": "dr_grpo"}},
    "r1": {"grpo": {}},
}
MAX_PAD = 4  # the length variant: answers followed by 0..MAX_PAD spaces
PAD_SFT = sft.SFTConfig(steps=100, lr=1e-4)
LENGTH_TOKENS = 10  # max_new_tokens of the length variant (answer + pad + <|eos|> fit)
R1 = {"samples": 4, "prompts": 1024, "seed": 11, "sft": sft.SFTConfig(steps=100, lr=1e-4)}
MEASUREMENT = "grpo-study"


def padded_items(items: list[task.Problem], seed: int = 0) -> list[task.Problem]:
    """The items with their answers followed by 0..MAX_PAD spaces (drawn uniformly): SFT data
    for the length variant (the verifier strips the spaces, so every one is right)."""
    rng = random.Random(seed)
    return [task.Problem(p.prompt, p.answer + " " * rng.randint(0, MAX_PAD)) for p in items]


def padded_start(folder: str | Path, tok: task.ChatTokenizer) -> torch.nn.Module:
    """The start policy fine-tuned with PAD_SFT to answer after a varying number of spaces."""
    model = start.load_start(folder)
    data = padded_items(task.make_problems(start.START_ITEMS, 2, seed=0))
    sft.sft(model, tok, data, PAD_SFT)
    return model


def rejection_sample(model: torch.nn.Module, tok: task.ChatTokenizer, items: list[task.Problem],
                     samples: int, seed: int = 0) -> list[task.Problem]:
    """Sample `samples` completions per item; keep one verified completion per item (as the
    item's new response, spaces and all): the SFT data of the next round."""
    if not items:
        raise ValueError("no items to sample")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"samples must be a whole number >= 1, got {samples!r}")
    from .dpo import rewards

    rep = [p for p in items for _ in range(samples)]
    roll = policy.sample(model, tok, task.encode_prompts(tok, rep),
                         max(len(p.answer) for p in items) + 2 + MAX_PAD,
                         generator=torch.Generator().manual_seed(seed))
    r = rewards(rep, roll)
    kept = {}
    for p, text, ok in zip(rep, roll.texts, r):
        if ok == 1.0 and p.prompt not in kept:
            kept[p.prompt] = task.Problem(p.prompt, text)
    return list(kept.values())


def _run(model, tok, train, items, cfg: grpo.GRPOConfig, ref=None) -> dict:
    t0 = time.perf_counter()
    hist = grpo.train(model, tok, train, cfg, ref=ref, eval_items=items,
                      eval_every=STUDY["eval_every"])
    return {"config": dataclasses.asdict(cfg), "history": hist,
            "generated": sum(h["generated"] for h in hist),
            "pass1": hist[-1]["pass1_after"], "seconds": time.perf_counter() - t0}


def write_part(folder: str | Path, part: str) -> Path:
    """Run one part of the study from the start policy stored in `folder` and store it there as
    `grpo-<part>.json`."""
    if part not in PARTS:
        raise ValueError(f"part must be one of {', '.join(PARTS)}, got {part!r}")
    folder = Path(folder)
    tok = task.chat_tokenizer()
    train = task.make_problems(STUDY["train_items"], 2, seed=STUDY["train_seed"])
    items = start.eval_items(STUDY["eval_items"])
    cmd = (f'python -c "from trainbook.align import grpo_study; '
           f'grpo_study.write_part({str(folder)!r}, {part!r})"')
    record = header(MEASUREMENT, cmd, torch.device("cpu"), "small")
    record.update(part=part, study=STUDY, start=start.start_record(folder)["sha256"], runs={})
    extra = {}
    if part == "length":
        extra = {"max_new_tokens": LENGTH_TOKENS}
        record.update(max_pad=MAX_PAD, pad_sft=dataclasses.asdict(PAD_SFT))
    padded = padded_start(folder, tok) if part == "length" else None
    for name, over in PARTS[part].items():
        cfg = grpo.GRPOConfig(**{**BASE, **extra, **over})
        model = copy.deepcopy(padded) if padded is not None else start.load_start(folder)
        if name == next(iter(PARTS[part])):
            record["pass1_start"] = policy.accuracy(model, tok, items)
        ref = start.load_start(folder) if cfg.beta else None
        record["runs"][name] = _run(model, tok, train, items, cfg, ref)
        if part == "r1":
            rs_items = task.make_problems(R1["prompts"], 2, seed=R1["seed"])
            kept = rejection_sample(model, tok, rs_items, R1["samples"], R1["seed"])
            student = start.load_start(folder)
            sft.sft(student, tok, kept, R1["sft"])
            control = start.load_start(folder)  # the same SFT on the answer key of all prompts
            sft.sft(control, tok, rs_items, R1["sft"])
            record["r1"] = {"prompts": R1["prompts"], "samples": R1["samples"],
                            "kept": len(kept), "sft": dataclasses.asdict(R1["sft"]),
                            "pass1_rs_sft": policy.accuracy(student, tok, items),
                            "pass1_answer_key_sft": policy.accuracy(control, tok, items)}
    return write_record(folder, f"grpo-{part}", record)


def read_part(folder: str | Path, part: str) -> dict:
    """A stored part (a ValueError naming `write_part` if there is none)."""
    return read_record(Path(folder) / f"grpo-{part}.json", MEASUREMENT,
                       "trainbook.align.grpo_study.write_part")
