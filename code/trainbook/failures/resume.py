"""Exact resume: SIGKILL the trainer at chosen or random moments, restart it with `--resume`
until it finishes, and compare the stitched run with an uninterrupted one, step by step.

`run_with_kills` runs `python -m trainbook train ... --ckpt-dir D --ckpt-every k --resume` (or
the same under `torchrun --standalone --nproc_per_node N`: a kill takes agent and workers, as a
node failure does) and sends SIGKILL when a `Kill` fires: after a given step is logged
('step'), a delay after training started ('time'), while a checkpoint file is being written
('write': TRAINBOOK_CKPT_WRITE_MBPS slows the write, the kill waits for a temporary file this
attempt writes; one a killed attempt left behind does not count), or
between two micro-batches of gradient accumulation on a chosen rank ('accum': a hook in the
worker kills its own process). With `--monitor fingerprint` every history row holds a digest of
the parameters, so `first_divergence` finds the first step where two runs differ. `campaign`
draws random kills; `write_campaign` stores one with its provenance.
The worker for 'accum' kills and torchrun launches is `python -m trainbook.commands._resume_worker`
(a program, so it lives with the commands; not a command readers use).

Chapter: book/failures/exact-resume.
"""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..bench.gpu_truth import read_record as read_stored
from ..train import TrainConfig
from ..train.checkpoint import RATE_ENV
from ..train.hooks import Batches, Hook

KINDS = ("step", "time", "write", "accum")
TIME_KILL_STEPS = 3  # a campaign's 'time' kills fall within this many steps of training
EXACT_KEYS = ("loss", "grad_norm", "lr", "fp_sum", "fp_sumsq", "fp_hash")


@dataclass(frozen=True)
class Kill:
    """When to SIGKILL a run: kind 'step' (right after step `at` is logged), 'time' (`at`
    seconds after the first step is logged), 'write' (while a checkpoint is being written) or
    'accum' (inside step `at`, after `micro` of its micro-batches, on `rank`). A run that
    resumed past `at` is killed at its first step."""

    kind: str
    at: float = 1
    micro: int = 1
    rank: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kill kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not self.at >= 0 or self.micro < 1 or self.rank < 0:
            raise ValueError(f"need at >= 0, micro >= 1 and rank >= 0, got {self}")


@dataclass
class Attempt:
    """One launch: its planned kill (None: none), whether it fired, exit status, the step it
    resumed from, the last step it logged, seconds, half-written files it left behind."""

    kill: Kill | None
    fired: bool
    returncode: int | None
    resumed_from: int
    last_logged: int
    seconds: float
    left_tmp: list[str] = field(default_factory=list)


@dataclass
class Result:
    """A run stitched from its attempts: the final history and every attempt."""
    history: list[dict]
    attempts: list[Attempt] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"history": self.history, "attempts": [asdict(a) for a in self.attempts]}


class KillAt(Hook):
    """SIGKILL this process inside step `step` (1-based; a run resumed past it: its first
    step), after `micro` of its micro-batches have run forward and backward: the accumulated
    gradients die with it. Only on `rank`."""

    def __init__(self, step: int, micro: int, rank: int = 0):
        self.step, self.micro, self.rank = step, micro, rank

    def on_batches(self, step: int, batches: Batches) -> Batches | None:
        here = dist.get_rank() if dist.is_initialized() else 0
        if step < self.step or here != self.rank:
            return None
        if not 1 <= self.micro < len(batches):
            raise ValueError(f"micro must be in [1, {len(batches) - 1}] to land between "
                             f"micro-batches of a {len(batches)}-micro-batch step")
        return _Dying(batches, self.micro)


class _Dying(list):
    """The step's micro-batches; iterating past the first `n` kills the process."""

    def __init__(self, batches: Batches, n: int):
        super().__init__(batches)
        self.n = n

    def __iter__(self):
        for i, item in enumerate(list.__iter__(self)):
            if i == self.n:
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            yield item


