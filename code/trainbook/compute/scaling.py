"""Scaling laws: Kaplan et al. 2020, Chinchilla (Hoffmann et al. 2022) and fitting your own.

The Chinchilla parametric law predicts the final loss of a model with N parameters trained on
D tokens, L(N, D) = E + A / N^alpha + B / D^beta. Minimising it under the budget C = 6 N D gives
the compute-optimal allocation in closed form (Hoffmann et al. 2022, equation 4):
N_opt = G (C/6)^a, D_opt = (C/6)^b / G, with G = (alpha A / (beta B))^(1/(alpha+beta)),
a = beta / (alpha+beta), b = alpha / (alpha+beta). The fit follows the paper's Section 3.3 and
Appendix D.2 as the replication of Besiroglu et al. 2024 runs it: a Huber loss (delta 1e-3) on
the log of the loss, minimised with L-BFGS from a grid of initialisations.

Chapter: book/compute/scaling-laws.
"""

from __future__ import annotations

import ctypes
import itertools
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import pandas as pd
    from numpy.typing import ArrayLike

PF_DAY = 1e15 * 86400  # FLOPs in one petaflop/s-day, Kaplan et al.'s unit of compute
HUBER_DELTA = 1e-3


def _positive(name: str, value) -> np.ndarray:
    v = np.asarray(value, dtype=float)
    if not np.all(np.isfinite(v)) or np.any(v <= 0):
        raise ValueError(f"{name} must be positive and finite, got {value!r}")
    return v


def _out(v: np.ndarray):
    return float(v) if v.ndim == 0 else v


