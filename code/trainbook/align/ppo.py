"""RLHF with PPO from scratch: four models, a KL-penalised reward, GAE and the clipped objective.

The pieces, as in InstructGPT (Ouyang et al. 2022) and the implementations it grew from
(Ziegler et al. 2019; Stiennon et al. 2020; Huang et al. 2024, "The N+ implementation details
of RLHF with PPO"):

- the **policy** (the SFT model, trained), the **reference** (a frozen copy of it), the
  **reward model** (frozen, `align.reward`) and the **value model** (a copy of the reward
  model whose head is read at every position: `RewardModel.token_scores`);
- **rewards per token**: every generated token pays -beta * KL_t, the KL estimate of that token
  (`kl.estimate`, k1 by default, as those implementations do), and the last one also gets the
  reward model's score of the whole sequence;
- **GAE** (Schulman et al. 2016): advantages A_t = sum_l (gamma lambda)^l delta_{t+l}, with
  delta_t = r_t + gamma V_{t+1} - V_t and V = 0 after the last token, computed backwards
  (`gae`), and returns A_t + V_t as the value target;
- **whitening** (`masked_whiten`): advantages normalised to mean 0 and unit variance over the
  batch's tokens; optionally the rewards scaled to unit variance first (`whiten_rewards`);
- the **clipped surrogate** (Schulman et al. 2017, Eq. 7) on the ratio pi/pi_old of each
  token, and a **clipped value loss**, over several epochs of minibatches of one rollout batch;
- **metrics**: the KL to the reference per sequence by k1, by k3 and exactly (from the logits),
  the clip fraction, the approximate KL between consecutive policies (the k2 form trl used),
  the policy's entropy and the value model's explained variance.

`run` alternates rollouts (`policy.sample`) and updates and records every round's metrics
together with the task's own reward on the rollouts (the verifier and `graded_reward`), which
training never sees.

Chapter: book/alignment/ppo
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from . import kl as KL
from .policy import logits_of, sample
from .preferences import graded_reward
from .reward import RewardModel
from .task import EOS, ChatTokenizer, Problem, check_fields, encode_prompts, verify

WHITEN_EPS = 1e-8  # trl's masked_whiten: (x - mean) * rsqrt(var + 1e-8), var unbiased


@dataclass(frozen=True)
class PPOConfig:
    """PPO settings (defaults: tens of seconds on a CPU for the book's model)."""

    rounds: int = 30  # rollout-then-update rounds
    batch_size: int = 64  # prompts per round, one completion each
    ppo_epochs: int = 4  # passes over each round's batch
    minibatch_size: int = 32
    lr: float = 3e-5  # the policy's
    value_lr: float = 3e-4  # the value model's (OpenRLHF's critic_learning_rate is separate too)
    kl_coef: float = 0.05  # beta
    kl_estimator: str = "k1"  # the penalty in the reward: k1, k2 or k3
    gamma: float = 1.0
    lam: float = 0.95
    clip: float = 0.2  # epsilon of the clipped surrogate; inf: no clipping
    clip_value: float = 0.2  # inf: no value clipping
    vf_coef: float = 0.1
    whiten_rewards: bool = False
    whiten_advantages: bool = True
    max_grad_norm: float = 1.0  # inf: no clipping
    temperature: float = 1.0
    max_new_tokens: int = 6
    missing_eos_penalty: float = 0.0  # subtracted from the score of a completion without <|eos|>
    seed: int = 0

    def __post_init__(self):
        check_fields(self, positive=("rounds", "batch_size", "ppo_epochs", "minibatch_size", "lr",
                                     "value_lr",
                                     "clip", "clip_value", "max_grad_norm", "temperature",
                                     "max_new_tokens"),
                     non_negative=("kl_coef", "gamma", "lam", "vf_coef", "missing_eos_penalty",
                                   "seed"))
        if self.kl_estimator not in KL.ESTIMATORS:
            raise ValueError(f"PPOConfig.kl_estimator must be one of {', '.join(KL.ESTIMATORS)},"
                             f" got {self.kl_estimator!r}")
        if self.gamma > 1 or self.lam > 1:
            raise ValueError(f"PPOConfig.gamma and lam must be in [0, 1], got {self.gamma} and "
                             f"{self.lam}")
        if self.minibatch_size > self.batch_size:
            raise ValueError(f"PPOConfig.minibatch_size {self.minibatch_size} is larger than "
                             f"batch_size {self.batch_size}")

    def with_(self, **changes: object) -> PPOConfig:
        unknown = set(changes) - {f.name for f in fields(self)}
        if unknown:
            raise ValueError(f"PPOConfig has no field {sorted(unknown)[0]!r}")
        return PPOConfig(**{**{f.name: getattr(self, f.name) for f in fields(self)}, **changes})


# ---- the pieces -------------------------------------------------------------------------------

def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum()


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(x - mean) / std over the tokens where mask is 1 (unbiased variance, as trl); with
    shift_mean False the mean is added back (scale only). Masked positions come out 0."""
    if x.shape != mask.shape:
        raise ValueError(f"x shape {tuple(x.shape)} differs from mask {tuple(mask.shape)}")
    n = mask.sum()
    if n < 2:
        raise ValueError("masked_whiten needs at least two unmasked values")
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask) * n / (n - 1)
    out = (x - mean) * torch.rsqrt(var + WHITEN_EPS)
    return (out if shift_mean else out + mean) * mask


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimates and returns (both (B, T)) of per-action rewards and
    values where mask marks each row's actions (one contiguous run); the value after a row's
    last action is 0 (the episode ends)."""
    if not rewards.shape == values.shape == mask.shape or rewards.dim() != 2:
        raise ValueError(f"rewards {tuple(rewards.shape)}, values {tuple(values.shape)} and mask "
                         f"{tuple(mask.shape)} must be one (batch, time) shape")
    if not (0 <= gamma <= 1 and 0 <= lam <= 1):
        raise ValueError(f"gamma and lam must be in [0, 1], got {gamma} and {lam}")
    mask = mask.to(rewards.dtype)
    values = values * mask
    adv = torch.zeros_like(rewards)
    last = torch.zeros_like(rewards[:, 0])
    T = rewards.shape[1]
    for t in reversed(range(T)):
        nxt_mask = mask[:, t + 1] if t + 1 < T else torch.zeros_like(last)
        nxt_value = values[:, t + 1] if t + 1 < T else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * nxt_value - values[:, t]
        last = (delta + gamma * lam * nxt_mask * last) * mask[:, t]
        adv[:, t] = last
    return adv, (adv + values) * mask


def logprobs_and_entropy(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """log p of each next token and the entropy of each next-token distribution: (B, T-1) each,
    plus the logits (B, T-1, V)."""
    logits = logits_of(model, ids)[:, :-1]
    logp_all = F.log_softmax(logits, -1)
    logp = logp_all.gather(2, ids[:, 1:, None]).squeeze(2)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy, logits


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor,
                mask: torch.Tensor, clip: float) -> tuple[torch.Tensor, dict]:
    """The clipped surrogate, -min(ratio A, clip(ratio, 1-eps, 1+eps) A), token mean; with the
    clip fraction and the approximate KL between the new and old policy (0.5 mean log-ratio^2)."""
    logratio = logp - old_logp
    ratio = logratio.exp()
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1 - clip, 1 + clip)
    loss = masked_mean(torch.maximum(loss1, loss2), mask)
    with torch.no_grad():
        stats = {"clipfrac": masked_mean((loss2 > loss1).float(), mask).item(),
                 "approx_kl": masked_mean(0.5 * logratio ** 2, mask).item(),
                 "ratio_max": ratio[mask.bool()].max().item()}
    return loss, stats