def flags(cfg: TrainConfig) -> list[str]:
    """The `python -m trainbook train` options that give `cfg` (defaults left out)."""
    out = []
    for k, v in asdict(cfg).items():
        if v == getattr(TrainConfig, k, None) or v is None:
            continue
        flag = "--" + k.replace("_", "-")
        out += [flag] if v is True else [f"--no-{flag[2:]}"] if v is False else [flag, str(v)]
    return out


def _command(cfg: TrainConfig, nprocs: int, kill: Kill | None, workdir: Path,
             out: Path) -> list[str]:
    """One process: `python -m trainbook train`. Under torchrun, or for an 'accum' kill, the
    worker of this module: the same train() with the configuration as JSON, because torchrun
    (torch 2.13, Python 3.11) rejects `--monitor` among the script's arguments as an
    ambiguous abbreviation of its own --monitor-interval."""
    launcher = [sys.executable, "-u"] if nprocs == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc_per_node={nprocs}"]
    accum = kill is not None and kill.kind == "accum"
    if nprocs == 1 and not accum:
        return [*launcher, "-m", "trainbook", "train", *flags(cfg), "--json-out", str(out)]
    (workdir / "config.json").write_text(json.dumps(asdict(cfg)))
    killing = ["--kill-at", f"{int(kill.at)}:{kill.micro}", "--kill-rank", str(kill.rank)] \
        if accum else []
    return [*launcher, "-m", "trainbook.commands._resume_worker", "--config",
            str(workdir / "config.json"), *killing, "--json-out", str(out)]


def job_pids(root: int) -> list[int]:
    """`root` and every process descended from it (Linux /proc): a torchrun job's agent and
    its workers, which torchrun starts in sessions of their own, so a signal to the agent's
    process group does not reach them."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def kill_job(root: int) -> None:
    """SIGKILL a job's processes (job_pids), workers first, as when its node loses power."""
    for pid in reversed(job_pids(root)):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _reader(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def _temporary_files(ckpt_dir: str) -> dict[Path, tuple[int, int]]:
    """Each half-written checkpoint file with its (mtime, size): a 'write' kill fires on a file
    this attempt writes, not on one a killed attempt left behind (same name included)."""
    found = {}
    for p in Path(ckpt_dir).glob("step-*.tmp"):
        try:
            st = p.stat()
        except FileNotFoundError:  # renamed into place between glob and stat
            continue
        found[p] = (st.st_mtime_ns, st.st_size)
    return found


def _launch(cfg: TrainConfig, nprocs: int, kill: Kill | None, workdir: Path,
            timeout_s: float, rate_mbps: float) -> tuple[Attempt, Path]:
    out = workdir / "run.json"
    out.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", RATE_ENV)}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if kill is not None and kill.kind == "write":
        env[RATE_ENV] = str(rate_mbps)
    stale = _temporary_files(cfg.ckpt_dir)
    t0 = time.monotonic()
    proc = subprocess.Popen(_command(cfg, nprocs, kill, workdir, out), stdout=subprocess.PIPE,
                            stderr=open(workdir / "stderr.txt", "a"), text=True, cwd=workdir,
                            env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(proc.stdout, lines), daemon=True).start()
    fired, resumed, last, started = False, 0, 0, None
    try:
        while True:
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"the trainer did not finish in {timeout_s:.0f} s "
                                   f"(see {workdir / 'stderr.txt'})")
            try:
                line = lines.get(timeout=0.005)
            except queue.Empty:
                line = ""
            if line is None:  # stdout closed: the run ended
                break
            if line.startswith("resumed from"):
                resumed = int(line.rsplit(" ", 1)[1])
            if line.startswith("step"):
                last = int(line.split()[1])
                started = started or time.monotonic()
            if kill is None or fired or kill.kind == "accum":
                continue
            hit = (kill.kind == "step" and last >= kill.at) or \
                (kill.kind == "time" and started and time.monotonic() - started >= kill.at) or \
                (kill.kind == "write" and any(stale.get(p) != s for p, s in
                                          _temporary_files(cfg.ckpt_dir).items()))
            if hit:
                kill_job(proc.pid)  # the whole job, as when a node dies
                fired = True
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            kill_job(proc.pid)
            proc.wait()
        proc.stdout.close()
    if kill is not None and kill.kind == "accum":
        fired = proc.returncode != 0
    left = sorted(p.name for p in _temporary_files(cfg.ckpt_dir))
    return Attempt(kill, fired, proc.returncode, resumed, last, time.monotonic() - t0,
                   left), out


