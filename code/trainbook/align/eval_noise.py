"""Evaluation noise: how sure a score is, and how many items it takes to tell two apart.

A benchmark score is a mean over n items, so it has sampling noise of order sqrt(p (1 - p) / n)
even when the model and the scoring are fixed: the items are a sample of the questions the
benchmark stands for. `mean_stderr` is lm-eval's standard error of a mean score (the sample
standard deviation over sqrt(n), what its results tables print as `stderr`); `normal_ci` the
interval p +- z se, which collapses to a point at p = 0 or 1; `wilson` the Wilson score interval,
which does not (the set of rates p whose z-test accepts the observed one). `items_needed` is the
classical two-proportion sample size: items per model so that a two-sided z-test at level alpha
detects accuracies p1 vs p2 with the given power; `detection_rate` measures that power by
simulating the comparison, which is how the chapter checks the formula.

Chapter: book/alignment/evaluation
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import torch

from .task import _whole


def z_value(confidence: float) -> float:
    """The two-sided normal quantile of a confidence level (1.96 for 0.95)."""
    if not (isinstance(confidence, float) and 0 < confidence < 1):
        raise ValueError(f"confidence must be a float in (0, 1), got {confidence!r}")
    return statistics.NormalDist().inv_cdf(0.5 + confidence / 2)


def mean_stderr(scores: Sequence[float]) -> float:
    """lm-eval's standard error of a mean score: sample standard deviation / sqrt(n)."""
    if len(scores) < 2:
        raise ValueError("a standard error needs at least two scores")
    return statistics.stdev(scores) / math.sqrt(len(scores))


def normal_ci(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """p +- z sqrt(p (1 - p) / n), clipped to [0, 1]: zero width at p = 0 or 1."""
    _whole("n", n, 1)
    if not 0 <= _whole("successes", successes, 0) <= n:
        raise ValueError(f"successes {successes} exceeds n {n}")
    p, z = successes / n, z_value(confidence)
    half = z * math.sqrt(p * (1 - p) / n)
    return max(0.0, p - half), min(1.0, p + half)


def wilson(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson's score interval: the p whose z-test does not reject the observed rate
    (Wilson 1927). Never outside [0, 1] and never zero width."""
    _whole("n", n, 1)
    if not 0 <= _whole("successes", successes, 0) <= n:
        raise ValueError(f"successes {successes} exceeds n {n}")
    p, z = successes / n, z_value(confidence)
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def _rates(p1: float, p2: float) -> None:
    for name, p in (("p1", p1), ("p2", p2)):
        if not (isinstance(p, (int, float)) and 0 < p < 1):
            raise ValueError(f"{name} must be a rate in (0, 1), got {p!r}")
    if p1 == p2:
        raise ValueError("p1 equals p2: there is no difference to detect")


def items_needed(p1: float, p2: float, alpha: float = 0.05, power: float = 0.8) -> int:
    """Items per model for a two-sided two-proportion z-test at level alpha to detect accuracy
    p1 vs p2 with the given power (independent item sets; the pooled variance under H0):
    n = (z_{1-a/2} sqrt(2 pbar qbar) + z_power sqrt(p1 q1 + p2 q2))^2 / (p1 - p2)^2."""
    _rates(p1, p2)
    za, zb = z_value(1 - alpha), statistics.NormalDist().inv_cdf(power) if 0 < power < 1 else None
    if zb is None:
        raise ValueError(f"power must be in (0, 1), got {power!r}")
    pbar = (p1 + p2) / 2
    root = za * math.sqrt(2 * pbar * (1 - pbar)) + zb * math.sqrt(p1 * (1 - p1) + p2 * (1 - p2))
    return math.ceil(root * root / (p1 - p2) ** 2)


def detection_rate(p1: float, p2: float, n: int, trials: int = 2000, alpha: float = 0.05,
                   seed: int = 0) -> float:
    """Share of simulated comparisons (n items per model, accuracies p1 and p2) in which the
    two-proportion z-test rejects equality at level alpha: the power, measured."""
    _rates(p1, p2)
    _whole("n", n, 2)
    _whole("trials", trials, 1)
    g = torch.Generator().manual_seed(seed)
    a = torch.binomial(torch.full((trials,), float(n)), torch.full((trials,), p1), generator=g)
    b = torch.binomial(torch.full((trials,), float(n)), torch.full((trials,), p2), generator=g)
    pooled = (a + b) / (2 * n)
    se = torch.sqrt(pooled * (1 - pooled) * 2 / n)
    z = ((a - b) / n).abs() / se.clamp_min(1e-12)
    return float((z > z_value(1 - alpha)).double().mean())
