"""Time and cost of a training run: FLOPs -> seconds -> GPU-hours -> dollars, and back.

The forward direction is one division: a run needs F model FLOPs; G GPUs of dense peak P
FLOP/s sustain a fraction MFU of it, so the run computes for F / (G * P * MFU) seconds.
The inverse takes a published run's GPU-hours and returns the MFU they imply, which
includes every overhead of the real run (restarts, checkpoints, evaluation, idle time).

Goodput adds what a cluster does to that ideal: blocking checkpoint writes and failures,
each of which costs a restart and the work done since the last checkpoint. Young (1974)
and Daly (2006) give the checkpoint interval that minimises that waste.

Symbols: W useful compute time, tau checkpoint interval (compute between checkpoints),
delta time to write one checkpoint, R restart time, M the cluster's mean time between
failures (the per-GPU MTBF divided by the number of GPUs). delta is derived, not assumed: a
checkpoint's bytes (`checkpoint_bytes`: the fp32 weights and the optimizer state, from
`compute.memory`) over the bandwidth the writers get from storage.

Chapter: book/compute/cost.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .. import configs, hardware
from .flops import matmul_params, training_flops_per_token, utilization
from .memory import state_bytes_per_param

if TYPE_CHECKING:
    import numpy as np

FLOP_MODES = ("6n+attn", "6n")
_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12, "p": 1e15}


def parse_count(text: str | float | int) -> float:
    """'15T', '2.0T', '300B', '15e12', '1,000,000' or a number -> a float count (tokens)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        m = re.fullmatch(r"\s*([-+]?[0-9][0-9_,]*\.?[0-9]*(?:e[+-]?[0-9]+)?)\s*([kmbgtp]?)\s*",
                         str(text), re.IGNORECASE)
        if m is None:
            raise ValueError(f"cannot read {text!r} as a count; write e.g. 15T, 300B, 2.5e12 "
                             "or 1000000 (suffixes k, M, B, T, P)")
        value = float(m.group(1).replace(",", "").replace("_", "")) * _SUFFIX[m.group(2).lower()]
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"a token count must be a positive number, got {text!r}")
    return value


def _positive(name: str, value: float, allow_zero: bool = False) -> float:
    ok = value >= 0 if allow_zero else value > 0
    if not (isinstance(value, (int, float)) and math.isfinite(value) and ok):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'} and finite, "
                         f"got {value!r}")
    return float(value)


def _check_mfu(mfu: float) -> float:
    if not (isinstance(mfu, (int, float)) and 0 < mfu <= 1):
        raise ValueError(f"MFU must be in (0, 1], got {mfu!r}; write 40% as 0.4")
    return float(mfu)


def _check_gpus(gpus: int) -> int:
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"the number of GPUs must be an integer >= 1, got {gpus!r}")
    return gpus


def flops_per_token(cfg: configs.ModelConfig, seq_len: int | None = None,
                    mode: str = "6n+attn") -> float:
    """Training FLOPs per token: '6n+attn' (PaLM's 6N + 12LHQT, trainbook.compute.flops) or
    plain '6n' (N = parameters a token multiplies through, `matmul_params`)."""
    if mode not in FLOP_MODES:
        raise ValueError(f"FLOP mode {mode!r} is unknown; use one of {', '.join(FLOP_MODES)}")
    seq_len = configs.check_seq_len(cfg, cfg.max_seq_len if seq_len is None else seq_len)
    if mode == "6n":
        return 6.0 * matmul_params(cfg)
    return float(training_flops_per_token(cfg, seq_len))


def run_flops(model: str | Path | configs.ModelConfig, tokens: str | float,
              seq_len: int | None = None, mode: str = "6n+attn") -> float:
    """Total training FLOPs of `tokens` tokens (a count or '15T') through `model`."""
    cfg = configs.resolve(model)
    return flops_per_token(cfg, seq_len, mode) * parse_count(tokens)


def compute_seconds(flops: float, gpus: int, peak_flops: float, mfu: float) -> float:
    """The whole forward model: seconds = FLOPs / (GPUs * peak FLOP/s * MFU)."""
    _positive("FLOPs", flops)
    _positive("peak FLOP/s", peak_flops)
    return flops / (_check_gpus(gpus) * peak_flops * _check_mfu(mfu))