def run_with_kills(cfg: TrainConfig, kills: list[Kill], nprocs: int = 1,
                   workdir: str | Path | None = None, timeout_s: float = 300,
                   rate_mbps: float = 1.0) -> Result:
    """Run `cfg` (with ckpt_dir and ckpt_every) to the end through the kills in order,
    restarting with --resume after each; the final history and every attempt. The trainer
    records a parameter fingerprint every step (`--monitor fingerprint`)."""
    import tempfile

    if not cfg.ckpt_dir or not cfg.ckpt_every:
        raise ValueError("run_with_kills needs a config with ckpt_dir and ckpt_every: a run "
                         "without checkpoints restarts from scratch")
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    for k in kills:
        if k.kind == "accum" and not 1 <= k.micro < cfg.grad_accum:
            raise ValueError(f"an 'accum' kill needs grad_accum > micro: got grad_accum "
                             f"{cfg.grad_accum}, micro {k.micro}")
        if k.rank >= nprocs:
            raise ValueError(f"kill rank {k.rank} does not exist in {nprocs} ranks")
    monitors = ",".join(dict.fromkeys([m for m in cfg.monitor.split(",") if m] +
                                      ["fingerprint"]))
    cfg = replace(cfg, resume=True, monitor=monitors, log_every=1, progress=False)
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        attempts = []
        for kill in [*kills, None]:
            attempt, out = _launch(cfg, nprocs, kill, Path(tmp), timeout_s, rate_mbps)
            attempts.append(attempt)
            if attempt.returncode == 0:
                history = json.loads(out.read_text())["history"]
                return Result(history, attempts)
            if not attempt.fired:
                err = (Path(tmp) / "stderr.txt").read_text()[-2000:]
                raise RuntimeError(f"the trainer failed without being killed (exit "
                                   f"{attempt.returncode}):\n{err}")
        raise RuntimeError(f"the run did not finish after {len(kills)} kills and a last "
                           "attempt without one")


def first_divergence(a: list[dict], b: list[dict],
                     keys: tuple[str, ...] = EXACT_KEYS) -> dict | None:
    """The first step where two histories differ in any of `keys` present in both (bit for
    bit), or where one ends; None if they are the same."""
    for ra, rb in zip(a, b):
        for k in keys:
            if k in ra and k in rb and ra[k] != rb[k]:
                return {"step": ra["step"], "key": k, "a": ra[k], "b": rb[k]}
    if len(a) != len(b):
        return {"step": min(len(a), len(b)) + 1, "key": "length", "a": len(a), "b": len(b)}
    return None


