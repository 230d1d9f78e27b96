"""Group relative policy optimisation (GRPO) and its loss-aggregation variants, from scratch.

GRPO (Shao et al. 2024, DeepSeekMath Section 4.1) is PPO without a value model: for each prompt
it samples a group of G completions, scores them with a rule (here `task.verify`), and uses the
reward's standing in its own group as every token's advantage, A_i = (r_i - mean(r)) / std(r).
The policy loss is PPO's clipped ratio per token, ratio = pi(o_t) / pi_old(o_t),
-min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A), plus beta times the k3 estimate of
KL(pi || pi_ref) per token (`align.kl`). What differs between the variants is how the per-token
losses of a batch of completions of different lengths become one number (`aggregate`):

- "grpo": mean over each sequence's tokens, then over sequences (DeepSeekMath's 1/|o_i|): a
  token of a short completion weighs more than a token of a long one, so short right answers
  are pushed up hardest and long wrong ones pushed down least (Liu et al. 2025);
- "dapo": mean over all tokens of the batch (Yu et al. 2025): every token weighs the same (trl's
  "bnpo" is this on one process; its "dapo" normalises by the tokens of the whole generation
  batch, the same number when one batch is one step);
- "dr_grpo": sum over the batch divided by a constant, batch size times the maximum completion
  length (Dr. GRPO, Liu et al. 2025), who also drop the division by std (`scale="none"`), which
  up-weights prompts that are nearly always or nearly never solved.

`token_weights` measures the bias with autograd on the real loss: the gradient each token's
log-probability gets, as a function of its completion's length. DAPO's other two changes are
here too: clip-higher (eps_high 0.28 > eps_low 0.2: a token of low probability may grow more
before the clip stops it) and dynamic sampling (groups whose rewards are all equal have zero
advantage and only dilute the batch: draw more prompts until the batch holds enough informative
groups). `train` is the loop: sample groups, score, advantages, `updates` clipped steps on the
batch (mu in DeepSeekMath's Algorithm 1; with one, the ratio is 1 and the clip never acts).

Chapter: book/alignment/grpo
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from . import kl
from .dpo import rewards
from .policy import Rollouts, accuracy, sample, token_logprobs
from .ppo import logprobs_and_entropy, masked_mean
from .sft import SFTConfig, optimize
from .task import ChatTokenizer, Problem, check_fields, encode_prompts, verify

LOSSES = ("grpo", "dapo", "dr_grpo")
SCALES = ("group", "none")
DAPO_EPS_LOW, DAPO_EPS_HIGH = 0.2, 0.28  # DAPO's clip-higher (Yu et al. 2025, Section 3.1)
# trl's GRPOConfig defaults the chapter relies on (tests assert them against the installed trl)
TRL_GRPO_BETA = 0.0  # no KL term by default
TRL_GRPO_EPSILON = 0.2  # eps_low; epsilon_high None means the same
TRL_GRPO_NUM_GENERATIONS = 8  # G
TRL_GRPO_LOSS_TYPE = "dapo"
TRL_GRPO_SCALE_REWARDS = "group"
TRL_GRPO_NUM_ITERATIONS = 1  # mu: one update per batch, so the ratio is 1
TRL_GRPO_KL_RATIO = True  # use_bias_correction_kl: trl multiplies the k3 term by the ratio
ADV_EPS = 1e-4  # trl divides by std + 1e-4 (a group of equal rewards gets advantage 0)


def group_advantages(rewards: torch.Tensor, group: int, scale: str = "group") -> torch.Tensor:
    """(r - group mean) / (group std + ADV_EPS) for rewards laid out group by group (G
    consecutive completions of one prompt); `scale="none"` keeps r - mean (Dr. GRPO). The std
    is the sample std (Bessel-corrected), as trl computes it."""
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {', '.join(SCALES)}, got {scale!r}")
    if isinstance(group, bool) or not isinstance(group, int) or group < 2:
        raise ValueError(f"group must be a whole number >= 2 (GRPO compares samples of one "
                         f"prompt), got {group!r}")
    if rewards.dim() != 1 or rewards.numel() % group:
        raise ValueError(f"rewards must be a flat tensor of whole groups of {group}, got shape "
                         f"{tuple(rewards.shape)}")
    r = rewards.float().view(-1, group)
    adv = r - r.mean(1, keepdim=True)
    if scale == "group":
        adv = adv / (r.std(1, keepdim=True) + ADV_EPS)
    return adv.reshape(-1)


def clipped_token_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                       eps_low: float = TRL_GRPO_EPSILON,
                       eps_high: float = TRL_GRPO_EPSILON) -> torch.Tensor:
    """PPO's clipped surrogate per token, -min(ratio A, clip(ratio, 1-eps_low, 1+eps_high) A),
    with the sequence's advantage on each of its tokens: (B, T) from (B, T) and (B,)."""
    if logp.shape != old_logp.shape or advantages.shape != logp.shape[:1]:
        raise ValueError(f"logp {tuple(logp.shape)} and old_logp {tuple(old_logp.shape)} must "
                         f"match and advantages {tuple(advantages.shape)} have one per row")
    ratio = torch.exp(logp - old_logp)
    a = advantages[:, None]
    return -torch.min(ratio * a, ratio.clamp(1 - eps_low, 1 + eps_high) * a)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, loss: str,
              max_len: int | None = None) -> torch.Tensor:
    """One loss from per-token losses (B, T) and the completion mask (B, T): see the module
    docstring for the three kinds; "dr_grpo" divides by B * max_len (the generation budget)."""
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {', '.join(LOSSES)}, got {loss!r}")
    if per_token.shape != mask.shape:
        raise ValueError(f"per-token losses {tuple(per_token.shape)} and mask "
                         f"{tuple(mask.shape)} differ in shape")
    m = mask.to(per_token.dtype)
    if loss == "grpo":
        return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()
    if loss == "dapo":
        return (per_token * m).sum() / m.sum().clamp(min=1)
    longest = int(m.sum(-1).max())
    if max_len is None or max_len < longest:
        raise ValueError(f"dr_grpo needs max_len >= the longest completion ({longest} tokens), "
                         f"got {max_len}")
    return (per_token * m).sum() / (per_token.shape[0] * max_len)


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor | None,
              advantages: torch.Tensor, mask: torch.Tensor, loss: str = "grpo",
              beta: float = 0.0, eps_low: float = TRL_GRPO_EPSILON,
              eps_high: float = TRL_GRPO_EPSILON, max_len: int | None = None) -> torch.Tensor:
    """The whole GRPO objective on per-token log-probabilities of the completions (B, T): the
    clipped surrogate plus beta times the k3 KL estimate to the reference, aggregated by `loss`.
    (trl multiplies the KL term by the ratio, TRL_GRPO_KL_RATIO: equal values on-policy, a
    different gradient; this is DeepSeekMath's form.)"""
    per_token = clipped_token_loss(logp, old_logp, advantages, eps_low, eps_high)
    if beta:
        if ref_logp is None:
            raise ValueError("beta > 0 needs the reference model's log-probabilities")
        per_token = per_token + beta * kl.estimate(logp, ref_logp, "k3")
    return aggregate(per_token, mask, loss, max_len)


