"""The gradient noise scale (McCandlish et al. 2018), measured on the reference model.

B_simple = tr(Sigma) / |G|^2, where G is the true gradient and Sigma the per-example covariance
of the gradient: the batch size at which the noise in a batch's gradient is as large as the
gradient itself. The paper's Appendix A.1 estimates it without per-example gradients from the
squared norms of gradients at two batch sizes, B_small and B_big (in data parallelism: one
rank's gradient and the all-reduced one), since E|G_B|^2 = |G|^2 + tr(Sigma) / B:

    |G|^2    ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big)

Both are unbiased; their ratio is not, so the paper averages each over many steps before
dividing. `simple_noise_scale` is the estimator, `per_example` the direct estimate from
per-example gradients (torch.var), `measure` one two-batch measurement on a model and
`during_training` the noise scale at several points of a short run.

Chapter: book/pretraining/initialisation.
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
import torch

from .. import configs
from ..model import Transformer
from .init_scale import batches, build_model, short_run


def simple_noise_scale(small_sq: float, big_sq: float, b_small: int, b_big: int
                       ) -> tuple[float, float, float]:
    """(|G|^2, tr(Sigma), B_simple) from the mean squared gradient norm at batch size b_small
    and the squared norm at b_big (McCandlish et al. 2018, Appendix A.1). B_simple is in the
    units of the batch sizes (sequences here)."""
    if not 1 <= b_small < b_big:
        raise ValueError(f"need 1 <= b_small < b_big, got b_small={b_small}, b_big={b_big}")
    if small_sq < 0 or big_sq < 0:
        raise ValueError(f"squared norms must be >= 0, got {small_sq}, {big_sq}")
    g2 = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
    trace = (small_sq - big_sq) / (1 / b_small - 1 / b_big)
    return g2, trace, trace / g2


def per_example(grads: torch.Tensor) -> tuple[float, float, float]:
    """(|G|^2, tr(Sigma), B_simple) from n per-example gradients (rows of `grads`): tr(Sigma)
    as the sum of the unbiased per-coordinate variances, |G|^2 as |mean|^2 - tr(Sigma) / n
    (the mean's own noise removed)."""
    if grads.dim() != 2 or grads.shape[0] < 2:
        raise ValueError(f"need an (n >= 2, parameters) tensor, got shape {tuple(grads.shape)}")
    g = grads.double()
    trace = float(g.var(dim=0, unbiased=True).sum())
    g2 = float(g.mean(dim=0).pow(2).sum()) - trace / len(g)
    return g2, trace, trace / g2


def flat_grad(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter's gradient in one fp32 vector (zeros where a parameter has none)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                      for p in model.parameters()])


def batch_grads(model: Transformer, blocks: torch.Tensor, b_small: int, n_small: int,
                seed: int = 0) -> torch.Tensor:
    """The mean-loss gradients of `n_small` independent batches of `b_small` sequences, one
    row each; the model's own gradients are left as they were."""
    if b_small < 1 or n_small < 2:
        raise ValueError(f"need b_small >= 1 and n_small >= 2, got {b_small}, {n_small}")
    device = next(model.parameters()).device
    saved = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    data, rows = batches(blocks, b_small, seed), []
    for _ in range(n_small):
        model.zero_grad(set_to_none=True)
        x, y = (t.to(device) for t in next(data))
        _, loss = model(x, y)
        loss.backward()
        rows.append(flat_grad(model))
    for p, g in zip(model.parameters(), saved):
        p.grad = g
    return torch.stack(rows)


def measure(model: Transformer, blocks: torch.Tensor, b_small: int = 4, n_small: int = 16,
            seed: int = 0) -> dict[str, float]:
    """One two-batch measurement: |G_small|^2 averaged over n_small batches of b_small, and
    |G_big|^2 of their mean (the gradient of all b_small * n_small sequences together)."""
    g = batch_grads(model, blocks, b_small, n_small, seed)
    small_sq = float(g.pow(2).sum(dim=1).mean())
    big_sq = float(g.mean(dim=0).pow(2).sum())
    b_big = b_small * n_small
    g2, trace, b_simple = simple_noise_scale(small_sq, big_sq, b_small, b_big)
    return {"small_sq": small_sq, "big_sq": big_sq, "b_small": b_small, "b_big": b_big,
            "G2": g2, "trace": trace, "B_simple": b_simple}


def during_training(cfg: configs.ModelConfig, blocks: torch.Tensor, steps: int,
                    at: Sequence[int], lr: float = 3e-3, batch_size: int = 16,
                    b_small: int = 4, n_small: int = 16, init: str = "scaled",
                    seed: int = 0, device: str = "cpu") -> pd.DataFrame:
    """Train the reference model for `steps` steps (warmup 10%, cosine) and measure the noise
    scale before the update of each step in `at` (0: at initialisation), on sequences the run
    does not train on at that step. One row per measurement, with the step's training loss."""
    if not at or min(at) < 0 or max(at) >= steps:
        raise ValueError(f"measurement steps must lie in [0, {steps}), got {list(at)}")
    model = build_model(cfg, init, seed)
    rows = []

    def probe(step, m):
        if step in at:
            rows.append({"step": step, **measure(m, blocks, b_small, n_small, seed + 1 + step)})
    losses = short_run(model, init, blocks, lr, steps, batch_size, max(1, steps // 10),
                       seed=seed, on_step=probe, device=device)
    df = pd.DataFrame(rows)
    df["loss"] = [losses[s] for s in df.step]
    df["B_simple_tokens"] = df.B_simple * (blocks.shape[1] - 1)
    return df