@dataclass(frozen=True)
class RunEstimate:
    """An ideal run (no failures, no checkpoints): time, GPU-hours and, given a price, dollars."""

    model: str
    tokens: float
    seq_len: int
    flop_mode: str
    flops: float
    gpu: str
    dtype: str
    peak_tflops: float  # per GPU, dense, in `dtype`
    gpus: int
    mfu: float
    seconds: float
    gpu_hours: float
    price_per_gpu_hour: float | None
    cost: float | None

    @property
    def days(self) -> float:
        return self.seconds / 86400

    def to_dict(self) -> dict:
        return {**asdict(self), "days": self.days}


def estimate(model: str | Path | configs.ModelConfig, tokens: str | float,
             gpu: str | hardware.Accelerator = "h100-sxm", gpus: int = 1,
             mfu: float = 0.4, dtype: str = "bf16", seq_len: int | None = None,
             flop_mode: str = "6n+attn", price_per_gpu_hour: float | None = None) -> RunEstimate:
    """Time and cost of training `model` on `tokens` tokens with `gpus` GPUs at `mfu`."""
    cfg = configs.resolve(model)
    seq_len = cfg.max_seq_len if seq_len is None else seq_len
    acc = hardware.get(gpu)
    peak = acc.peak_flops(dtype)
    flops = run_flops(cfg, tokens, seq_len, flop_mode)
    seconds = compute_seconds(flops, gpus, peak, mfu)
    gpu_hours = seconds * gpus / 3600
    cost = None
    if price_per_gpu_hour is not None:
        cost = gpu_hours * _positive("price per GPU-hour", price_per_gpu_hour, allow_zero=True)
    return RunEstimate(cfg.name, parse_count(tokens), seq_len, flop_mode, flops, acc.name,
                       hardware.normalize_dtype(dtype), peak / 1e12, gpus, mfu, seconds,
                       gpu_hours, price_per_gpu_hour, cost)


def implied_mfu(model: str | Path | configs.ModelConfig, tokens: str | float, gpu_hours: float,
                gpu: str | hardware.Accelerator = "a100-80gb", dtype: str = "bf16",
                seq_len: int | None = None, flop_mode: str = "6n+attn") -> float:
    """The MFU a published run implies: its model FLOPs over (GPU-hours * 3600 * peak).

    Published GPU-hours cover the whole run (failures, restarts, checkpoints, evaluation,
    stragglers), so this is a lower bound on the MFU of its steady-state steps."""
    _positive("GPU-hours", gpu_hours)
    flops = run_flops(model, tokens, seq_len, flop_mode)
    return utilization(flops, gpu_hours * 3600, hardware.get(gpu).peak_flops(dtype))


# --- goodput: checkpoints and failures -------------------------------------------------------

def cluster_mtbf_hours(gpus: int, mtbf_gpu_hours: float) -> float:
    """Mean time between failures of a synchronous job on `gpus` GPUs: any one GPU's
    failure stops it, so independent failures add up and the MTBF divides by the count."""
    return _positive("per-GPU MTBF (GPU-hours)", mtbf_gpu_hours) / _check_gpus(gpus)


def mtbf_from_incidents(incidents: int, days: float, gpus: int) -> float:
    """Per-GPU MTBF in GPU-hours from an observed count of interruptions (e.g. Llama 3)."""
    _positive("incidents", incidents)
    return _positive("days", days) * 24 * _check_gpus(gpus) / incidents


# Llama 3 (Dubey et al. 2024, Section 3.3.4): 419 unexpected interruptions in a 54-day snapshot
# on 16,384 H100s, one per ~50,700 GPU-hours (every ~3 hours for the whole job).
LLAMA3_MTBF_GPU_HOURS = mtbf_from_incidents(419, 54, 16384)


# Llama 3's checkpoint storage: Tectonic, 2 TB/s sustained and 7 TB/s peak (Dubey et al.
# 2024, Section 3.3.1), shared by the whole 16,384-GPU job (2,048 nodes: ~1 GB/s per node).
LLAMA3_STORAGE_GBPS = 2000.0


