"""Direct preference optimisation (DPO) and two relatives, IPO and SimPO, from scratch.

Rafailov et al. (2023) start from the RLHF objective, maximise E[r] - beta KL(pi || pi_ref), whose
optimum is pi*(y|x) = pi_ref(y|x) exp(r(x, y) / beta) / Z(x). Solved for the reward,
r(x, y) = beta log(pi*(y|x) / pi_ref(y|x)) + beta log Z(x); put into the Bradley-Terry model
P(y_w > y_l | x) = sigmoid(r(x, y_w) - r(x, y_l)), Z(x) cancels, and the negative log-likelihood
of the preferences is a loss on the policy alone (their eq. 7):

    L = -log sigmoid(beta * ((log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l))))

with sequence log-probabilities summed over the completion's tokens
(`policy.sequence_logprobs`). `beta * (log pi - log pi_ref)` is the implicit reward of a
response; its difference between chosen and rejected is the margin. The loss only sees the
margin: nothing stops both log-probabilities from falling, as long as the rejected one falls
faster, and on pairs whose chosen response is already likely that is what happens.

IPO (Azar et al. 2023) replaces the log-sigmoid by a squared distance to a target margin
1 / (2 tau), so the margin stops growing there; trl divides each log-ratio by the response's
token count first (a choice it documents and attributes to the IPO authors), and so does
`ipo_loss`. SimPO (Meng et al. 2024) drops the reference model: the reward is the policy's mean
token log-probability times beta, and the loss asks for a margin of at least gamma.

Preference pairs come from the task (`preference_pairs`): several samples of the policy per
prompt, labelled by the verifier; a right completion (`rewards`: verified and ended with
`<|eos|>`, as `policy.accuracy` scores) is chosen against a wrong one. A batch holds the chosen
sequences first, then the rejected ones, as trl's collator builds it.

Chapter: book/alignment/dpo
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .policy import Rollouts, pad, sample, token_logprobs
from .preferences import Pair
from .sft import SFTConfig, draws, optimize
from .task import EOS, ChatTokenizer, Problem, check_fields, encode_prompts, verify

LOSSES = ("sigmoid", "ipo", "simpo")
# trl's defaults this chapter relies on (tests assert them against the installed trl)
TRL_DPO_BETA = 0.1  # DPOConfig.beta
TRL_DPO_LOSS = ["sigmoid"]  # DPOConfig.loss_type: the DPO paper's loss
TRL_DPO_LABEL_SMOOTHING = 0.0  # DPOConfig.label_smoothing: no label noise assumed
TRL_DPO_LR = 1e-6  # DPOConfig.learning_rate (transformers' default is 5e-5)
TRL_SIMPO_GAMMA = 0.5  # CPOConfig.simpo_gamma (SimPO lives in trl's experimental CPOTrainer)
TRL_CPO_ALPHA = 1.0  # CPOConfig.cpo_alpha: an NLL term SimPO must switch off (0)


def rewards(items: Sequence[Problem], rollouts: Rollouts,
            verifier: Callable[[Problem, str], float] = verify) -> list[float]:
    """The rule-based reward of each completion: the verifier's score if the completion ended
    with `<|eos|>` (a chat model must stop), else 0 (`policy.accuracy` scores the same way)."""
    if len(items) != len(rollouts.completions):
        raise ValueError(f"{len(items)} items for {len(rollouts.completions)} completions; give "
                         "one item per completion")
    return [verifier(p, t) if c[-1:] == [EOS] else 0.0
            for p, c, t in zip(items, rollouts.completions, rollouts.texts)]


def pair_batch(tok: ChatTokenizer, pairs: Sequence[Pair]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, completion mask) of the pairs in the chat format, right-padded: the chosen
    exchanges in rows 0..B-1, the rejected ones in rows B..2B-1 (trl's layout); the mask is 1 on
    each response and its `<|eos|>`."""
    if not pairs:
        raise ValueError("no preference pairs; sample more prompts or samples per prompt "
                         "(preference_pairs)")
    rows = [tok.chat_ids(p.prompt, p.chosen) for p in pairs] + \
        [tok.chat_ids(p.prompt, p.rejected) for p in pairs]
    return pad([r[0] for r in rows], [r[1] for r in rows])


