"""The health chapter's planted rank faults, run for real on gloo ranks in one launch (one
start-up for all of them): a bit flip in one replica (`sdc`) and a slow rank (`stragglers`),
each with a clean run beside it; and the stored record of the long version.

`demo` trains the reference model with data parallelism on `ranks` processes three times: clean
with a `ReplicaCheck`; with one bit of one weight flipped on one rank after step `flip_step`; and
with `SlowRank` sleeping in one rank's forward pass during a window of steps, timed by
`StepTimes`. `straggler_sweep` measures what a slow rank costs the job for several delays;
`write_record` stores it with a run of `python -m trainbook health` and its provenance.

Chapter: book/failures/health.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ..bench.gpu_truth import header
from ..bench.gpu_truth import read_record as read_stored
from ..bench.gpu_truth import write_record as write_json
from ..launch import run
from ..train import TrainConfig, train
from .sdc import FlipBit, ReplicaCheck, model_checksums
from .stragglers import SlowRank, StepTimes, stragglers, summary

FLIP_TENSOR = "blocks.0.mlp.up.weight"


def demo_config(steps: int = 12, **overrides: Any) -> TrainConfig:
    """A model small enough that a step on 2 CPU ranks costs milliseconds."""
    base = dict(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32, tokenizer="bytes",
                seq_len=16, batch_size=2, warmup_steps=1, steps=steps, eval_batches=1,
                log_every=0, progress=False, device="cpu")
    return TrainConfig(**{**base, **overrides})


def _flip_runs(cfg: TrainConfig, flip: FlipBit) -> dict[str, Any]:
    clean_check, check = ReplicaCheck(stop=False), ReplicaCheck(stop=False)
    clean = train(cfg, hooks=[clean_check])
    flipped = train(cfg, hooks=[flip, check])
    return {"clean_losses": clean.losses(), "clean_found": clean_check.found,
            "losses": flipped.losses(), "found": check.found,
            "checksums": model_checksums(flipped.model)}


def _slow_run(cfg: TrainConfig, slow: SlowRank) -> list[dict[str, Any]]:
    times = StepTimes()
    train(cfg, hooks=[slow, times])
    return times.rows


def _demo_rank(cfg: TrainConfig, flip: FlipBit, slow_cfg: TrainConfig,
               slow: SlowRank) -> dict[str, Any]:
    return {"sdc": _flip_runs(cfg, flip), "rows": _slow_run(slow_cfg, slow)}


def demo(ranks: int = 2, flip_step: int = 5, flip_rank: int = 1, bit: int = 0,
         slow_rank: int = 1, delay_s: float = 0.05, slow_steps: tuple[int, int] = (11, 20),
         steps: int = 12, straggler_steps: int = 30, timeout_s: float = 240) -> dict[str, Any]:
    """Run both planted faults (see the module doc); rank 0's view of the runs, and each rank's
    final checksums of the flipped run."""
    if ranks < 2:
        raise ValueError(f"the faults are between ranks: ranks must be >= 2, got {ranks}")
    if not (0 <= flip_rank < ranks and 0 <= slow_rank < ranks):
        raise ValueError(f"flip_rank and slow_rank must be in [0, {ranks}), got {flip_rank} "
                         f"and {slow_rank}")
    if not 1 <= flip_step <= steps or slow_steps[1] > straggler_steps:
        raise ValueError(f"flip_step must be in [1, {steps}] and the slow steps within "
                         f"{straggler_steps}, got {flip_step} and {slow_steps}")
    flip = FlipBit(flip_step, flip_rank, FLIP_TENSOR, index=0, bit=bit)
    slow = SlowRank(slow_rank, delay_s, *slow_steps)
    out = run(_demo_rank, ranks, args=(demo_config(steps), flip, demo_config(straggler_steps),
                                       slow), timeout_s=timeout_s)
    first = out[0].value
    return {"ranks": ranks, "flip": {"step": flip_step, "rank": flip_rank, "tensor": FLIP_TENSOR,
                                     "bit": bit},
            "slow": {"rank": slow_rank, "delay_s": delay_s, "steps": list(slow_steps)},
            **first["sdc"], "rank_checksums": [r.value["sdc"]["checksums"][FLIP_TENSOR]
                                               for r in out],
            "rows": first["rows"]}


def _sweep_rank(cfg: TrainConfig, slow_rank: int, delays: Sequence[float]) -> list[dict]:
    _slow_run(cfg, SlowRank(slow_rank, 0.0))  # a discarded run: the first pays the warm-up
    return [_slow_run(cfg, SlowRank(slow_rank, d, first=2)) for d in delays]


def straggler_sweep(delays: Sequence[float] = (0.0, 0.01, 0.025, 0.05, 0.1), ranks: int = 2,
                    slow_rank: int = 1, steps: int = 40,
                    timeout_s: float = 600) -> list[dict[str, Any]]:
    """For each delay: every rank's median forward and step time with rank `slow_rank` slowed
    from step 2 on, and the ranks `stragglers` names."""
    if ranks < 2 or not delays or min(delays) < 0:
        raise ValueError(f"need ranks >= 2 and delays >= 0, got {ranks} and {list(delays)}")
    out = run(_sweep_rank, ranks, args=(demo_config(steps), slow_rank, list(delays)),
              timeout_s=timeout_s)
    rows = []
    for delay, runs in zip(delays, out[0].value):
        per_rank = summary(runs, (3, steps))
        rows.append({"delay_s": delay, "per_rank": per_rank,
                     "step_s": max(r["step_s"] for r in per_rank),
                     "flagged": [s["rank"] for s in stragglers(runs, steps=(3, steps))]})
    return rows


def write_record(path: str | Path, delays: Sequence[float] = (0.0, 0.01, 0.025, 0.05, 0.1),
                 steps: int = 40) -> Path:
    """Run `python -m trainbook health --json` and `straggler_sweep`; store both as JSON with
    the command, date, versions and machine."""
    path = Path(path)
    command = ("python -c \"from trainbook.failures import rank_faults; rank_faults."
               f"write_record({str(path)!r}, delays={list(delays)}, steps={steps})\"")
    record = header("health-cpu", command, torch.device("cpu"), "small")
    health_cmd = [sys.executable, "-m", "trainbook", "health", "--json", "--threads", "1"]
    r = subprocess.run(health_cmd, capture_output=True, text=True, timeout=600)
    if r.returncode not in (0, 1):
        raise RuntimeError(f"health failed (exit {r.returncode}): {r.stderr[-2000:]}")
    record["health"] = {"command": "python -m trainbook health --json --threads 1",
                        "exit_status": r.returncode, **json.loads(r.stdout)}
    record["straggler_sweep"] = {"config": asdict(demo_config(steps)), "slow_rank": 1,
                                 "rows": straggler_sweep(delays, steps=steps)}
    return write_json(path.parent, path.stem, record)


def read_record(path: str | Path) -> dict[str, Any]:
    """A record `write_record` stored."""
    record = read_stored(path, "health-cpu", "rank_faults.write_record")
    return record