def checkpoint_bytes(model: str | Path | configs.ModelConfig, dtype: str = "bf16",
                     optimizer: str = "adamw") -> dict[str, float]:
    """Bytes of a full training checkpoint by component: 'weights' in fp32 (under mixed
    precision the optimizer's master copy: the 16-bit copy is a rounding of it, not saved) and
    'optimizer' (its per-parameter state: AdamW's two fp32 moments). Gradients are not saved
    (the next step recomputes them), nor activations. Data position, random state and configs
    are kilobytes. From compute.memory's bytes per parameter."""
    cfg = configs.resolve(model)
    n = configs.param_counts(cfg)["total"]
    b = state_bytes_per_param(dtype, optimizer)
    master = 0.0 if dtype == "fp32" else 4.0  # mixed precision: the optimizer holds fp32 weights
    return {"weights": 4.0 * n, "optimizer": (b["optimizer"] - master) * n}


def checkpoint_seconds(nbytes: float, write_gbps: float) -> float:
    """The stall of a synchronous checkpoint: bytes over the write bandwidth the job gets
    (decimal GB/s, all writers together)."""
    return _positive("checkpoint bytes", nbytes) / (_positive("write bandwidth (GB/s)",
                                                              write_gbps) * 1e9)


def young_interval(ckpt_s: float, mtbf_s: float) -> float:
    """Young (1974): tau* = sqrt(2 delta M), the minimiser of the first-order waste."""
    return math.sqrt(2 * _positive("checkpoint time", ckpt_s) * _positive("MTBF", mtbf_s))


def daly_interval(ckpt_s: float, mtbf_s: float) -> float:
    """Daly (2006): a higher-order optimum; equals Young's to first order."""
    d, m = _positive("checkpoint time", ckpt_s), _positive("MTBF", mtbf_s)
    if d >= 2 * m:
        return m
    x = d / (2 * m)
    return math.sqrt(2 * d * m) * (1 + math.sqrt(x) / 3 + x / 9) - d


def first_order_waste(interval_s: float, ckpt_s: float, mtbf_s: float,
                      restart_s: float = 0.0) -> float:
    """Wasted time per second of useful work, to first order in 1/M: checkpoint writes
    delta/tau, plus per failure (one every M seconds) a restart R and on average half an
    interval of lost work tau/2. Minimised by Young's tau* = sqrt(2 delta M)."""
    tau = _positive("checkpoint interval", interval_s)
    d = _positive("checkpoint time", ckpt_s, True)
    m, r = _positive("MTBF", mtbf_s), _positive("restart time", restart_s, True)
    return d / tau + (r + tau / 2) / m


def expected_wall_seconds(work_s: float, interval_s: float, ckpt_s: float, mtbf_s: float,
                          restart_s: float = 0.0) -> float:
    """Exact expected wall-clock time of `work_s` seconds of compute, checkpointing after every
    `interval_s` of compute, under Poisson failures of mean `mtbf_s` that can strike any time
    (compute, checkpoint write, restart). Each segment of length s = tau + delta takes on average
    M e^{R/M} (e^{s/M} - 1) (Daly 2006); the last segment may be shorter."""
    w, tau = _positive("work", work_s), _positive("checkpoint interval", interval_s)
    d, m = _positive("checkpoint time", ckpt_s, True), _positive("MTBF", mtbf_s)
    r = _positive("restart time", restart_s, True)
    full, rest = divmod(w, tau)
    try:
        per = lambda s: m * math.exp(r / m) * math.expm1(s / m)  # noqa: E731
        total = full * per(tau + d) + (per(rest + d) if rest > 1e-9 * tau else 0.0)
    except OverflowError:
        total = math.inf
    if not math.isfinite(total):
        raise ValueError(f"with a {m / 3600:.3g} h MTBF and {tau / 3600:.3g} h between checkpoints "
                         "the run would practically never finish; checkpoint more often")
    return total


@dataclass(frozen=True)
class Goodput:
    """A run on a real cluster: its ideal compute time stretched by checkpoints and failures."""

    ideal_hours: float  # compute only (the RunEstimate)
    gpus: int
    mtbf_gpu_hours: float
    cluster_mtbf_hours: float
    ckpt_minutes: float
    interval_minutes: float
    restart_minutes: float
    wall_hours: float  # expected, exact under Poisson failures
    goodput: float  # ideal / wall
    failures: float  # expected number of failures during the run
    checkpoints: float
    ckpt_share: float  # first-order breakdown of the waste, per unit of useful work
    rework_share: float
    restart_share: float

    def to_dict(self) -> dict:
        return asdict(self)