def preference_pairs(model: nn.Module, tok: ChatTokenizer, items: Sequence[Problem],
                     samples: int = 4, temperature: float = 1.0,
                     max_new_tokens: int | None = None, seed: int = 0) -> tuple[list[Pair], int]:
    """Sample `samples` completions of each item's prompt; where some are right and some wrong,
    pair the first right one (chosen) with the first wrong one (rejected), margin 1. Prompts the
    policy gets all right or all wrong give no pair. Returns the pairs and the number of
    completions generated (the budget a comparison with RL counts)."""
    if not items:
        raise ValueError("no items to make pairs from")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 2:
        raise ValueError(f"samples must be a whole number >= 2 (a pair needs two), got {samples!r}")
    budget = max_new_tokens or max(len(p.answer) for p in items) + 2
    repeated = [p for p in items for _ in range(samples)]
    roll = sample(model, tok, encode_prompts(tok, repeated), budget, temperature,
                  generator=torch.Generator().manual_seed(seed))
    r = rewards(repeated, roll)
    out = []
    for i, item in enumerate(items):
        group = range(i * samples, (i + 1) * samples)
        right = [j for j in group if r[j] == 1.0]
        wrong = [j for j in group if r[j] == 0.0]
        if right and wrong:
            out.append(Pair(item.prompt, roll.texts[right[0]], roll.texts[wrong[0]], 1.0))
    return out, len(repeated)


