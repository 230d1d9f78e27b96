"""Reward models: one number for a whole exchange, learned from pairs a judge ranked.

A reward model is the language model's trunk with its vocabulary head replaced by a scalar
head, `nn.Linear(d_model, 1, bias=False)`, read at the last token of the sequence (the
assistant's `<|eos|>`): the one position that has seen the prompt and the whole response. It
is trained on preference pairs (prompt, chosen, rejected) with the Bradley-Terry model
(Bradley and Terry 1952), as in InstructGPT (Ouyang et al. 2022, Section 3.5): the chance that
a judge prefers the chosen response is sigmoid(r_c - r_r), so the loss is the negative log of
it, -log sigmoid(r_c - r_r). Only differences of rewards enter, so the scale's zero point is
free; trl's `center_rewards_coefficient` adds c * mean((r_c + r_r)**2) (Eisenstein et al.
2023, Eq. 2), which pins the mean reward near 0, and an optional per-pair margin m asks for
r_c - r_r > m (Llama 2, Touvron et al. 2023, Section 3.2.2): -log sigmoid(r_c - r_r - m).
`bt_loss` computes exactly what trl's `RewardTrainer.compute_loss` does (`align.reward_trl`
checks it on the same weights and batch).

Where the score is read follows transformers' sequence-classification models: the rightmost
token that is not the pad token (`last_index`), so right padding is harmless and the model's
config must name a pad token. A batch holds the chosen sequences, then the rejected ones,
padded to one length, as trl's `DataCollatorForPreference` lays it out.

Chapter: book/alignment/reward-models
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ..model import Transformer
from .policy import pad
from .preferences import Pair
from .sft import SFTConfig, draws, optimize
from .task import PAD, ChatTokenizer, check_fields

if TYPE_CHECKING:
    from ..configs import ModelConfig

SCORE_INIT_STD = 0.02  # transformers' initializer_range default: the score head's N(0, 0.02)


class RewardModel(nn.Module):
    """A copy of a language model whose head returns one score per position; `forward` reads it
    at each sequence's last non-pad token: (batch, time) ids -> (batch,) rewards."""

    def __init__(self, lm: Transformer, seed: int = 0, pad_id: int = PAD):
        super().__init__()
        if not isinstance(lm, Transformer):
            raise ValueError(f"a RewardModel starts from the reference Transformer, got "
                             f"{type(lm).__name__}")
        self.pad_id = pad_id
        self.body = copy.deepcopy(lm)
        self.body.head = nn.Identity()  # trunk() now returns the final norm's output
        self.score = nn.Linear(lm.cfg.d_model, 1, bias=False)
        with torch.no_grad():
            g = torch.Generator().manual_seed(seed)
            self.score.weight.copy_(torch.randn(self.score.weight.shape, generator=g)
                                    * SCORE_INIT_STD)
        self.score.to(next(lm.parameters()))

    @property
    def cfg(self) -> ModelConfig:
        return self.body.cfg

    def token_scores(self, ids: torch.Tensor) -> torch.Tensor:
        """The head at every position: (batch, time). A value model reads all of them."""
        if ids.dim() != 2:
            raise ValueError(f"ids must be (batch, time), got shape {tuple(ids.shape)}")
        return self.score(self.body.trunk(ids)).squeeze(-1).float()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        scores = self.token_scores(ids)
        return scores[torch.arange(ids.shape[0], device=ids.device), last_index(ids, self.pad_id)]


def last_index(ids: torch.Tensor, pad_id: int = PAD) -> torch.Tensor:
    """Index of the rightmost non-pad token of each row, transformers' rule (a row of pads
    only gives 0)."""
    positions = torch.arange(ids.shape[-1], device=ids.device)
    return (positions * (ids != pad_id)).argmax(-1)


def bt_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor,
            margin: torch.Tensor | None = None, center_coef: float = 0.0) -> torch.Tensor:
    """Bradley-Terry loss, trl's form: mean(-log sigmoid(r_c - r_r - margin)) plus
    center_coef * mean((r_c + r_r)**2)."""
    if r_chosen.shape != r_rejected.shape or r_chosen.dim() != 1:
        raise ValueError(f"r_chosen {tuple(r_chosen.shape)} and r_rejected "
                         f"{tuple(r_rejected.shape)} must be two vectors of one length")
    if margin is not None and margin.shape != r_chosen.shape:
        raise ValueError(f"margin shape {tuple(margin.shape)} differs from the rewards' "
                         f"{tuple(r_chosen.shape)}: give one margin per pair")
    if not math.isfinite(center_coef) or center_coef < 0:
        raise ValueError(f"center_coef must be a finite number >= 0, got {center_coef}")
    diff = r_chosen - r_rejected - (margin if margin is not None else 0.0)
    loss = -F.logsigmoid(diff).mean()
    if center_coef:
        loss = loss + center_coef * torch.mean((r_chosen + r_rejected) ** 2)
    return loss