def value_loss(v: torch.Tensor, old_v: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float) -> tuple[torch.Tensor, dict]:
    """0.5 max((V - R)^2, (V_clipped - R)^2), token mean, V_clipped = V_old + clip(V - V_old)."""
    v_clipped = old_v + (v - old_v).clamp(-clip, clip)
    loss1, loss2 = (v - returns) ** 2, (v_clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(loss1, loss2), mask)
    with torch.no_grad():
        stats = {"vf_clipfrac": masked_mean((loss2 > loss1).float(), mask).item()}
    return loss, stats


def explained_variance(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(target - pred) / Var(target) over the masked tokens: 1 perfect, 0 no better than
    the mean, negative worse."""
    m = mask.bool()
    y, p = target[m], pred[m]
    var = y.var()
    return float("nan") if var == 0 else (1 - (y - p).var() / var).item()


# ---- one round --------------------------------------------------------------------------------

@dataclass
class Batch:
    """One round's rollouts and everything computed from them before the update."""

    ids: torch.Tensor  # (B, T) prompt + completion, right-padded
    mask: torch.Tensor  # (B, T-1) 1 on the actions (predicted completion tokens)
    old_logp: torch.Tensor
    ref_logp: torch.Tensor
    old_values: torch.Tensor
    scores: torch.Tensor  # (B,) reward model
    rewards: torch.Tensor  # (B, T-1) per action
    advantages: torch.Tensor
    returns: torch.Tensor
    stats: dict


Reward = RewardModel | Callable[[Problem, str], float]


@torch.no_grad()
def make_batch(policy: nn.Module, ref: nn.Module, rm: Reward, value: RewardModel,
               tok: ChatTokenizer, items: Sequence[Problem], cfg: PPOConfig,
               generator: torch.Generator) -> Batch:
    """Sample one completion per item and compute log-probs, KL, rewards and advantages. The
    score is the reward model's, or `rm(item, text)` for a reward function (0 without eos)."""
    device = next(policy.parameters()).device
    roll = sample(policy, tok, encode_prompts(tok, items), cfg.max_new_tokens, cfg.temperature,
                  generator=generator)
    ids, cmask = roll.sequences()
    ids, mask = ids.to(device), cmask[:, 1:].to(device).float()
    logp, entropy, logits = logprobs_and_entropy(policy, ids)
    ref_logp, _, ref_logits = logprobs_and_entropy(ref, ids)
    old_values = value.token_scores(ids)[:, :-1] * mask
    ended = torch.tensor([c[-1:] == [EOS] for c in roll.completions], device=device)
    if isinstance(rm, RewardModel):
        scores = rm(ids)
    else:
        scores = torch.tensor([rm(p, t) if e else 0.0 for p, t, e in
                               zip(items, roll.texts, ended.tolist())], device=device)
    scores = scores - cfg.missing_eos_penalty * (~ended).float()
    per_token_kl = KL.estimate(logp, ref_logp, cfg.kl_estimator) * mask
    rewards = -cfg.kl_coef * per_token_kl
    last = mask.shape[1] - 1 - mask.flip(1).argmax(1)  # each row's last action
    rewards[torch.arange(len(items), device=device), last] += scores
    if cfg.whiten_rewards:
        rewards = masked_whiten(rewards, mask, shift_mean=False)
    adv, returns = gae(rewards, old_values, mask, cfg.gamma, cfg.lam)
    if cfg.whiten_advantages:
        adv = masked_whiten(adv, mask)
    seq = {k: (KL.estimate(logp, ref_logp, k) * mask).sum(1) for k in ("k1", "k3")}
    exact = (KL.exact(logits, ref_logits) * mask).sum(1)
    gold = [graded_reward(p, t) if e else 0.0 for p, t, e in zip(items, roll.texts, ended)]
    right = [verify(p, t) if e else 0.0 for p, t, e in zip(items, roll.texts, ended)]
    stats = {"score": scores.mean().item(), "gold": sum(gold) / len(gold),
             "accuracy": sum(right) / len(right), "kl_k1": seq["k1"].mean().item(),
             "kl_k3": seq["k3"].mean().item(), "kl_exact": exact.mean().item(),
             "kl_k1_std": seq["k1"].std().item(), "kl_k3_std": seq["k3"].std().item(),
             "entropy": masked_mean(entropy, mask).item(),
             "eos_rate": ended.float().mean().item(),
             "length": mask.sum(1).mean().item(),
             "explained_variance": explained_variance(old_values, returns, mask)}
    return Batch(ids, mask, logp, ref_logp, old_values, scores, rewards, adv, returns, stats)


def update(policy: nn.Module, value: RewardModel, opt: torch.optim.Optimizer, batch: Batch,
           cfg: PPOConfig, generator: torch.Generator) -> dict:
    """ppo_epochs passes of shuffled minibatches over the batch (the policy's and the value
    model's gradient norms clipped separately: they are separate models); returns the mean
    statistics (the largest ratio_max)."""
    policy_params, value_params = (g["params"] for g in opt.param_groups)
    sums: dict[str, float] = {}
    steps = 0
    B = batch.ids.shape[0]
    for _ in range(cfg.ppo_epochs):
        order = torch.randperm(B, generator=generator)
        for start in range(0, B, cfg.minibatch_size):
            i = order[start:start + cfg.minibatch_size].to(batch.ids.device)
            ids, mask = batch.ids[i], batch.mask[i]
            logp, _, _ = logprobs_and_entropy(policy, ids)
            pg, pg_stats = policy_loss(logp, batch.old_logp[i], batch.advantages[i], mask,
                                       cfg.clip)
            v = value.token_scores(ids)[:, :-1]
            vf, vf_stats = value_loss(v, batch.old_values[i], batch.returns[i], mask,
                                      cfg.clip_value)
            loss = pg + cfg.vf_coef * vf
            opt.zero_grad(set_to_none=True)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(policy_params, cfg.max_grad_norm)
            vf_norm = torch.nn.utils.clip_grad_norm_(value_params, cfg.max_grad_norm)
            opt.step()
            for k, val in {"pg_loss": pg.item(), "vf_loss": vf.item(), "grad_norm": norm.item(),
                           "vf_grad_norm": vf_norm.item(), **pg_stats, **vf_stats}.items():
                sums[k] = max(sums.get(k, val), val) if k == "ratio_max" else \
                    sums.get(k, 0.0) + val
            steps += 1
    return {k: (v if k == "ratio_max" else v / steps) for k, v in sums.items()}


# ---- the loop ---------------------------------------------------------------------------------

@dataclass
class PPORun:
    """The trained policy and value model, and one dict of metrics per round (rollout metrics
    are of the rollouts sampled before that round's update)."""

    policy: nn.Module
    value: RewardModel
    history: list[dict]

    def series(self, key: str) -> list[float]:
        return [h[key] for h in self.history]


def run(policy: nn.Module, rm: Reward, tok: ChatTokenizer, items: Sequence[Problem],
        cfg: PPOConfig = PPOConfig(), value: RewardModel | None = None,
        callback: Callable[[int, dict], None] | None = None) -> PPORun:
    """PPO on `items` against the reward model `rm` (or a reward function of (item, text), such
    as the verifier). The reference is a frozen copy of `policy` as given; the value model
    starts as a copy of `rm` (of the policy with a new head, for a function) unless one is
    given; `policy` is trained in place. `callback(round, metrics)` is called after every
    round (a progress bar)."""
    if isinstance(rm, nn.Module) and not isinstance(rm, RewardModel) or not callable(rm):
        raise ValueError(f"rm must be a RewardModel or a function (item, text) -> reward, got "
                         f"{type(rm).__name__}")
    if value is not None and not isinstance(value, RewardModel):
        raise ValueError(f"value must be a RewardModel, got {type(value).__name__}")
    if len(items) < cfg.batch_size:
        raise ValueError(f"{len(items)} training items are fewer than batch_size "
                         f"{cfg.batch_size}; give more items or a smaller batch")
    ref = copy.deepcopy(policy).eval().requires_grad_(False)
    if isinstance(rm, RewardModel):
        rm = rm.eval().requires_grad_(False)
    if value is None:
        value = copy.deepcopy(rm) if isinstance(rm, RewardModel) else \
            RewardModel(policy, seed=cfg.seed)
        value.requires_grad_(True)
    value.train()
    opt = torch.optim.Adam([{"params": list(policy.parameters()), "lr": cfg.lr},
                            {"params": list(value.parameters()), "lr": cfg.value_lr}], eps=1e-5)
    g_sample = torch.Generator().manual_seed(cfg.seed)
    g_order = torch.Generator().manual_seed(cfg.seed + 1)
    history = []
    for r in range(cfg.rounds):
        pick = torch.randint(len(items), (cfg.batch_size,), generator=g_order).tolist()
        batch = make_batch(policy, ref, rm, value, tok, [items[i] for i in pick], cfg, g_sample)
        policy.train()
        stats = {"round": r, **batch.stats, **update(policy, value, opt, batch, cfg, g_order)}
        policy.eval()
        stats["diverged"] = not all(torch.isfinite(p).all() for p in policy.parameters())
        history.append(stats)
        if callback is not None:
            callback(r, stats)
        if stats["diverged"]:  # NaN weights cannot sample: the run ends here
            break
    return PPORun(policy.eval(), value.eval(), history)
