"""Supervised fine-tuning: next-token loss on the assistant's tokens only.

A chat example is the prompt and the response in the chat format; the model should learn to
produce the response, not to predict the user's text, so the loss averages the cross-entropy over
the tokens the mask marks (the response and its `<|eos|>`, `ChatTokenizer.chat_ids`), over the
whole batch at once (a token mean, as transformers and TRL compute it: every assistant token
weighs the same, whatever the length of its sequence). `sft` is the plain loop: AdamW, linear
warmup, constant rate, batches drawn with replacement from the examples by a seeded generator.

Chapter: book/alignment/sft
"""

from __future__ import annotations

from collections.abc import Sequence
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

    def __post_init__(self):
        check_fields(self, positive=("steps", "batch_size", "lr"),
                     non_negative=("warmup_steps", "weight_decay", "seed"))


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


def sft(model: nn.Module, tok: ChatTokenizer, items: Sequence[Problem],
        cfg: SFTConfig = SFTConfig()) -> list[float]:
    """Fine-tune `model` in place on the items' chat examples; returns the loss of every step."""
    data = examples(tok, items)
    device = next(model.parameters()).device
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                            weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0)
    g = torch.Generator().manual_seed(cfg.seed)
    model.train()
    losses = []
    for _ in range(cfg.steps):
        pick = torch.randint(len(data), (cfg.batch_size,), generator=g).tolist()
        ids, mask = pad([data[i][0] for i in pick], [data[i][1] for i in pick])
        loss = masked_lm_loss(model, ids.to(device), mask.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    model.eval()
    return losses
