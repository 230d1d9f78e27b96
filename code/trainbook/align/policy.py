"""A language model as a policy: sample completions, score them, and take log-probabilities.

Every method in Part 7 needs the same three things from a model: completions of prompts
(`sample`), the log-probability of given tokens under it (`token_logprobs`, summed over a mask by
`sequence_logprobs`), and a task score (`accuracy`). Sequences of unequal length are right-padded
(`pad`): under causal attention a pad token after a sequence's end cannot change anything before
it, so no attention mask is needed, only a loss mask. Sampling runs prompts of equal length
together (the task's prompts all have one length) and keeps each sequence up to its first
`<|eos|>`; there is no KV cache, which costs nothing at these lengths.

Chapter: book/alignment/evaluation
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .task import EOS, PAD, ChatTokenizer, Problem, encode_prompts, verify


def logits_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Logits (batch, time, vocab) of the reference model or of a transformers causal LM."""
    out = model(ids)
    logits = out[0] if isinstance(out, tuple) else out.logits
    return logits.float()


def pad(seqs: Sequence[Sequence[int]], masks: Sequence[Sequence[int]] | None = None,
        pad_id: int = PAD) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad to one length: (ids (B, T), mask (B, T)); the mask is 1 on real tokens, or the
    given per-token masks (for example the assistant tokens of `ChatTokenizer.chat_ids`)."""
    if not seqs or any(len(s) == 0 for s in seqs):
        raise ValueError("pad needs at least one sequence and no empty sequence")
    if masks is not None and [len(m) for m in masks] != [len(s) for s in seqs]:
        raise ValueError("each mask must have its sequence's length")
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = torch.tensor(masks[i]) if masks is not None else 1
    return ids, mask


def token_logprobs(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """log p(ids[:, t+1] | ids[:, :t+1]) for every t: shape (B, T-1), differentiable."""
    if ids.dim() != 2 or ids.shape[1] < 2:
        raise ValueError(f"ids must be (batch, time >= 2), got shape {tuple(ids.shape)}")
    logits = logits_of(model, ids)[:, :-1]
    return torch.gather(F.log_softmax(logits, dim=-1), 2, ids[:, 1:, None]).squeeze(2)


def sequence_logprobs(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of the log-probabilities of the tokens where mask is 1: shape (B,)."""
    if mask.shape != ids.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} differs from ids {tuple(ids.shape)}")
    return (token_logprobs(model, ids) * mask[:, 1:]).sum(-1)


@dataclass
class Rollouts:
    """Sampled completions: prompt ids, completion ids (up to and including the first
    `<|eos|>`, if one came within the budget) and their decoded text."""

    prompts: list[list[int]]
    completions: list[list[int]]
    texts: list[str]

    def sequences(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompt + completion, right-padded, with a mask on the completion tokens."""
        seqs = [p + c for p, c in zip(self.prompts, self.completions)]
        masks = [[0] * len(p) + [1] * len(c) for p, c in zip(self.prompts, self.completions)]
        return pad(seqs, masks)


@torch.no_grad()
def sample(model: nn.Module, tok: ChatTokenizer, prompts: Sequence[Sequence[int]],
           max_new_tokens: int, temperature: float = 1.0, greedy: bool = False,
           generator: torch.Generator | None = None, stop_id: int = EOS) -> Rollouts:
    """Complete each prompt (token ids) by sampling at `temperature`, or greedily, until
    `stop_id` (`<|eos|>`; a base model's raw text stops at a newline instead)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or \
            max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a whole number >= 1, got {max_new_tokens!r}")
    if not greedy and not temperature > 0:
        raise ValueError(f"temperature must be positive (or greedy=True), got {temperature}")
    if not prompts:
        raise ValueError("no prompts to sample from")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    completions: list[list[int]] = [[] for _ in prompts]
    by_length: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_length.setdefault(len(p), []).append(i)
    for rows in by_length.values():
        ids = torch.tensor([list(prompts[i]) for i in rows], device=device)
        done = torch.zeros(len(rows), dtype=torch.bool, device=device)
        for _ in range(max_new_tokens):
            logits = logits_of(model, ids)[:, -1]
            if greedy:
                nxt = logits.argmax(-1)
            else:
                probs = (logits / temperature).softmax(-1)
                nxt = torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(1)
                nxt = nxt.to(device)
            nxt = torch.where(done, torch.full_like(nxt, PAD), nxt)
            ids = torch.cat([ids, nxt[:, None]], dim=1)
            done |= nxt == stop_id
            if bool(done.all()):
                break
        start = len(prompts[rows[0]])
        for j, i in enumerate(rows):
            out = ids[j, start:].tolist()
            completions[i] = out[:out.index(stop_id) + 1] if stop_id in out else \
                [t for t in out if t != PAD]
    model.train(was_training)
    return Rollouts([list(p) for p in prompts], completions,
                    [tok.decode(c) for c in completions])


def accuracy(model: nn.Module, tok: ChatTokenizer, items: Sequence[Problem],
             greedy: bool = True, temperature: float = 1.0, max_new_tokens: int | None = None,
             generator: torch.Generator | None = None) -> float:
    """Share of items whose completion (greedy by default: pass@1 at temperature 0) is exactly
    right; a completion must end with `<|eos|>` to count, as a chat model must stop."""
    if not items:
        raise ValueError("no items to score")
    budget = max_new_tokens or max(len(p.answer) for p in items) + 2
    roll = sample(model, tok, encode_prompts(tok, items), budget, temperature, greedy, generator)
    right = [verify(p, text) if c[-1:] == [EOS] else 0.0
             for p, c, text in zip(items, roll.completions, roll.texts)]
    return sum(right) / len(right)
