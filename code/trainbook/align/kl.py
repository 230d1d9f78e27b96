"""KL divergence between a policy and its reference, estimated from the policy's own samples.

RLHF keeps the policy pi near a frozen reference pi_ref by penalising KL(pi || pi_ref). The
exact KL sums over the whole vocabulary at every position; what a trainer has in hand is the
log-probability of the token it sampled, under both models. With x ~ pi and the log-ratio
`log_r = log pi_ref(x) - log pi(x)`, Schulman (2020, "Approximating KL divergence") gives three
per-sample estimators of KL(pi || pi_ref):

- k1 = -log_r: unbiased, high variance, and negative on many samples;
- k2 = log_r**2 / 2: biased (its mean is close to the KL when the two are close), always >= 0,
  low variance;
- k3 = (exp(log_r) - 1) - log_r: unbiased (E[r] = 1 under x ~ pi) and always >= 0 (exp(y) >= 1+y),
  low variance when the two are close. GRPO (Shao et al. 2024) adds it to the loss; trl's
  GRPOTrainer computes this form.

`estimate` takes per-token log-probabilities of the policy and of the reference (any shape) and
returns the per-token estimate; `exact` is the true per-position KL from full logits, which the
tests and the PPO chapter check the estimators against (mean over samples -> exact).

Chapter: book/alignment/ppo
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ESTIMATORS = ("k1", "k2", "k3")


def estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the log-probabilities of tokens sampled from pi:
    `logp` under pi, `ref_logp` under pi_ref (same shape). Differentiable in both."""
    if kind not in ESTIMATORS:
        raise ValueError(f"kind must be one of {', '.join(ESTIMATORS)}, got {kind!r}")
    if not isinstance(logp, torch.Tensor) or not isinstance(ref_logp, torch.Tensor):
        raise ValueError("logp and ref_logp must be tensors of log-probabilities")
    if logp.shape != ref_logp.shape:
        raise ValueError(f"logp shape {tuple(logp.shape)} differs from ref_logp "
                         f"{tuple(ref_logp.shape)}; pass the same tokens' log-probabilities")
    log_r = ref_logp - logp
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * log_r ** 2
    return torch.expm1(log_r) - log_r


def exact(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """The exact KL(pi || pi_ref) at every position, summed over the vocabulary: logits of shape
    (..., vocab) -> (...)."""
    if logits.shape != ref_logits.shape:
        raise ValueError(f"logits shape {tuple(logits.shape)} differs from ref_logits "
                         f"{tuple(ref_logits.shape)}")
    logp, ref = F.log_softmax(logits.float(), -1), F.log_softmax(ref_logits.float(), -1)
    return (logp.exp() * (logp - ref)).sum(-1)
