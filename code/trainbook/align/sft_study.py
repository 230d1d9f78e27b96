"""What supervised fine-tuning does to the task score, and which settings decide it.

The base model answers sums in the raw form it was pretrained on and never stops in the chat
format (`base.raw_accuracy` against `policy.accuracy`). `score` measures both forms and the
held-out loss on the test split's answers; `finetune` runs one SFT variant on a fresh copy of
the base model: the loss on the assistant's tokens or on all tokens (`sft_data.loss_mask`), rows
padded (`sft.sft`) or packed with or without document boundaries (`sft_packing.sft_packed`).
`curve` scores a run every so many steps (accuracy against epochs), `lr_sweep` runs SFT at
several peak learning rates on the same batches, and `study` runs the sweep and the variants over
seeds and returns the record the chapter stores (`book/alignment/data/sft-study-seed*.json`,
one per seed, written by `write_study`, read back by `read_study`).

Chapter: book/alignment/sft
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from ..bench.gpu_truth import header, read_record, write_record
from .base import BaseRecipe, base_model, raw_accuracy
from .policy import accuracy, pad, token_logprobs
from .sft import SFTConfig, examples, masked_lm_loss, sft
from .sft_data import LOSS_ON, loss_mask
from .sft_packing import sft_packed
from .task import EOS, ChatTokenizer, Problem, chat_tokenizer, make_problems

PACKING = ("padded", "boundaries", "naive")
MEASUREMENT = "align-sft-study"


def epochs(cfg: SFTConfig, n_train: int) -> float:
    """Passes over n_train examples that cfg's steps and batch size make."""
    return cfg.steps * cfg.batch_size / n_train


@torch.no_grad()
def held_out_loss(model: nn.Module, tok: ChatTokenizer, items: Sequence[Problem]) -> float:
    """The SFT loss (answer and <|eos|> tokens) on items the model did not train on."""
    data = examples(tok, items)
    ids, mask = pad([d[0] for d in data], [d[1] for d in data])
    was = model.training
    model.eval()
    device = next(model.parameters()).device
    loss = masked_lm_loss(model, ids.to(device), mask.to(device)).item()
    model.train(was)
    return loss


@torch.no_grad()
def loss_by_part(model: nn.Module, tok: ChatTokenizer, items: Sequence[Problem]
                 ) -> dict[str, float]:
    """Mean next-token loss of the items' chat examples by the part of the example each target
    token is in: the prompt (`<|user|>`, the operands, `<|assistant|>`), the answer's digits,
    and the closing `<|eos|>`."""
    data = examples(tok, items)
    ids, mask = pad([d[0] for d in data], [d[1] for d in data])
    real = pad([d[0] for d in data])[1]
    was = model.training
    model.eval()
    device = next(model.parameters()).device
    nll = -token_logprobs(model, ids.to(device)).cpu()
    model.train(was)
    target, trained, present = ids[:, 1:], mask[:, 1:] == 1, real[:, 1:] == 1
    eos = target == EOS
    parts = {"prompt": present & ~trained, "answer": trained & ~eos, "<|eos|>": trained & eos}
    return {k: nll[m].mean().item() for k, m in parts.items()}


def score(model: nn.Module, tok: ChatTokenizer, test: Sequence[Problem]) -> dict[str, float]:
    """Greedy exact-match accuracy in the raw form and in the chat form, and the held-out loss."""
    return {"raw accuracy": raw_accuracy(model, tok, list(test)),
            "chat accuracy": accuracy(model, tok, test),
            "held-out loss": held_out_loss(model, tok, test)}


def finetune(model: nn.Module, tok: ChatTokenizer, train: Sequence[Problem], cfg: SFTConfig,
             loss_on: str = "assistant", packing: str = "padded", capacity: int = 64,
             on_step: Callable[[int], None] | None = None) -> list[float]:
    """One SFT variant, in place on `model`; returns the per-step losses (`on_step`: see
    `sft.optimize`)."""
    if loss_on not in LOSS_ON:
        raise ValueError(f"loss_on must be one of {LOSS_ON}, got {loss_on!r}")
    if packing not in PACKING:
        raise ValueError(f"packing must be one of {PACKING}, got {packing!r}")
    if packing == "padded" and loss_on == "assistant":
        return sft(model, tok, train, cfg, on_step)
    data = loss_mask(examples(tok, train), loss_on)
    # packing with boundaries computes what padding computes (the chapter shows it), so the
    # all-token loss on padded rows runs as packed rows with boundaries
    return sft_packed(model, tok, train, cfg, capacity, packing != "naive", data, on_step)


