"""Supervised fine-tuning: next-token loss on the assistant's tokens only.

A chat example is the prompt and the response in the chat format; the model should learn to
produce the response, not to predict the user's text, so the loss averages the cross-entropy over
the tokens the mask marks (the response and its `<|eos|>`, `ChatTokenizer.chat_ids`), over the
whole batch at once (a token mean, as transformers and TRL compute it: every assistant token
weighs the same, whatever the length of its sequence). `sft` is the plain loop: AdamW, linear
warmup, constant rate, optional clipping of the global gradient norm (`max_grad_norm`, off by
default; transformers and TRL clip at 1.0), batches drawn with replacement from the examples by a
seeded generator (`draws`); `RECIPE` is the budget the chapter recommends. `optimize` is that
loop with the loss left to the caller, so that the chapter's variants (packed rows, other loss
masks) train with the same optimizer and schedule.

Chapter: book/alignment/sft
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .policy import logits_of, pad
from .task import ChatTokenizer, Problem, check_fields


@dataclass(frozen=True)
class SFTConfig:
    """Fine-tuning settings (defaults: seconds on a CPU for the book's base model)."""

    steps: int = 150
    batch_size: int = 32
    lr: float = 1e-3
    warmup_steps: int = 10
    weight_decay: float = 0.0
    seed: int = 0
    max_grad_norm: float = 0.0  # clip the global gradient norm to this; 0: no clipping

    def __post_init__(self):
        check_fields(self, positive=("steps", "batch_size", "lr"),
                     non_negative=("warmup_steps", "weight_decay", "seed", "max_grad_norm"))


# The chapter's recommended budget for the book's base model (its stored study: 4 epochs of
# RECIPE_ITEMS training items at lr 1e-3); the SFTConfig defaults stay the short run that
# align.start and the DPO and GRPO chapters build on.
RECIPE = SFTConfig(steps=1000)
RECIPE_ITEMS = 8000


def examples(tok: ChatTokenizer, items: Sequence[Problem]) -> list[tuple[list[int], list[int]]]:
    """(ids, assistant mask) of each item answered correctly: the SFT data."""
    if not items:
        raise ValueError("no items to fine-tune on")
    return [tok.chat_ids(p.prompt, p.answer) for p in items]


def masked_lm_loss(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the tokens where mask is 1 (each predicted from the ones before)."""
    if mask.shape != ids.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} differs from ids {tuple(ids.shape)}")
    if int(mask[:, 1:].sum()) == 0:
        raise ValueError("the mask selects no token to train on (the first token is never a "
                         "target)")
    logits = logits_of(model, ids)[:, :-1]
    targets = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                           ignore_index=-100)


def draws(n: int, cfg: SFTConfig) -> list[list[int]]:
    """The example indices of every step's batch: cfg.batch_size of the n examples, drawn with
    replacement by a generator seeded with cfg.seed (what `sft` trains on, step by step)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a whole number >= 1 (the number of examples), got {n!r}")
    g = torch.Generator().manual_seed(cfg.seed)
    return [torch.randint(n, (cfg.batch_size,), generator=g).tolist() for _ in range(cfg.steps)]


def optimize(model: nn.Module, cfg: SFTConfig, loss_at: Callable[[int], torch.Tensor],
             on_step: Callable[[int], None] | None = None) -> list[float]:
    """cfg.steps steps of AdamW (cfg.lr, cfg.weight_decay; linear warmup over cfg.warmup_steps,
    then constant; the global gradient norm clipped to cfg.max_grad_norm when it is > 0) on the
    loss `loss_at(step)` returns; trains `model` in place and returns every step's loss.
    `on_step(k)` runs after the k-th step (k = 1..steps), in eval mode (to score the model)."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                            weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0)
    model.train()
    losses = []
    for step in range(cfg.steps):
        loss = loss_at(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.max_grad_norm:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad],
                                           cfg.max_grad_norm)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if on_step is not None:
            model.eval()
            on_step(step + 1)
            model.train()
    model.eval()
    return losses


def sft(model: nn.Module, tok: ChatTokenizer, items: Sequence[Problem],
        cfg: SFTConfig = SFTConfig(), on_step: Callable[[int], None] | None = None
        ) -> list[float]:
    """Fine-tune `model` in place on the items' chat examples; returns the loss of every step
    (`on_step`: see `optimize`)."""
    data = examples(tok, items)
    device = next(model.parameters()).device
    batches = draws(len(data), cfg)

    def loss_at(step: int) -> torch.Tensor:
        ids, mask = pad([data[i][0] for i in batches[step]], [data[i][1] for i in batches[step]])
        return masked_lm_loss(model, ids.to(device), mask.to(device))

    return optimize(model, cfg, loss_at, on_step)