def token_weights(lengths: Sequence[int], loss: str, max_len: int | None = None,
                  advantage: float = 1.0) -> list[float]:
    """The weight a token gets in the gradient, by its completion's length: d loss / d log p of
    the first token of each completion (every token of a completion gets the same), divided by
    -advantage, from autograd through `grpo_loss` on one batch of the given lengths."""
    if not lengths or any(isinstance(n, bool) or not isinstance(n, int) or n < 1
                          for n in lengths):
        raise ValueError(f"lengths must be whole numbers >= 1, got {lengths!r}")
    if advantage == 0:
        raise ValueError("advantage 0 gives every token zero weight; use a non-zero advantage")
    T = max(lengths)
    logp = torch.zeros(len(lengths), T, requires_grad=True)
    mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).long()
    adv = torch.full((len(lengths),), float(advantage))
    grpo_loss(logp, logp.detach(), None, adv, mask, loss, max_len=max_len or T).backward()
    return (-logp.grad[:, 0] / advantage).tolist()


@dataclass(frozen=True)
class GRPOConfig:
    """GRPO settings. `prompts` groups of `group` completions per step; `loss` the aggregation;
    `scale` "group" (divide by the group's std) or "none" (Dr. GRPO); `beta` the KL coefficient;
    `updates` clipped steps per batch (mu); `dynamic_sampling` DAPO's filter (up to
    `max_draws` draws of prompts per step to fill the batch with informative groups)."""

    steps: int = 40
    prompts: int = 16
    group: int = TRL_GRPO_NUM_GENERATIONS
    loss: str = "grpo"
    scale: str = "group"
    beta: float = 0.0
    eps_low: float = TRL_GRPO_EPSILON
    eps_high: float = TRL_GRPO_EPSILON
    updates: int = 1
    dynamic_sampling: bool = False
    max_draws: int = 4
    lr: float = 1e-4
    max_grad_norm: float = 1.0  # transformers' (so trl's) default
    temperature: float = 1.0
    max_new_tokens: int = 6
    seed: int = 0

    def __post_init__(self):
        if self.loss not in LOSSES:
            raise ValueError(f"GRPOConfig.loss must be one of {', '.join(LOSSES)}, got "
                             f"{self.loss!r}")
        if self.scale not in SCALES:
            raise ValueError(f"GRPOConfig.scale must be one of {', '.join(SCALES)}, got "
                             f"{self.scale!r}")
        check_fields(self, positive=("steps", "prompts", "updates", "max_draws", "lr",
                                     "temperature", "max_new_tokens"),
                     non_negative=("beta", "eps_low", "eps_high", "seed", "max_grad_norm"))
        if isinstance(self.group, bool) or not isinstance(self.group, int) or self.group < 2:
            raise ValueError(f"GRPOConfig.group must be a whole number >= 2, got {self.group!r}")
        if self.eps_low >= 1:
            raise ValueError(f"GRPOConfig.eps_low must be below 1 (the ratio's floor is "
                             f"1 - eps_low), got {self.eps_low}")


