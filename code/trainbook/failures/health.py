"""A node health check a scheduler can run before and after jobs: measure, compare, grade.

`run_checks` returns one `Check` per test with a status (pass, warn, fail or skip), the value
measured and the value expected. `exit_status` is 1 when anything failed, so a SLURM prolog or
epilog, or a Kubernetes probe, can drain the node on it (`python -m trainbook health`).

The burn-in, on any machine:

- **matmul**: the best square matmul within a time budget (`bench.peak`), TFLOPS, in bf16 on a
  GPU and fp32 on a CPU;
- **memory**: copy bandwidth (`bench.memory`), GB/s;
- **all-reduce**: bus bandwidth between `ranks` local ranks (`bench.collectives`), GB/s;
- **determinism**: the same seeded matmul chain twice on every rank: each rank must reproduce its
  own result bit for bit, and all ranks must agree (identical hardware runs identical kernels):
  the cheapest test for silent data corruption.

Each measurement is graded against an expectation: a baseline stored from a previous run of the
same node (`save_baseline`, `--save-baseline`), or on a GPU without one, the hardware table's
figure for its model. A value below `warn_below` of the expectation warns, below `fail_below`
fails. On a GPU node the counters of `gpu_counters` (ECC, remapped rows, clocks, NVLink, Xid
events) are checked too; on a CPU they are skipped, saying why.

Chapter: book/failures/health.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from .. import hardware
from ..bench import collectives
from ..bench.matmul import device_name
from ..bench.memory import copy_bandwidth_gbps
from ..bench.peak import measure_matmul_tflops
from ..launch import rank_device, resolve_device, run
from . import gpu_counters
from .gpu_counters import Check

STATUSES = ("pass", "warn", "fail", "skip")
BURN_IN = ("matmul", "memory", "all-reduce", "determinism")
UNITS = {"matmul": "TFLOPS", "memory": "GB/s", "all-reduce": "GB/s"}
MAX_BUDGET_S = 600.0


@dataclass(frozen=True)
class Thresholds:
    """A value below warn_below x expected warns, below fail_below x expected fails."""

    warn_below: float = 0.8
    fail_below: float = 0.5

    def __post_init__(self) -> None:
        if not 0 < self.fail_below <= self.warn_below < 1:
            raise ValueError(f"need 0 < fail_below <= warn_below < 1, got fail_below "
                             f"{self.fail_below} and warn_below {self.warn_below}")


def grade(value: float, expected: float | None, thresholds: Thresholds = Thresholds()) -> str:
    """pass, warn or fail for a measurement against its expectation (pass when none is known:
    nothing to compare with)."""
    if expected is None:
        return "pass"
    if not expected > 0:
        raise ValueError(f"an expected value must be > 0, got {expected}")
    ratio = value / expected
    return "fail" if ratio < thresholds.fail_below else "warn" if ratio < thresholds.warn_below \
        else "pass"


def exit_status(checks: Iterable[Check]) -> int:
    """1 if any check failed (drain the node), else 0: warnings and skips do not fail a node."""
    return int(any(c.status == "fail" for c in checks))


# ---- the measurements ----------------------------------------------------------------------------

def matmul_dtype(device: torch.device) -> str:
    """bf16 on a GPU that has it natively, else fp32 (a CPU's bf16 may be emulated)."""
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return "bf16"
    return "fp32"


def chain_digest(size: int = 256, seed: int = 0, steps: int = 4,
                 device: str | torch.device = "cpu") -> str:
    """sha256 of a seeded chain of matmuls and tanh (x <- tanh(x @ w), `steps` times): any bit
    that a faulty unit flips changes the digest."""
    if size < 1 or steps < 1:
        raise ValueError(f"need size >= 1 and steps >= 1, got {size} and {steps}")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(size, size, generator=g).to(device)
    w = (torch.randn(size, size, generator=g) / size**0.5).to(device)
    for _ in range(steps):
        x = torch.tanh(x @ w)
    return hashlib.sha256(x.cpu().numpy().tobytes()).hexdigest()


def rank_burn_in(nbytes: int, size: int, seed: int) -> dict[str, Any]:
    """On every rank of a group (through `launch.run`): all-reduce bus bandwidth over `nbytes`
    and the chain digest, computed twice."""
    import torch.distributed as dist

    n = dist.get_world_size()
    t = collectives.time_op("all_reduce", nbytes, iters=5, warmup=1)
    device = rank_device()
    return {"rank": dist.get_rank(), "busbw_GBps": nbytes / t / 1e9 *
            collectives.bus_factor("all_reduce", n),
            "digest": chain_digest(size, seed, device=device),
            "again": chain_digest(size, seed, device=device)}


def disagreeing_ranks(digests: Sequence[str]) -> list[int]:
    """Ranks whose digest differs from the most common one (the majority is taken as right)."""
    if not digests:
        return []
    common = max(set(digests), key=list(digests).count)
    return [r for r, d in enumerate(digests) if d != common]


def measure(checks: Sequence[str] = BURN_IN, ranks: int = 2, budget_s: float = 2.0,
            device: str = "auto", allreduce_bytes: int | None = None,
            timeout_s: float = 120) -> dict[str, Any]:
    """The raw numbers of the burn-in checks asked for (see the module doc)."""
    unknown = sorted(set(checks) - set(BURN_IN))
    if unknown:
        raise ValueError(f"unknown burn-in check {unknown[0]!r}; choose from {', '.join(BURN_IN)}")
    if not 0 < budget_s <= MAX_BUDGET_S:
        raise ValueError(f"budget_s must be in (0, {MAX_BUDGET_S:g}] seconds, got {budget_s}")
    if ranks < 2 and ({"all-reduce", "determinism"} & set(checks)):
        raise ValueError(f"the all-reduce and cross-rank checks need ranks >= 2, got {ranks}")
    dev = resolve_device(device)
    out: dict[str, Any] = {"device": str(dev), "device_name": device_name(dev),
                           "threads": torch.get_num_threads()}
    if "matmul" in checks:
        dtype = matmul_dtype(dev)
        out["matmul_dtype"] = dtype
        out["matmul"] = measure_matmul_tflops(dtype, dev, budget_s)
    if "memory" in checks:
        nbytes = 256 * 2**20 if dev.type == "cuda" or budget_s >= 2 else 64 * 2**20
        out["memory"] = copy_bandwidth_gbps(nbytes, str(dev), repeats=3)
    if {"all-reduce", "determinism"} & set(checks):
        if allreduce_bytes is None:
            allreduce_bytes = 2**30 if dev.type == "cuda" else 16 * 2**20
        backend = "nccl" if dev.type == "cuda" else "gloo"
        if backend == "nccl" and torch.cuda.device_count() < ranks:
            raise ValueError(f"{ranks} ranks asked for, {torch.cuda.device_count()} GPUs visible")
        results = run(rank_burn_in, ranks, args=(allreduce_bytes, 256, 0), timeout_s=timeout_s,
                      backend=backend)
        per_rank = [r.value for r in results]
        out["ranks"] = ranks
        out["all-reduce"] = min(r["busbw_GBps"] for r in per_rank)
        out["allreduce_bytes"] = allreduce_bytes
        out["digests"] = [r["digest"] for r in per_rank]
        out["repeat_ok"] = [r["digest"] == r["again"] for r in per_rank]
    return out


# ---- expectations --------------------------------------------------------------------------------

def table_expectations(device: torch.device, ranks: int) -> dict[str, float]:
    """What the hardware table says a GPU of this model should reach (nothing for a CPU or a
    GPU missing from the table): the dense matmul peak, HBM bandwidth and the all-reduce bus
    bandwidth of its scale-up domain."""
    if device.type != "cuda":
        return {}
    spec = hardware.match_device_name(torch.cuda.get_device_name(device))
    if spec is None:
        return {}
    out = {"matmul": spec.tflops.get(matmul_dtype(device)) or 0.0, "memory": spec.hbm_gbps}
    if ranks > 1 and spec.domain > 1:
        out["all-reduce"] = spec.busbw_gbps("all_reduce")
    return {k: v for k, v in out.items() if v}


def save_baseline(path: str | Path, measured: dict[str, Any], command: str | None = None) -> Path:
    """Store a node's measurements as its baseline (JSON, with where, when and how)."""
    record = {"kind": "trainbook-health-baseline", "host": platform.node(),
              "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
                  timespec="seconds"), "torch": torch.__version__, "threads":
              torch.get_num_threads(), "command": command, **measured}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def load_baseline(path: str | Path) -> dict[str, Any]:
    """A baseline written by `save_baseline`; refuses anything else."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read baseline {path}: {e}; write one with "
                         "python -m trainbook health --save-baseline FILE") from None
    if not isinstance(record, dict) or record.get("kind") != "trainbook-health-baseline":
        raise ValueError(f"{path} is not a health baseline; write one with "
                         "python -m trainbook health --save-baseline FILE")
    return record


# ---- grading -------------------------------------------------------------------------------------

def grade_burn_in(measured: dict[str, Any], expected: dict[str, float],
                  thresholds: Thresholds = Thresholds(), source: str = "baseline") -> list[Check]:
    """One Check per burn-in number in `measured`, graded against `expected`."""
    out = []
    for name in ("matmul", "memory", "all-reduce"):
        if name not in measured:
            continue
        value, exp = measured[name], expected.get(name)
        detail = f"vs {source}" if exp else "no baseline: save one with --save-baseline"
        if name == "matmul":
            detail = f"{measured.get('matmul_dtype', '')} {detail}"
        if name == "all-reduce":
            detail = f"{measured['ranks']} ranks, {measured['allreduce_bytes'] / 2**20:g} MiB, " \
                     + detail
        out.append(Check(name, grade(value, exp, thresholds), value, UNITS[name], exp, detail))
    if "digests" in measured:
        bad = disagreeing_ranks(measured["digests"])
        unstable = [r for r, ok in enumerate(measured["repeat_ok"]) if not ok]
        if bad or unstable:
            detail = "; ".join(x for x in (
                f"ranks {bad} computed a different result from the others" if bad else "",
                f"ranks {unstable} did not reproduce their own result" if unstable else "") if x)
            out.append(Check("determinism", "fail", detail=detail + ": suspect silent data "
                             "corruption, drain the node"))
        else:
            out.append(Check("determinism", "pass", detail=f"{len(measured['digests'])} ranks "
                             "agree bit for bit, twice each"))
    return out


def run_checks(checks: Sequence[str] | None = None, ranks: int = 2, budget_s: float = 2.0,
               baseline: dict[str, Any] | None = None, thresholds: Thresholds = Thresholds(),
               kernel_log: str | None = None, device: str = "auto",
               timeout_s: float = 120) -> tuple[list[Check], dict[str, Any]]:
    """Every check asked for (default: all): (the graded checks, the raw measurements)."""
    known = (*BURN_IN, *gpu_counters.COUNTERS)
    checks = list(known if checks is None else checks)
    unknown = sorted(set(checks) - set(known))
    if unknown or not checks:
        raise ValueError(f"unknown check {unknown[0] if unknown else '(none)'!r}; choose from "
                         f"{', '.join(known)}")
    burn = [c for c in checks if c in BURN_IN]
    measured = measure(burn, ranks, budget_s, device, timeout_s=timeout_s) if burn else {}
    dev = resolve_device(device)
    if baseline is not None:
        expected, source = {k: baseline[k] for k in UNITS if baseline.get(k)}, "baseline"
    else:
        expected, source = table_expectations(dev, ranks), "hardware table"
    result = grade_burn_in(measured, expected, thresholds, source)
    counters = [c for c in checks if c in gpu_counters.COUNTERS]
    if counters:
        result += gpu_counters.run(counters, kernel_log_file=kernel_log)
    return result, measured


def report_rows(checks: Iterable[Check]) -> list[dict[str, Any]]:
    """The checks as table rows: check, status, value, expected, ratio, detail."""
    return [{"check": c.name, "status": c.status.upper(), "value": c.value, "unit": c.unit,
             "expected": c.expected, "ratio": c.ratio, "detail": c.detail} for c in checks]


def as_dict(checks: Iterable[Check]) -> list[dict[str, Any]]:
    return [asdict(c) for c in checks]