def pair_batch(tok: ChatTokenizer, pairs: Sequence[Pair]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (2B, T): the chosen exchanges then the rejected ones, right-padded; margins (B,))."""
    if not pairs:
        raise ValueError("no preference pairs")
    seqs = [tok.chat_ids(p.prompt, p.chosen)[0] for p in pairs] + \
        [tok.chat_ids(p.prompt, p.rejected)[0] for p in pairs]
    ids, _ = pad(seqs)
    return ids, torch.tensor([p.margin for p in pairs], dtype=torch.float32)


def pair_rewards(rm: RewardModel, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rewards of a `pair_batch`: (chosen (B,), rejected (B,))."""
    return rm(ids).chunk(2)


@dataclass(frozen=True)
class RMConfig:
    """Reward-model training settings: SFT's loop settings (`sft.SFTConfig`) and the loss's."""

    steps: int = 150
    batch_size: int = 32
    lr: float = 3e-4
    warmup_steps: int = 10
    weight_decay: float = 0.0
    center_coef: float = 0.0  # trl's center_rewards_coefficient (0: off, trl's None)
    use_margin: bool = False  # subtract each pair's margin inside the sigmoid
    seed: int = 0

    def __post_init__(self):
        check_fields(self, positive=("steps", "batch_size", "lr"),
                     non_negative=("warmup_steps", "weight_decay", "center_coef", "seed"))


def train_rm(rm: RewardModel, tok: ChatTokenizer, pairs: Sequence[Pair],
             cfg: RMConfig = RMConfig()) -> list[float]:
    """Train `rm` in place on the pairs with SFT's optimizer loop (`sft.optimize`: AdamW, linear
    warmup, batches drawn with replacement by a seeded generator); returns every step's loss."""
    if not isinstance(rm, RewardModel):
        raise ValueError(f"train_rm trains a RewardModel, got {type(rm).__name__}")
    if not pairs:
        raise ValueError("no preference pairs to train on")
    device = next(rm.parameters()).device
    loop = SFTConfig(steps=cfg.steps, batch_size=cfg.batch_size, lr=cfg.lr,
                     warmup_steps=cfg.warmup_steps, weight_decay=cfg.weight_decay, seed=cfg.seed)
    batches = draws(len(pairs), loop)

    def loss_at(step: int) -> torch.Tensor:
        ids, margin = pair_batch(tok, [pairs[i] for i in batches[step]])
        r_c, r_r = pair_rewards(rm, ids.to(device))
        return bt_loss(r_c, r_r, margin.to(device) if cfg.use_margin else None, cfg.center_coef)

    return optimize(rm, loop, loss_at)


@torch.no_grad()
def score(rm: RewardModel, tok: ChatTokenizer, prompts: Sequence[str],
          responses: Sequence[str], batch_size: int = 256) -> torch.Tensor:
    """The reward of each (prompt, response) exchange in the chat format: (N,)."""
    if len(prompts) != len(responses) or not prompts:
        raise ValueError(f"need as many responses as prompts (and at least one), got "
                         f"{len(prompts)} prompts and {len(responses)} responses")
    device = next(rm.parameters()).device
    was_training = rm.training
    rm.eval()
    out = []
    for i in range(0, len(prompts), batch_size):
        seqs = [tok.chat_ids(p, r)[0] for p, r in zip(prompts[i:i + batch_size],
                                                      responses[i:i + batch_size])]
        out.append(rm(pad(seqs)[0].to(device)).cpu())
    rm.train(was_training)
    return torch.cat(out)


def pair_accuracy(rm: RewardModel, tok: ChatTokenizer, pairs: Sequence[Pair]) -> float:
    """Share of pairs whose chosen response gets the strictly higher reward (trl's accuracy)."""
    if not pairs:
        raise ValueError("no preference pairs to score")
    prompts = [p.prompt for p in pairs]
    r_c = score(rm, tok, prompts, [p.chosen for p in pairs])
    r_r = score(rm, tok, prompts, [p.rejected for p in pairs])
    return float((r_c > r_r).float().mean())
