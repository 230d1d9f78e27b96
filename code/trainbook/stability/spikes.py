"""Loss spikes on the training stream: a planted bad-data stretch, the spike detector, and
PaLM's restart-and-skip recipe as a driver over the trainer.

`planted_corpus` writes the shipped corpus with the blocks that the loader serves at chosen
steps replaced by junk (random characters, or one short string repeated), so a spike happens at
a known step of a seeded run. `detector_trial` trains healthy and planted runs with the
trainer's `SpikeMonitor` recording loss and update-norm z-scores; `detector_table` replays the
recorded streams through the monitor (`trainbook.train.monitor.replay`) at several thresholds:
false alarms on healthy runs against detections of the planted stretch. `restart_and_skip`
runs the trainer with checkpoints and a monitor that stops at a spike, then resumes from a
checkpoint before it with the following batches skipped (`--skip-batches`), as PaLM did
(Chowdhery et al. 2022, Section 5.1). `write_detector` stores a detector trial with its
provenance.

Chapter: book/stability/loss-spikes.
"""

from __future__ import annotations

import random
import string
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from ..bench.gpu_truth import header, write_record
from ..bench.gpu_truth import read_record as read_stored
from ..data import load_corpus
from ..launch import resolve_device
from ..pretrain.schedules import quiet, scratch_dir
from ..train import TrainConfig, TrainResult, checkpoint_path, load_checkpoint, train
from ..train.config import parse_skips
from ..train.hooks import Hook
from ..train.monitor import SpikeMonitor, replay
from .instability import call_command, proxy_config

JUNK = ("random", "repeat")
MONITOR_DEFAULTS = {"window": 50, "threshold": 6.0, "warmup": 20, "min_history": 10}


def blocks_at_steps(first: int, last: int, n_blocks: int, batch_size: int, seed: int,
                    per_step: int | None = None) -> list[int]:
    """The training blocks that a one-process ShardedLoader (batch_size, seed) serves at the
    1-based steps first..last of its first epoch: the first `per_step` rows of each step's
    batch (all of them by default)."""
    per_epoch = n_blocks // batch_size
    if not 1 <= first <= last <= per_epoch:
        raise ValueError(f"steps {first}-{last} must lie in the first epoch: 1 <= first <= last "
                         f"<= {per_epoch} ({n_blocks} blocks of batch {batch_size})")
    per_step = batch_size if per_step is None else per_step
    if not 1 <= per_step <= batch_size:
        raise ValueError(f"per_step must be in [1, batch_size={batch_size}], got {per_step}")
    g = torch.Generator().manual_seed(seed * 1_000_003)  # ShardedLoader._order(epoch 0)
    order = torch.randperm(n_blocks, generator=g)
    return [int(order[(s - 1) * batch_size + r]) for s in range(first, last + 1)
            for r in range(per_step)]