@dataclass
class Batch:
    """One step's samples: the items (one per completion, G in a row per prompt), the rollouts,
    their rewards, and how many completions were generated to get them."""

    items: list[Problem]
    rollouts: Rollouts
    rewards: list[float]
    generated: int


def collect(model: nn.Module, tok: ChatTokenizer, items: Sequence[Problem], cfg: GRPOConfig,
            rng: random.Random, generator: torch.Generator,
            verifier: Callable[[Problem, str], float] = verify) -> Batch:
    """Draw `cfg.prompts` items, sample `cfg.group` completions of each and score them; with
    dynamic sampling, keep only groups whose rewards differ and draw again (at most
    `cfg.max_draws` times) until the batch holds `cfg.prompts` groups."""
    kept: list[tuple[Problem, list[int], list[int], str, float]] = []
    generated, G = 0, cfg.group
    for _ in range(cfg.max_draws if cfg.dynamic_sampling else 1):
        draw = [items[rng.randrange(len(items))] for _ in range(cfg.prompts)]
        rep = [p for p in draw for _ in range(G)]
        roll = sample(model, tok, encode_prompts(tok, rep), cfg.max_new_tokens,
                      cfg.temperature, generator=generator)
        r = rewards(rep, roll, verifier)
        generated += len(rep)
        for k in range(len(draw)):
            g = range(k * G, (k + 1) * G)
            if cfg.dynamic_sampling and len({r[j] for j in g}) == 1:
                continue
            kept += [(rep[j], roll.prompts[j], roll.completions[j], roll.texts[j], r[j])
                     for j in g]
        if len(kept) >= cfg.prompts * G:
            break
    if not kept:  # every group solved or failed alike: train on the last draw (advantage 0)
        kept = [(rep[j], roll.prompts[j], roll.completions[j], roll.texts[j], r[j])
                for j in range(len(rep))]
    kept = kept[:cfg.prompts * G]
    return Batch([k[0] for k in kept], Rollouts([k[1] for k in kept], [k[2] for k in kept],
                                                [k[3] for k in kept]),
                 [k[4] for k in kept], generated)