def goodput(ideal_hours: float, gpus: int, mtbf_gpu_hours: float, ckpt_minutes: float,
            restart_minutes: float, interval_minutes: float | None = None) -> Goodput:
    """Expected wall-clock of a run needing `ideal_hours` of compute on `gpus` GPUs, with
    blocking checkpoints every `interval_minutes` (None: Young's optimum) and failures."""
    m = cluster_mtbf_hours(gpus, mtbf_gpu_hours) * 3600
    d = _positive("checkpoint time (minutes)", ckpt_minutes, allow_zero=True) * 60
    r = _positive("restart time (minutes)", restart_minutes, allow_zero=True) * 60
    if interval_minutes is None:
        if d == 0:
            raise ValueError("with free checkpoints (0 minutes) the optimal interval is 0; "
                             "give --ckpt-minutes > 0 or an explicit interval")
        tau = young_interval(d, m)
    else:
        tau = _positive("checkpoint interval (minutes)", interval_minutes) * 60
    w = _positive("ideal compute time (hours)", ideal_hours) * 3600
    wall = expected_wall_seconds(w, tau, d, m, r)
    tau = min(tau, w)  # a run shorter than the interval checkpoints once, at its end
    return Goodput(
        ideal_hours=w / 3600, gpus=gpus, mtbf_gpu_hours=mtbf_gpu_hours, cluster_mtbf_hours=m / 3600,
        ckpt_minutes=d / 60, interval_minutes=tau / 60, restart_minutes=r / 60,
        wall_hours=wall / 3600, goodput=w / wall, failures=wall / m, checkpoints=math.ceil(w / tau),
        ckpt_share=d / tau, rework_share=(tau + d) / 2 / m, restart_share=r / m)


def simulate_wall_seconds(work_s: float, interval_s: float, ckpt_s: float, mtbf_s: float,
                          restart_s: float = 0.0, runs: int = 2000, seed: int = 0) -> np.ndarray:
    """Monte-Carlo wall-clock times (numpy array, one per run) of the model behind
    `expected_wall_seconds`: exponential failures that can hit compute, checkpoint writes and
    restarts; a failure throws away the segment in progress and costs a restart."""
    import numpy as np

    w, tau = _positive("work", work_s), _positive("checkpoint interval", interval_s)
    d, m = _positive("checkpoint time", ckpt_s, True), _positive("MTBF", mtbf_s)
    r = _positive("restart time", restart_s, True)
    if not (isinstance(runs, int) and runs >= 1):
        raise ValueError(f"runs must be an integer >= 1, got {runs!r}")
    rng = np.random.default_rng(seed)

    def window(length: float, n: int, then_restart: bool = True) -> np.ndarray:
        """Time to get `length` seconds free of failures, `n` times over. After a failure in a
        segment comes a restart (itself retried until it gets `r` seconds free of failures)."""
        total, pending = np.zeros(n), np.ones(n, dtype=bool)
        while pending.any():
            t = rng.exponential(m, pending.sum())
            ok = t >= length
            idx = np.flatnonzero(pending)
            total[idx[ok]] += length
            failed = idx[~ok]
            total[failed] += t[~ok]
            if then_restart and r > 0 and failed.size:
                total[failed] += window(r, failed.size, then_restart=False)
            pending[idx[ok]] = False
        return total

    full, rest = divmod(w, tau)
    segments = [tau + d] * int(full) + ([rest + d] if rest > 1e-9 * tau else [])
    wall = np.zeros(runs)
    for s in segments:
        wall += window(s, runs)
    return wall


def summary_rows(est: RunEstimate, gp: Goodput) -> list[dict]:
    """The ideal run and the run with checkpoints and failures, side by side (CLI, calculator)."""
    gpu_hours = gp.wall_hours * est.gpus
    return [
        {"": "ideal (compute only)", "days": est.days, "GPU-hours": est.gpu_hours,
         "cost": est.cost},
        {"": "with checkpoints and failures", "days": gp.wall_hours / 24, "GPU-hours": gpu_hours,
         "cost": None if est.cost is None else gpu_hours * est.price_per_gpu_hour},
    ]