def junk_text(kind: str, n: int, rng: random.Random) -> str:
    """n characters of junk: 'random' (uniform over printable ASCII letters, digits and
    punctuation) or 'repeat' (one random 8-character string repeated throughout)."""
    if kind not in JUNK:
        raise ValueError(f"junk kind must be one of {', '.join(JUNK)}, got {kind!r}")
    alphabet = string.ascii_letters + string.digits + string.punctuation
    if kind == "random":
        return "".join(rng.choice(alphabet) for _ in range(n))
    unit = "".join(rng.choice(alphabet) for _ in range(8))
    return (unit * (n // 8 + 1))[:n]


def planted_corpus(path: str | Path, first: int, last: int, seq_len: int, batch_size: int,
                   seed: int = 0, kind: str = "random", per_step: int | None = None,
                   corpus: str = "tinyshakespeare") -> Path:
    """Write `corpus` (ASCII) to `path` with the blocks that the trainer's loader serves at
    steps first..last (bytes tokenizer, one process, this seq_len, batch_size and seed; the
    first `per_step` sequences of each batch, all by default) replaced by junk of `kind`; the
    validation split and every other block are unchanged. Returns the path, for --corpus."""
    text = load_corpus(corpus)
    if not text.isascii():
        raise ValueError(f"corpus {corpus} is not ASCII: its characters and bytes-tokenizer "
                         "tokens would not line up; give an ASCII text")
    cut = int(len(text) * 0.9)  # build_dataset's train/validation split
    n_blocks = (cut - 1) // seq_len  # data.pack on the train part, one byte per token
    chars = list(text)
    blocks = blocks_at_steps(first, last, n_blocks, batch_size, seed, per_step)
    n = seq_len + 1  # a block's tokens: inputs and shifted targets
    junk = junk_text(kind, len(blocks) * n, random.Random(seed))
    for i, b in enumerate(blocks):
        chars[b * seq_len:b * seq_len + n] = junk[i * n:(i + 1) * n]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(chars), encoding="utf-8")
    return path


def monitored_run(cfg: TrainConfig, monitor: SpikeMonitor | None = None,
                  hooks: Sequence[Hook] = ()) -> TrainResult:
    """Train quietly with a SpikeMonitor as a hook (by default one that records every step's
    loss, update norm and z-scores and flags at the trainer's default threshold)."""
    with quiet():
        return train(cfg, hooks=[monitor or SpikeMonitor(**MONITOR_DEFAULTS), *hooks])


def detector_trial(seeds: Sequence[int], first: int, last: int, kind: str = "random",
                   per_step: int | None = None, workdir: str | Path | None = None,
                   **overrides: Any
                   ) -> dict[str, dict[int, list[dict]]]:
    """For each seed: a healthy run and a run whose steps first..last train on junk (`kind`),
    (`per_step` sequences of each batch: all by default), both of the proxy with `overrides`,
    recorded by a SpikeMonitor. Returns {'healthy': {seed:
    rows}, 'planted': {seed: rows}}, each row step, loss, grad_norm and update_norm."""
    if len(seeds) == 0:
        raise ValueError("detector_trial needs at least one seed")
    out: dict[str, dict[int, list[dict]]] = {"healthy": {}, "planted": {}}
    keys = ("step", "loss", "grad_norm", "update_norm")
    with tempfile.TemporaryDirectory(dir=workdir or scratch_dir()) as tmp:
        for seed in seeds:
            cfg = proxy_config(**{**overrides, "seed": seed})
            if last > cfg.steps:
                raise ValueError(f"the planted steps {first}-{last} must end within the run's "
                                 f"{cfg.steps} steps")
            bad = planted_corpus(Path(tmp) / f"planted-{seed}.txt", first, last, cfg.seq_len,
                                 cfg.batch_size, seed, kind, per_step)
            for name, c in (("healthy", cfg), ("planted", replace(cfg, corpus=str(bad)))):
                rows = monitored_run(c).history
                out[name][seed] = [{k: r[k] for k in keys} for r in rows]
    return out


def detector_table(trial: dict[str, dict[int, list[dict]]], first: int, last: int,
                   thresholds: Sequence[float], **monitor: float) -> pd.DataFrame:
    """Replay a detector_trial through SpikeMonitor at each threshold (other settings: the
    trainer's defaults, or `monitor`). Per threshold: false alarms per 1,000 scored steps on
    the healthy runs; the share of planted runs flagged within steps first..last, and the
    median delay from `first` to the first flag; false alarms on the planted runs before
    `first`."""
    if len(thresholds) == 0 or min(thresholds) <= 0:
        raise ValueError(f"thresholds must be positive, got {list(thresholds)}")
    settings = {**MONITOR_DEFAULTS, **monitor}
    start = max(settings["warmup"], settings["min_history"])
    rows = []
    for thr in thresholds:
        s = {**settings, "threshold": thr}
        alarms = scored = 0
        for h in trial["healthy"].values():
            alarms += len(replay(h, **s))
            scored += sum(1 for r in h if r["step"] > start)
        delays, early = [], 0
        for h in trial["planted"].values():
            flags = replay(h, **s)
            early += sum(1 for f in flags if f < first)
            hits = [f for f in flags if first <= f <= last]
            if hits:
                delays.append(hits[0] - first)
        n = len(trial["planted"])
        rows.append({"threshold": thr, "false_alarms_per_1k": 1000 * alarms / max(scored, 1),
                     "healthy_alarms": alarms, "detected": len(delays) / n if n else float("nan"),
                     "median_delay": float(pd.Series(delays).median()) if delays else float("nan"),
                     "early_alarms": early})
    return pd.DataFrame(rows)


@dataclass
class Restart:
    """One restart: the spike's step, the checkpoint resumed from, the steps whose batches
    were skipped (None: none skipped)."""

    spike_step: int
    checkpoint_step: int
    skipped: tuple[int, int] | None


@dataclass
class Recovery:
    """What restart_and_skip did: the final run (its history stitched from the checkpoints),
    every attempt's history (the abandoned ones end at their spike), the restarts, and the
    steps computed in all (recomputed steps included)."""

    result: TrainResult
    attempts: list[list[dict]]
    restarts: list[Restart] = field(default_factory=list)
    steps_computed: int = 0


def _skips_text(ranges: list[tuple[int, int]]) -> str:
    return ",".join(f"{a}-{b}" for a, b in ranges)


def restart_and_skip(cfg: TrainConfig, ckpt_every: int = 10, rewind: int = 10, skip: int = 40,
                     max_restarts: int = 2, workdir: str | Path | None = None,
                     monitor: dict[str, float] | None = None,
                     hooks: Sequence[Hook] = ()) -> Recovery:
    """PaLM's recipe as a driver: train `cfg` with a checkpoint every `ckpt_every` steps and a
    SpikeMonitor that stops the run at a spike; resume from the newest checkpoint at least
    `rewind` steps before the spike (and after any earlier skip) with the batches of the next
    `skip` steps skipped (skip 0: resume on the same batches); at most `max_restarts` times,
    after which the monitor only records. Checkpoints go to `workdir` (a temporary folder in
    memory-backed storage by default); `hooks` run in every attempt, after the monitor."""
    if ckpt_every < 1 or rewind < 0 or skip < 0 or max_restarts < 0:
        raise ValueError(f"need ckpt_every >= 1 and rewind, skip, max_restarts >= 0, got "
                         f"{ckpt_every}, {rewind}, {skip}, {max_restarts}")
    settings = {**MONITOR_DEFAULTS, **(monitor or {})}
    ranges = parse_skips(cfg.skip_batches)
    with tempfile.TemporaryDirectory(dir=workdir or scratch_dir()) as tmp:
        attempts, restarts, computed, resume = [], [], 0, None
        while True:
            stop = len(restarts) < max_restarts
            mon = SpikeMonitor(**settings, stop=stop)
            start = 0
            if resume is not None:
                state = load_checkpoint(resume)
                mon.prime(state["history"])
                start = state["step"]
            run_cfg = replace(cfg, ckpt_dir=tmp, ckpt_every=ckpt_every, resume=False,
                              resume_from=str(resume) if resume else None,
                              skip_batches=_skips_text(ranges))
            res = monitored_run(run_cfg, mon, hooks)
            attempts.append(res.history)
            computed += len(res.history) - start
            if not res.stopped or not stop:
                return Recovery(res, attempts, restarts, computed)
            spike = len(res.history)
            floor = ranges[-1][1] if ranges else 0
            saved = [s for s in range(ckpt_every, spike, ckpt_every)
                     if s >= floor and checkpoint_path(tmp, s).is_file()]
            before = [s for s in saved if s <= spike - rewind] or saved[:1]
            if not before:
                raise ValueError(f"no checkpoint between the last skip (step {floor}) and the "
                                 f"spike at step {spike}: checkpoint more often than every "
                                 f"{ckpt_every} steps")
            back = before[-1]
            skipped = (back + 1, back + skip) if skip else None
            if skipped:
                ranges.append(skipped)
            restarts.append(Restart(spike, back, skipped))
            resume = checkpoint_path(tmp, back)


def _columns(rows: list[dict]) -> dict[str, list]:
    """Rows of a run as columns, floats to 6 significant digits (a compact, exact-enough file)."""
    return {k: [float(f"{r[k]:.6g}") if isinstance(r[k], float) else r[k] for r in rows]
            for k in rows[0]}


def write_detector(path: str | Path, seeds: Sequence[int] = (0, 1, 2, 3, 4, 5, 6, 7),
                   first: int = 150, last: int = 160, kind: str = "random",
                   per_step: int | None = 1, **overrides: Any) -> Path:
    """Run detector_trial and store it as JSON with its provenance (command, date, versions,
    machine)."""
    cfg = proxy_config(**overrides)
    command = call_command(write_detector, str(path), seeds=list(seeds), first=first, last=last,
                           kind=kind, per_step=per_step, **overrides)
    trial = detector_trial(seeds, first, last, kind, per_step, **overrides)
    record = header("spikes-detector", command, resolve_device(cfg.device, 0), "small")
    record.update(config={k: v for k, v in vars(cfg).items()
                          if isinstance(v, (int, float, str, bool))},
                  seeds=list(seeds), first=first, last=last, kind=kind, per_step=per_step,
                  monitor_defaults=MONITOR_DEFAULTS,
                  runs={name: {str(s): _columns(rows) for s, rows in runs.items()}
                        for name, runs in trial.items()})
    path = Path(path)
    return write_record(path.parent, path.stem, record)


def read_detector(path: str | Path) -> tuple[dict, dict[str, dict[int, list[dict]]]]:
    """(record, trial) from a file write_detector wrote; trial as detector_trial returns it."""
    record = read_stored(path, "spikes-detector", "spikes.write_detector")
    trial = {name: {int(s): [dict(zip(cols, vals)) for vals in zip(*cols.values())]
                    for s, cols in runs.items()}
             for name, runs in record["runs"].items()}
    return record, trial