def train(model: nn.Module, tok: ChatTokenizer, items: Sequence[Problem],
          cfg: GRPOConfig = GRPOConfig(), ref: nn.Module | None = None,
          eval_items: Sequence[Problem] | None = None, eval_every: int = 0,
          verifier: Callable[[Problem, str], float] = verify) -> list[dict]:
    """Train `model` in place with GRPO on `items` (`sft.optimize`'s AdamW, constant rate, the
    gradient norm clipped at cfg.max_grad_norm); `ref` is the frozen reference (needed when
    cfg.beta > 0). Returns one row per step: mean reward, completion lengths (all, right,
    wrong), the k3 KL to the reference (when there is one), the share of tokens the clip
    stopped above and below (at the step's last update), the policy's mean entropy on its
    samples, completions generated, informative groups, and greedy pass@1 on `eval_items` before
    every `eval_every`-th step and after the last."""
    if not items:
        raise ValueError("no items to train on")
    if cfg.beta > 0 and ref is None:
        raise ValueError("GRPOConfig.beta > 0 needs a reference model (a frozen copy of the "
                         "starting policy)")
    if eval_every and not eval_items:
        raise ValueError("eval_every needs eval_items to score")
    device = next(model.parameters()).device
    rng, gen = random.Random(cfg.seed), torch.Generator().manual_seed(cfg.seed)
    history: list[dict] = []
    state: dict = {}

    def loss_at(k: int) -> torch.Tensor:
        step, update = divmod(k, cfg.updates)
        if update == 0:  # a new batch: sample with the current policy, score, advantages
            row = {"step": step}
            if eval_items and eval_every and step % eval_every == 0:
                row["pass1"] = accuracy(model, tok, eval_items, max_new_tokens=cfg.max_new_tokens)
            batch = collect(model, tok, items, cfg, rng, gen, verifier)
            ids, mask = (t.to(device) for t in batch.rollouts.sequences())
            adv = group_advantages(torch.tensor(batch.rewards), cfg.group, cfg.scale)
            with torch.no_grad():
                old = token_logprobs(model, ids)
                ref_lp = token_logprobs(ref, ids) if ref is not None else None
            state.update(ids=ids, m=mask[:, 1:], adv=adv.to(device), old=old, ref=ref_lp)
            history.append({**row, **_batch_stats(batch, cfg)})
            if ref_lp is not None:
                history[-1]["kl"] = masked_mean(kl.estimate(old, ref_lp, "k3"),
                                                state["m"]).item()
        logp, entropy, _ = logprobs_and_entropy(model, state["ids"])
        loss = grpo_loss(logp, state["old"], state["ref"], state["adv"], state["m"], cfg.loss,
                         cfg.beta, cfg.eps_low, cfg.eps_high, cfg.max_new_tokens)
        with torch.no_grad():
            m, ratio = state["m"], torch.exp(logp - state["old"])
            a = state["adv"][:, None]
            history[-1].update(
                loss=loss.item(), entropy=masked_mean(entropy, m).item(),
                clip_high=masked_mean(((ratio > 1 + cfg.eps_high) & (a > 0)).float(), m).item(),
                clip_low=masked_mean(((ratio < 1 - cfg.eps_low) & (a < 0)).float(), m).item())
        return loss

    optimize(model, SFTConfig(steps=cfg.steps * cfg.updates, batch_size=cfg.prompts, lr=cfg.lr,
                              warmup_steps=0, seed=cfg.seed, max_grad_norm=cfg.max_grad_norm),
             loss_at)
    if eval_items:
        history[-1]["pass1_after"] = accuracy(model, tok, eval_items,
                                              max_new_tokens=cfg.max_new_tokens)
    return history


def _batch_stats(batch: Batch, cfg: GRPOConfig) -> dict:
    lengths = [len(c) for c in batch.rollouts.completions]
    right = [n for n, x in zip(lengths, batch.rewards) if x == 1.0]
    wrong = [n for n, x in zip(lengths, batch.rewards) if x != 1.0]
    return {"reward": sum(batch.rewards) / len(batch.rewards),
            "length": sum(lengths) / len(lengths),
            "length_right": sum(right) / len(right) if right else float("nan"),
            "length_wrong": sum(wrong) / len(wrong) if wrong else float("nan"),
            "generated": batch.generated, "groups": len(batch.rewards) // cfg.group}