def random_kills(n: int, steps: int, grad_accum: int, nprocs: int = 1, seed: int = 0,
                 kinds: tuple[str, ...] = KINDS, max_delay_s: float = 0.5) -> list[Kill]:
    """`n` kills at random moments of a `steps`-step run: kinds drawn from `kinds`; 'step' and
    'accum' at increasing random steps in the first four fifths of the run (so each lands
    after the previous restart and the run outlives them all), 'time' a random delay up to
    `max_delay_s`, 'accum' a random micro-batch and rank."""
    first = max(1, steps - steps // 5)
    if n < 1 or first < n + 1:
        raise ValueError(f"need 1 <= n and n + 1 <= four fifths of the steps, got n={n}, "
                         f"steps={steps}")
    if "accum" in kinds and grad_accum < 2:
        raise ValueError("'accum' kills need grad_accum >= 2")
    rng = random.Random(seed)
    at = sorted(rng.sample(range(1, first), n))
    out = []
    for s in at:
        kind = rng.choice(kinds)
        if kind == "time":
            out.append(Kill("time", round(rng.uniform(0, max_delay_s), 3)))
        elif kind == "accum":
            out.append(Kill("accum", s + 1, rng.randrange(1, grad_accum),
                            rng.randrange(nprocs)))
        else:
            out.append(Kill(kind, s))
    return out


def reference(cfg: TrainConfig, nprocs: int = 1, workdir: str | Path | None = None,
              timeout_s: float = 300) -> list[dict]:
    """The uninterrupted run of `cfg` (fingerprinted), launched as run_with_kills launches."""
    return run_with_kills(cfg, [], nprocs, workdir, timeout_s).history


def campaign(cfg: TrainConfig, n_kills: int, nprocs: int = 1, seed: int = 0,
             workdir: str | Path | None = None, timeout_s: float = 300) -> dict:
    """Random kills (random_kills) through a whole run, and the uninterrupted run to compare:
    the attempts, the first divergence (None: bit for bit) and the histories. A 'time' kill
    waits up to TIME_KILL_STEPS of the uninterrupted run's median step time: a fixed delay in
    seconds is a few steps on a loaded CPU and tens on an idle one (0.3 s was 22 steps), and
    then the restarted run is already past the 'step' and 'accum' kills drawn after it."""
    whole = reference(replace(cfg, ckpt_dir=str(Path(cfg.ckpt_dir) / "whole")), nprocs,
                      workdir, timeout_s)
    step_s = statistics.median(row["step_time_s"] for row in whole)
    kills = random_kills(n_kills, cfg.steps, cfg.grad_accum, nprocs, seed,
                         max_delay_s=TIME_KILL_STEPS * step_s)
    killed = run_with_kills(replace(cfg, ckpt_dir=str(Path(cfg.ckpt_dir) / "killed")), kills,
                            nprocs, workdir, timeout_s)
    return {"nprocs": nprocs, "seed": seed, "kills": [asdict(k) for k in kills],
            "attempts": [asdict(a) for a in killed.attempts],
            "divergence": first_divergence(killed.history, whole), "steps": len(whole),
            "history": killed.history, "reference": whole}


def write_campaign(path: str | Path, n_kills: int = 20, nprocs: tuple[int, ...] = (1, 2),
                   seed: int = 0, **overrides: Any) -> Path:
    """Run a campaign for each process count and store them (JSON) with the command, date,
    versions and machine: book/failures/data/exact-resume-campaign.json."""
    import tempfile

    import torch

    from ..bench.gpu_truth import header, write_record

    kw = {**CAMPAIGN, **overrides}
    args = ", ".join([repr(str(path)), f"n_kills={n_kills}", f"nprocs={nprocs!r}",
                      f"seed={seed}"] + [f"{k}={v!r}" for k, v in overrides.items()])
    command = f'python -c "from trainbook.failures import resume; resume.write_campaign({args})"'
    record = header("exact-resume-campaign", command, torch.device("cpu"), "small")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in nprocs:
            cfg = TrainConfig(**{**kw, "ckpt_dir": str(Path(tmp) / f"ranks{n}")})
            runs.append(campaign(cfg, n_kills, n, seed + n, tmp))
    record.update(config=kw, runs=runs)
    path = Path(path)
    return write_record(path.parent, path.stem, record)


# The stored campaign's run: 2 layers on bytes, grad accumulation 4, a checkpoint every 3 steps.
CAMPAIGN = dict(model="tiny-llama", tokenizer="bytes", d_model=32, n_layers=2, n_heads=2,
                n_kv_heads=2, d_ff=64, seq_len=32, batch_size=2, grad_accum=4, steps=120,
                warmup_steps=4, ckpt_every=3, keep_last=2, eval_batches=1, device="cpu")


def read_campaign(path: str | Path) -> dict:
    """A record written by write_campaign."""
    record = read_stored(path, "exact-resume-campaign", "resume.write_campaign")
    return record