@dataclass(frozen=True)
class ChinchillaFit:
    """One set of constants of L(N, D) = E + A / N^alpha + B / D^beta (nats per token)."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float
    name: str = "fit"
    source: str = ""

    def __post_init__(self):
        for f in ("E", "A", "B", "alpha", "beta"):
            _positive(f, getattr(self, f))

    @property
    def a(self) -> float:
        """Exponent of N_opt in C."""
        return self.beta / (self.alpha + self.beta)

    @property
    def b(self) -> float:
        """Exponent of D_opt in C."""
        return self.alpha / (self.alpha + self.beta)

    @property
    def G(self) -> float:
        return (self.alpha * self.A / (self.beta * self.B)) ** (1 / (self.alpha + self.beta))

    def loss(self, N: ArrayLike, D: ArrayLike) -> float | np.ndarray:
        """Predicted final loss of N parameters trained on D tokens."""
        N, D = _positive("N", N), _positive("D", D)
        return _out(self.E + self.A / N ** self.alpha + self.B / D ** self.beta)

    def optimal(self, C: ArrayLike) -> tuple[float | np.ndarray, float | np.ndarray]:
        """(N_opt, D_opt) for a budget of C FLOPs under C = 6 N D (equation 4)."""
        C = _positive("C", C)
        n = self.G * (C / 6) ** self.a
        return _out(n), _out(C / (6 * n))

    def optimal_loss(self, C: ArrayLike) -> float | np.ndarray:
        """The loss at the compute-optimal allocation of C FLOPs."""
        return self.loss(*self.optimal(C))

    def compute_for_loss(self, target: float) -> float:
        """The smallest budget C (FLOPs) whose compute-optimal model reaches `target` loss.

        Along the frontier both reducible terms fall as (C/6)^-gamma, gamma = alpha beta /
        (alpha + beta), so L_opt(C) = E + K (C/6)^-gamma with K = A / G^alpha + B G^beta.
        """
        if not target > self.E:
            raise ValueError(f"target loss {target} is not above the irreducible loss "
                             f"E = {self.E:.4g}; no finite budget reaches it")
        gamma = self.alpha * self.beta / (self.alpha + self.beta)
        K = self.A / self.G ** self.alpha + self.B * self.G ** self.beta
        return 6 * (K / (target - self.E)) ** (1 / gamma)

    def as_dict(self) -> dict:
        return asdict(self)


# The two published fits, and the unrounded Hoffmann values (TeX source of arXiv 2203.15556, as
# Besiroglu et al. 2024 report them). The body of the paper prints the rounded ones.
FITS = {
    "hoffmann": ChinchillaFit(1.69, 406.4, 410.7, 0.34, 0.28, "hoffmann",
                              "Hoffmann et al. 2022, Section 3.3 / D.2 (Approach 3, as printed)"),
    "hoffmann-tex": ChinchillaFit(1.6934, 406.4, 410.7, 0.3392, 0.2849, "hoffmann-tex",
                                  "Hoffmann et al. 2022, unrounded values from the TeX source"),
    "epoch": ChinchillaFit(1.8172, 482.01, 2085.43, 0.3478, 0.3658, "epoch",
                           "Besiroglu et al. 2024 (Epoch AI), refit on 240 points from Figure 4"),
}
# Standard errors of the Epoch AI refit, as Besiroglu et al. 2024 report them (bootstrapped)
EPOCH_SE = {"E": 0.03, "A": 124.58, "B": 1293.23, "alpha": 0.02, "beta": 0.02}


def get_fit(name: str | ChinchillaFit) -> ChinchillaFit:
    if isinstance(name, ChinchillaFit):
        return name
    if name not in FITS:
        raise ValueError(f"unknown fit {name!r}; use one of {', '.join(FITS)}")
    return FITS[name]


def compute_optimal(C: float, fit: str | ChinchillaFit = "epoch") -> dict:
    """N_opt, D_opt, tokens per parameter and predicted loss for a budget of C FLOPs."""
    f = get_fit(fit)
    C = float(_positive("the FLOP budget C", C))
    n, d = f.optimal(C)
    if n < 1 or d < 1:
        raise ValueError(f"a budget of {C:g} FLOPs is too small: it buys fewer than one parameter "
                         f"or token (N_opt = {n:.3g}, D_opt = {d:.3g}); use a larger --flops")
    return {"fit": f.name, "flops": C, "params": n, "tokens": d, "tokens_per_param": d / n,
            "loss": f.loss(n, d)}


def isoflop(C: float, N: ArrayLike, fit: str | ChinchillaFit = "epoch") -> float | np.ndarray:
    """Predicted loss along the IsoFLOP curve: models of N parameters trained on D = C / (6N)."""
    C, N = _positive("C", C), _positive("N", N)
    return get_fit(fit).loss(N, C / (6 * N))


# ---------------------------------------------------------------- Kaplan et al. 2020

KAPLAN = {"alpha_N": 0.076, "N_c": 8.8e13,  # L(N) = (N_c / N)^alpha_N, non-embedding N (eq. 1.1)
          "N_e": 1.3e9, "p_N": 0.73}  # N_opt = N_e * C_min^p_N, C_min in PF-days (Table 6)


def kaplan_loss(N_nonembed: ArrayLike) -> float | np.ndarray:
    """Kaplan et al. 2020 eq. 1.1: loss of a converged model with N non-embedding parameters."""
    N = _positive("N", N_nonembed)
    return _out((KAPLAN["N_c"] / N) ** KAPLAN["alpha_N"])


def kaplan_optimal(C: float) -> tuple[float, float]:
    """Kaplan et al.'s compute-efficient allocation (N_opt, D) of C FLOPs, D = C / (6 N).

    N_opt = 1.3e9 (C / PF-day)^0.73 non-embedding parameters: model size grows about three times
    faster than data, the opposite lesson from Chinchilla's C^0.5.
    """
    C = float(_positive("C", C))
    n = KAPLAN["N_e"] * (C / PF_DAY) ** KAPLAN["p_N"]
    return n, C / (6 * n)


# ---------------------------------------------------------------- fitting

def _objective(theta, logN, logD, logL, delta):
    """Sum of Huber(log L_hat - log L) and its gradient,
    log L_hat = LSE(a - alpha logN, b - beta logD, e)."""
    a, b, e, alpha, beta = theta
    terms = np.stack([a - alpha * logN, b - beta * logD, np.full_like(logN, e)])
    m = terms.max(axis=0)
    w = np.exp(terms - m)
    s = w.sum(axis=0)
    r = m + np.log(s) - logL
    w /= s
    small = np.abs(r) <= delta
    value = np.where(small, 0.5 * r * r, delta * (np.abs(r) - 0.5 * delta)).sum()
    dr = np.where(small, r, delta * np.sign(r))
    grad = np.array([(dr * w[0]).sum(), (dr * w[1]).sum(), (dr * w[2]).sum(),
                     -(dr * w[0] * logN).sum(), -(dr * w[1] * logD).sum()])
    return value, grad


def _openblas_thread_setters() -> list:
    """(get, set) thread-count functions of the OpenBLAS libraries bundled with scipy and numpy."""
    import numpy
    import scipy

    found = []
    for pkg in (scipy, numpy):
        libdir = Path(pkg.__file__).parent.parent / f"{pkg.__name__}.libs"
        for path in sorted(libdir.glob("lib*openblas*.so*")):
            try:
                lib = ctypes.CDLL(str(path))
            except OSError:
                continue
            for prefix, suffix in itertools.product(("scipy_openblas", "openblas"), ("", "64_")):
                get = getattr(lib, f"{prefix}_get_num_threads{suffix}", None)
                put = getattr(lib, f"{prefix}_set_num_threads{suffix}", None)
                if get is not None and put is not None:
                    found.append((get, put))
                    break
    return found


@contextmanager
def single_threaded_blas() -> Iterator[None]:
    """Run BLAS on one thread inside the block.

    scipy >= 1.15's L-BFGS-B makes BLAS calls on 5-vectors; multi-threaded OpenBLAS makes each
    call up to ~100x slower on a busy machine (scipy issues #22438 and #23191). threadpoolctl does
    this where it is installed; otherwise the OpenBLAS bundled with the scipy/numpy wheels is told
    directly, and anything else (MKL, Accelerate) is left alone.
    """
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        threadpool_limits = None
    if threadpool_limits is not None:
        with threadpool_limits(1, user_api="blas"):
            yield
        return
    setters = _openblas_thread_setters()
    old = [get() for get, _ in setters]
    for _, put in setters:
        put(1)
    try:
        yield
    finally:
        for (_, put), n in zip(setters, old):
            put(n)


# The replication's grid (Besiroglu et al. 2024, after Hoffmann et al. Appendix D.2): 4,500 starts
FULL_GRID = {"a": np.arange(0, 30, 5), "b": np.arange(0, 30, 5), "e": np.arange(-1, 1.5, 0.5),
             "alpha": np.arange(0, 2.5, 0.5), "beta": np.arange(0, 2.5, 0.5)}
# A reduced grid that finds the same optimum on the Chinchilla points in well under a second
SMALL_GRID = {"a": (5, 10), "b": (5, 10), "e": (0.0, 0.5), "alpha": (0.5, 1.0), "beta": (0.5, 1.0)}


@dataclass(frozen=True)
class FitResult:
    fit: ChinchillaFit
    objective: float
    n_points: int
    n_starts: int
    converged: int  # starts whose L-BFGS run reported success


def fit_parametric(N: ArrayLike, D: ArrayLike, loss: ArrayLike, grid: dict | None = None,
                   delta: float = HUBER_DELTA, name: str = "fitted") -> FitResult:
    """Fit L(N, D) = E + A/N^alpha + B/D^beta by Huber loss on log-loss, L-BFGS from a grid.

    `grid` maps each of a, b, e (logs of A, B, E), alpha and beta to the starting values to try;
    the best of all starts wins. The default is SMALL_GRID; FULL_GRID is the replication's.
    """
    from scipy.optimize import minimize

    N, D, L = (_positive(k, v).ravel() for k, v in (("N", N), ("D", D), ("loss", loss)))
    if not len(N) == len(D) == len(L):
        raise ValueError(f"N, D and loss must have the same length, "
                         f"got {len(N)}, {len(D)}, {len(L)}")
    if len(N) < 5:
        raise ValueError(f"fitting 5 parameters needs at least 5 points, got {len(N)}")
    if delta <= 0:
        raise ValueError(f"delta must be positive, got {delta}")
    grid = SMALL_GRID if grid is None else grid
    missing = {"a", "b", "e", "alpha", "beta"} - set(grid)
    if missing:
        raise ValueError(f"grid lacks starting values for {sorted(missing)}")
    logN, logD, logL = np.log(N), np.log(D), np.log(L)
    best, converged, starts = None, 0, 0
    with single_threaded_blas():
        for start in itertools.product(*(grid[k] for k in ("a", "b", "e", "alpha", "beta"))):
            # tolerances far below scipy's defaults: with delta = 1e-3 the objective and its
            # gradient are tiny, and Besiroglu et al. 2024 trace part of Hoffmann et al.'s
            # discrepancy to an optimizer that stopped before convergence on that scale
            res = minimize(_objective, np.array(start, float), args=(logN, logD, logL, delta),
                           jac=True, method="L-BFGS-B",
                           options={"ftol": 1e-15, "gtol": 1e-12, "maxiter": 2000})
            starts += 1
            converged += bool(res.success)
            if np.all(np.isfinite(res.x)) and (best is None or res.fun < best.fun):
                best = res
    a, b, e, alpha, beta = best.x
    if alpha <= 0 or beta <= 0:
        raise ValueError("the fit found a non-positive exponent; the data do not follow the law "
                         f"(alpha = {alpha:.3g}, beta = {beta:.3g})")
    fit = ChinchillaFit(math.exp(e), math.exp(a), math.exp(b), float(alpha), float(beta), name)
    return FitResult(fit, float(best.fun), len(N), starts, converged)


def bootstrap(N: ArrayLike, D: ArrayLike, loss: ArrayLike, n_boot: int = 20, seed: int = 0,
              grid: dict | None = None, delta: float = HUBER_DELTA) -> list[ChinchillaFit]:
    """Refit on `n_boot` resamples (with replacement) of the points: the spread is the uncertainty.

    Each resample starts from the full-data optimum plus `grid` (default: none besides it).
    """
    if n_boot < 2:
        raise ValueError(f"n_boot must be >= 2, got {n_boot}")
    N, D, L = (np.asarray(v, float).ravel() for v in (N, D, loss))
    full = fit_parametric(N, D, L, grid, delta).fit
    start = {"a": (math.log(full.A),), "b": (math.log(full.B),), "e": (math.log(full.E),),
             "alpha": (full.alpha,), "beta": (full.beta,)}
    rng = np.random.default_rng(seed)
    fits = []
    for _ in range(n_boot):
        i = rng.integers(0, len(N), len(N))
        fits.append(fit_parametric(N[i], D[i], L[i], start, delta).fit)
    return fits


def chinchilla_points(drop_highest: int = 5) -> pd.DataFrame:
    """The shipped Figure 4 points as a DataFrame with N, C, D = C/(6N) and loss.

    The replication drops the 5 highest-loss points (the first runs of the smallest budgets,
    far above every other point) before fitting; `drop_highest=0` keeps all 245.
    """
    from .. import datasets

    raw = datasets.load_csv("chinchilla-fig4-points")
    if not 0 <= drop_highest < len(raw):
        raise ValueError(f"drop_highest must be in [0, {len(raw)}), got {drop_highest}")
    df = raw.rename(columns={"Model Size": "N", "Training FLOP": "C"})[["N", "C", "loss"]]
    df = df.assign(D=df.C / (6 * df.N))[["N", "D", "C", "loss"]]
    df = df.sort_values("loss", kind="stable").iloc[:len(df) - drop_highest]
    return df.sort_index().reset_index(drop=True)


def fit_chinchilla(grid: dict | None = None, drop_highest: int = 5) -> FitResult:
    """Approach 3 on the shipped points, as the replication runs it."""
    df = chinchilla_points(drop_highest)
    return fit_parametric(df.N.values, df.D.values, df.loss.values, grid, name="this book")


def group_by_budget(df: pd.DataFrame, budgets: ArrayLike, tol_dex: float = 0.05) -> pd.DataFrame:
    """Label each point with the FLOP budget within `tol_dex` decades of its C (NaN if none)."""
    budgets = np.asarray(budgets, float)
    dist = np.abs(np.log10(df.C.values)[:, None] - np.log10(budgets)[None, :])
    label = np.where(dist.min(axis=1) <= tol_dex, budgets[dist.argmin(axis=1)], np.nan)
    return df.assign(budget=label)


# ---------------------------------------------------------------- over-training for inference

def tokens_for_loss(fit: str | ChinchillaFit, N: ArrayLike, target: float) -> float | np.ndarray:
    """Training tokens a model of N parameters needs to reach `target` loss (inf if it never
    does)."""
    f = get_fit(fit)
    N = _positive("N", N)
    gap = target - f.E - f.A / N ** f.alpha
    d = np.where(gap > 0, (f.B / np.where(gap > 0, gap, np.nan)) ** (1 / f.beta), np.inf)
    return _out(d)


def inference_optimal(target: float, inference_tokens: float, fit: str | ChinchillaFit = "epoch",
                      points: int = 4001) -> dict:
    """Sardana et al. 2023: the N that reaches `target` loss at the least lifetime compute.

    Lifetime FLOPs = 6 N D_train (training) + 2 N D_inference (forward passes while serving);
    D_train is what N needs to reach the target. With no inference this is the Chinchilla
    optimum; the more tokens are served, the smaller and longer-trained the best model.
    """
    f = get_fit(fit)
    if inference_tokens < 0:
        raise ValueError(f"inference_tokens must be >= 0, got {inference_tokens}")
    c_star = f.compute_for_loss(target)
    n_star, _ = f.optimal(c_star)
    n_min = (f.A / (target - f.E)) ** (1 / f.alpha)  # below this no amount of data reaches target
    N = np.geomspace(n_min * 1.0001, n_star * 10, points)
    D = tokens_for_loss(f, N, target)
    total = 6 * N * D + 2 * N * inference_tokens
    i = int(np.argmin(total))
    return {"target_loss": target, "inference_tokens": float(inference_tokens),
            "params": float(N[i]), "tokens": float(D[i]), "tokens_per_param": float(D[i] / N[i]),
            "train_flops": float(6 * N[i] * D[i]), "total_flops": float(total[i]),
            "chinchilla_params": float(n_star), "chinchilla_train_flops": float(c_star),
            "chinchilla_total_flops": float(c_star + 2 * n_star * inference_tokens)}


def overtraining(N: float, D: float, fit: str | ChinchillaFit = "epoch") -> dict:
    """How far a run of N parameters on D tokens sits from compute-optimal, by the fit.

    Returns its predicted loss, the compute-optimal loss at the same C = 6ND, and the extra
    compute it spends over a compute-optimal model that reaches the same loss.
    """
    f = get_fit(fit)
    N, D = float(_positive("N", N)), float(_positive("D", D))
    C = 6 * N * D
    n_opt, d_opt = f.optimal(C)
    loss = f.loss(N, D)
    c_same = f.compute_for_loss(loss)
    return {"params": N, "tokens": D, "flops": C, "tokens_per_param": D / N, "loss": loss,
            "opt_params": n_opt, "opt_tokens": d_opt, "opt_tokens_per_param": d_opt / n_opt,
            "opt_loss": f.optimal_loss(C), "loss_penalty": loss - f.optimal_loss(C),
            "flops_same_loss_optimal": c_same, "compute_overhead": C / c_same - 1}


# ---------------------------------------------------------------- a sweep you can run on a laptop
