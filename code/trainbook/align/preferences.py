"""Preference data from the task: pairs of responses to one prompt, the better one marked.

Human preference data is a prompt and two responses a person ranked. Here the judge is the
task itself. The verifier (`task.verify`) only says right or wrong; `graded_reward` is its
graded version, the "gold" reward the reward-model chapter measures everything against:
1 for the exact answer, falling linearly with the absolute error to 0 at `GRADE_WIDTH` away,
and 0 for a response that is not a plain number. A near miss is better than a far one, so
pairs of two wrong answers still carry a preference, and a policy's mean gold reward moves
smoothly as it improves.

Two sources of pairs, as in practice:
- `constructed_pairs`: the right answer against a corrupted one (`corrupt`: off by one, one
  digit changed, two digits swapped, a digit dropped or added), cheap and always informative;
- `sampled_pairs`: two samples of a policy for the same prompt, ranked by the gold reward
  (InstructGPT's labellers ranked samples of the policy being trained); pairs with equal gold
  reward carry no preference and are dropped.
Each pair carries `margin`, the gold-reward gap, for the margin variant of the loss.

Chapter: book/alignment/reward-models
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .policy import sample
from .task import ChatTokenizer, Problem, encode_prompts

GRADE_WIDTH = 10  # graded_reward falls to 0 at this absolute error
CORRUPTIONS = ("off_by_one", "digit", "swap", "drop", "add")


@dataclass(frozen=True)
class Pair:
    """One preference: for `prompt`, `chosen` is better than `rejected` by `margin` (>= 0)."""

    prompt: str
    chosen: str
    rejected: str
    margin: float = 0.0


def graded_reward(item: Problem, completion: str) -> float:
    """1 - |error| / GRADE_WIDTH, floored at 0, for a response that is a plain number (digits
    only, surrounding space ignored); 0 for anything else."""
    text = completion.strip()
    if not text.isascii() or not text.isdigit():
        return 0.0
    return max(0.0, 1.0 - abs(int(text) - int(item.answer)) / GRADE_WIDTH)


def corrupt(answer: str, rng: random.Random, kind: str | None = None) -> str:
    """A wrong answer made from the right one by one corruption (drawn from CORRUPTIONS when
    kind is None); never returns the answer itself."""
    if not answer.isdigit():
        raise ValueError(f"answer must be a string of digits, got {answer!r}")
    if kind is not None and kind not in CORRUPTIONS:
        raise ValueError(f"kind must be one of {', '.join(CORRUPTIONS)}, got {kind!r}")
    for _ in range(100):
        k = kind or rng.choice(CORRUPTIONS)
        i = rng.randrange(len(answer))
        if k == "off_by_one":
            out = str(max(0, int(answer) + rng.choice((-1, 1))))
        elif k == "digit":
            out = answer[:i] + rng.choice([d for d in "0123456789" if d != answer[i]]) + \
                answer[i + 1:]
        elif k == "swap" and len(answer) > 1:
            i = rng.randrange(len(answer) - 1)
            out = answer[:i] + answer[i + 1] + answer[i] + answer[i + 2:]
        elif k == "drop" and len(answer) > 1:
            out = answer[:i] + answer[i + 1:]
        elif k == "add":
            out = answer[:i] + rng.choice("0123456789") + answer[i:]
        else:
            continue
        if out != answer:
            return out
    raise ValueError(f"could not corrupt {answer!r} with {kind!r}; use another kind")


def constructed_pairs(items: Sequence[Problem], seed: int = 0) -> list[Pair]:
    """The right answer against one corruption of it, for each item."""
    if not items:
        raise ValueError("no items to make pairs from")
    rng = random.Random(seed)
    out = []
    for p in items:
        bad = corrupt(p.answer, rng)
        out.append(Pair(p.prompt, p.answer, bad, 1.0 - graded_reward(p, bad)))
    return out


def sampled_pairs(policy: nn.Module, tok: ChatTokenizer, items: Sequence[Problem],
                  temperature: float = 1.0, seed: int = 0) -> list[Pair]:
    """Two samples of `policy` per item, ranked by the gold reward; ties are dropped."""
    if not items:
        raise ValueError("no items to make pairs from")
    g = torch.Generator().manual_seed(seed)
    budget = max(len(p.answer) for p in items) + 2
    prompts = encode_prompts(tok, items)
    a = sample(policy, tok, prompts, budget, temperature, generator=g).texts
    b = sample(policy, tok, prompts, budget, temperature, generator=g).texts
    out = []
    for p, x, y in zip(items, a, b):
        gx, gy = graded_reward(p, x), graded_reward(p, y)
        if gx != gy:
            hi, lo = (x, y) if gx > gy else (y, x)
            out.append(Pair(p.prompt, hi, lo, abs(gx - gy)))
    return out