def pair_logprobs(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> dict:
    """Summed completion log-probabilities of a pair batch (`pair_batch`) under `model`, split
    into chosen and rejected, with the completions' token counts."""
    if ids.shape[0] % 2:
        raise ValueError(f"a pair batch has an even number of rows (chosen, then rejected), got "
                         f"{ids.shape[0]}")
    m = mask[:, 1:].to(torch.float32)
    logp = (token_logprobs(model, ids) * m).sum(-1)
    chosen, rejected = logp.chunk(2)
    n_chosen, n_rejected = m.sum(-1).chunk(2)
    return {"chosen": chosen, "rejected": rejected, "n_chosen": n_chosen,
            "n_rejected": n_rejected}


def dpo_loss(pi_chosen: torch.Tensor, pi_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float = TRL_DPO_BETA) -> torch.Tensor:
    """Per-pair DPO loss (Rafailov et al. 2023, eq. 7) from summed sequence log-probabilities."""
    _check_positive("beta", beta)
    margin = (pi_chosen - ref_chosen) - (pi_rejected - ref_rejected)
    return -F.logsigmoid(beta * margin)


def ipo_loss(pi_chosen: torch.Tensor, pi_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, n_chosen: torch.Tensor, n_rejected: torch.Tensor,
             tau: float = TRL_DPO_BETA) -> torch.Tensor:
    """Per-pair IPO loss (Azar et al. 2023, eq. 17) on per-token log-ratios, as trl computes it:
    (h - 1 / (2 tau))**2 with h the difference of the two mean token log-ratios."""
    _check_positive("tau", tau)
    h = (pi_chosen - ref_chosen) / n_chosen.clamp(min=1) - \
        (pi_rejected - ref_rejected) / n_rejected.clamp(min=1)
    return (h - 1 / (2 * tau)) ** 2


def simpo_loss(pi_chosen: torch.Tensor, pi_rejected: torch.Tensor, n_chosen: torch.Tensor,
               n_rejected: torch.Tensor, beta: float = 2.0,
               gamma: float = TRL_SIMPO_GAMMA) -> torch.Tensor:
    """Per-pair SimPO loss (Meng et al. 2024): no reference model; the reward is beta times the
    mean token log-probability, and the chosen one must lead by the margin gamma."""
    _check_positive("beta", beta)
    if not gamma >= 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    delta = pi_chosen / n_chosen.clamp(min=1) - pi_rejected / n_rejected.clamp(min=1)
    return -F.logsigmoid(beta * delta - gamma)


def implicit_rewards(pi: torch.Tensor, ref: torch.Tensor, beta: float) -> torch.Tensor:
    """DPO's implicit reward of each response: beta * (log pi - log pi_ref)."""
    return beta * (pi - ref)


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or \
            math.isinf(value):
        raise ValueError(f"{name} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class DPOConfig:
    """Preference-optimisation settings. `loss` picks DPO ("sigmoid", trl's name), IPO or SimPO;
    `beta` is DPO's beta, IPO's tau and SimPO's beta; `gamma` is SimPO's margin."""

    loss: str = "sigmoid"
    beta: float = TRL_DPO_BETA
    gamma: float = TRL_SIMPO_GAMMA
    steps: int = 100
    batch_size: int = 32
    lr: float = 1e-4
    warmup_steps: int = 5
    seed: int = 0

    def __post_init__(self):
        if self.loss not in LOSSES:
            raise ValueError(f"DPOConfig.loss must be one of {', '.join(LOSSES)}, got "
                             f"{self.loss!r}")
        check_fields(self, positive=("beta", "steps", "batch_size", "lr"),
                     non_negative=("gamma", "warmup_steps", "seed"))


def preference_loss(cfg: DPOConfig, pi: dict, ref: dict | None) -> torch.Tensor:
    """The mean loss of `cfg.loss` over a batch, from `pair_logprobs` of the policy and (not for
    SimPO) of the reference."""
    if cfg.loss == "simpo":
        return simpo_loss(pi["chosen"], pi["rejected"], pi["n_chosen"], pi["n_rejected"],
                          cfg.beta, cfg.gamma).mean()
    if ref is None:
        raise ValueError(f"the {cfg.loss} loss needs the reference model's log-probabilities")
    if cfg.loss == "ipo":
        return ipo_loss(pi["chosen"], pi["rejected"], ref["chosen"], ref["rejected"],
                        pi["n_chosen"], pi["n_rejected"], cfg.beta).mean()
    return dpo_loss(pi["chosen"], pi["rejected"], ref["chosen"], ref["rejected"],
                    cfg.beta).mean()


def train(model: nn.Module, ref: nn.Module | None, tok: ChatTokenizer, pairs: Sequence[Pair],
          cfg: DPOConfig = DPOConfig(),
          on_step: Callable[[int], None] | None = None) -> list[dict]:
    """Optimise `model` in place on the pairs with `sft.optimize` (AdamW, linear warmup, constant
    rate; batches drawn with replacement by `sft.draws`); `ref` is frozen (unused by SimPO).
    Returns one row per step: the loss, the batch's mean chosen and rejected log-probabilities
    under the policy, their implicit rewards (beta times the log-ratio; SimPO's: beta times the
    mean token log-probability), the mean reward margin and the share of pairs whose chosen
    reward is higher. `on_step(k)` is called before step k and after the last (k = steps), with
    the model as trained so far (to track held-out numbers)."""
    if not pairs:
        raise ValueError("no preference pairs to train on; sample more prompts or samples per "
                         "prompt (preference_pairs)")
    if ref is None and cfg.loss != "simpo":
        raise ValueError(f"the {cfg.loss} loss needs a reference model (a frozen copy of the "
                         "starting policy)")
    device = next(model.parameters()).device
    opt_cfg = SFTConfig(steps=cfg.steps, batch_size=cfg.batch_size, lr=cfg.lr,
                        warmup_steps=cfg.warmup_steps, seed=cfg.seed)
    batches = draws(len(pairs), opt_cfg)
    if ref is not None:
        ref.eval()
    history: list[dict] = []

    def loss_at(step: int) -> torch.Tensor:
        if on_step is not None:
            on_step(step)
        ids, mask = (t.to(device) for t in pair_batch(tok, [pairs[i] for i in batches[step]]))
        pi = pair_logprobs(model, ids, mask)
        ref_lp = None
        if ref is not None and cfg.loss != "simpo":
            with torch.no_grad():
                ref_lp = pair_logprobs(ref, ids, mask)
        loss = preference_loss(cfg, pi, ref_lp)
        history.append(_row(step, loss, pi, ref_lp, cfg))
        return loss

    optimize(model, opt_cfg, loss_at)
    if on_step is not None:
        on_step(cfg.steps)
    return history


@torch.no_grad()
def _row(step: int, loss: torch.Tensor, pi: dict, ref: dict | None, cfg: DPOConfig) -> dict:
    if ref is None:  # SimPO: its reward is the length-normalised log-probability
        rc = cfg.beta * pi["chosen"] / pi["n_chosen"]
        rr = cfg.beta * pi["rejected"] / pi["n_rejected"]
    else:
        rc = implicit_rewards(pi["chosen"], ref["chosen"], cfg.beta)
        rr = implicit_rewards(pi["rejected"], ref["rejected"], cfg.beta)
    return {"step": step, "loss": loss.item(), "logp_chosen": pi["chosen"].mean().item(),
            "logp_rejected": pi["rejected"].mean().item(), "reward_chosen": rc.mean().item(),
            "reward_rejected": rr.mean().item(), "margin": (rc - rr).mean().item(),
            "reward_accuracy": (rc > rr).float().mean().item()}


@torch.no_grad()
def evaluate_pairs(model: nn.Module, ref: nn.Module, tok: ChatTokenizer, pairs: Sequence[Pair],
                   beta: float) -> dict:
    """On all pairs at once: mean chosen and rejected log-probabilities under `model` and under
    `ref`, and the mean implicit-reward margin. For tracking a fixed set over training."""
    ids, mask = pair_batch(tok, pairs)
    device = next(model.parameters()).device
    pi = pair_logprobs(model, ids.to(device), mask.to(device))
    rf = pair_logprobs(ref, ids.to(device), mask.to(device))
    margin = implicit_rewards(pi["chosen"], rf["chosen"], beta) - \
        implicit_rewards(pi["rejected"], rf["rejected"], beta)
    return {"logp_chosen": pi["chosen"].mean().item(),
            "logp_rejected": pi["rejected"].mean().item(),
            "ref_logp_chosen": rf["chosen"].mean().item(),
            "ref_logp_rejected": rf["rejected"].mean().item(),
            "margin": margin.mean().item()}