def curve(model: nn.Module, tok: ChatTokenizer, train: Sequence[Problem],
          test: Sequence[Problem], cfg: SFTConfig, every: int, loss_on: str = "assistant",
          packing: str = "padded") -> dict:
    """Fine-tune `model` (in place) and score it every `every` steps and at the end: the
    points (step, epochs, `score`), the mean loss of each `every` steps, and the seconds."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"every must be a whole number of steps >= 1, got {every!r}")
    points = [{"step": 0, "epochs": 0.0, **score(model, tok, test)}]

    def on_step(k: int) -> None:
        if k % every == 0 or k == cfg.steps:
            points.append({"step": k, "epochs": epochs(cfg, len(train)) * k / cfg.steps,
                           **score(model, tok, test)})
    t0 = time.perf_counter()
    losses = finetune(model, tok, train, cfg, loss_on, packing, on_step=on_step)
    seconds = time.perf_counter() - t0
    chunks = [losses[i:i + every] for i in range(0, len(losses), every)]
    return {"points": points, "loss": [sum(c) / len(c) for c in chunks], "seconds": seconds}


def lr_sweep(start: Callable[[], nn.Module], tok: ChatTokenizer, train: Sequence[Problem],
             test: Sequence[Problem], lrs: Sequence[float], cfg: SFTConfig,
             every: int | None = None) -> list[dict]:
    """SFT at each peak learning rate from a fresh `start()` model, on the same batches: each
    run's `curve` (scored every `every` steps; default: only at the end)."""
    if not lrs or any(isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0
                      for lr in lrs):
        raise ValueError(f"lrs must be positive learning rates, got {list(lrs)}")
    return [{"lr": lr, **curve(start(), tok, train, test, dataclasses.replace(cfg, lr=lr),
                               every or cfg.steps)} for lr in lrs]


VARIANTS = (("all", "padded"), ("assistant", "boundaries"), ("assistant", "naive"))


def study(lrs: Sequence[float], seeds: Sequence[int], cfg: SFTConfig, n_train: int = 8000,
          n_test: int = 500, every: int = 100, recipe: BaseRecipe | None = None) -> dict:
    """The lr sweep and the variants (`VARIANTS` at cfg.lr: the loss on all tokens; packed rows
    with boundaries, and naive) for each seed of the batch order: the chapter's stored record."""
    recipe = BaseRecipe() if recipe is None else recipe
    if not seeds:
        raise ValueError("give at least one seed")
    tok = chat_tokenizer()
    train = make_problems(n_train, recipe.digits, seed=1, split="train")
    test = make_problems(n_test, recipe.digits, seed=0, split="test")
    rows: list[dict] = []
    for seed in seeds:
        run = dataclasses.replace(cfg, seed=seed)
        for r in lr_sweep(lambda: base_model(recipe), tok, train, test, lrs, run, every):
            rows.append({"loss_on": "assistant", "packing": "padded", "seed": seed, **r})
        for loss_on, packing in VARIANTS:
            rows.append({"loss_on": loss_on, "packing": packing, "seed": seed, "lr": run.lr,
                         **curve(base_model(recipe), tok, train, test, run, every, loss_on,
                                 packing)})
    return {"config": dataclasses.asdict(cfg), "recipe": dataclasses.asdict(recipe),
            "n_train": n_train, "n_test": n_test, "every": every, "lrs": list(lrs),
            "seeds": list(seeds), "epochs": epochs(cfg, n_train), "rows": rows}


def write_study(out_dir: str | Path, lrs: Sequence[float], seed: int, cfg: SFTConfig,
                n_train: int = 8000, n_test: int = 500, every: int = 100) -> Path:
    """Run `study` for one seed of the batch order and store it with its provenance as
    sft-study-seed<seed>.json in out_dir (one file per seed, so seeds run in parallel)."""
    body = study(lrs, [seed], cfg, n_train, n_test, every)
    fields = ", ".join(f"{k}={v!r}" for k, v in dataclasses.asdict(cfg).items()
                       if v != getattr(SFTConfig(), k))
    command = ("python -c \"from trainbook.align import sft_study as S, sft; "
               f"S.write_study('{out_dir}', {list(lrs)}, {seed}, sft.SFTConfig({fields}), "
               f"{n_train}, {n_test}, {every})\"")
    record = header(MEASUREMENT, command, torch.device("cpu"), "small")
    record.update(body)
    return write_record(out_dir, f"sft-study-seed{seed}", record)


def read_study(path: str | Path) -> dict:
    """A stored study record (see `write_study`)."""
    return read_record(path, MEASUREMENT, "sft_study.write_study")
