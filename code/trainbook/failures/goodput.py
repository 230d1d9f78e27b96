"""Goodput under failures, measured: the trainer killed at random times and restarted, against
the Young/Daly model of book/compute/cost.

`run_under_failures` runs `python -m trainbook train` with checkpoints every k steps and
`--resume`, draws the time to the next failure from an exponential distribution of mean M (the
MTBF), SIGKILLs the process when it comes, restarts it, and repeats until the run has trained all
its steps. Every step line is timestamped, so the wall-clock time splits into useful steps,
checkpoint writes, start-ups and recomputed work (`account`), and the same lines measure the
model's inputs (`costs_of`): the step time s, the checkpoint time delta and the restart time R.
`sweep` runs several checkpoint intervals against the same failure traces (common random
numbers: the intervals differ, the failures do not); `write_sweep`/`read_sweep` store it with
its provenance; `model_rows` gives the model's expected wall time for the same intervals
(`trainbook.compute.cost.expected_wall_seconds`) and Young's and Daly's optimum.

The failure clock starts when the first step's line appears and the run ends with its last step's
line: the first start-up and the final evaluation are the same for every interval and are not
part of the model. Work W is (steps - 1) * s.

Chapter: book/failures/fault-tolerance.
"""

from __future__ import annotations

import math
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..bench.gpu_truth import read_record as read_stored
from ..compute import cost

# A model whose state is large for its compute, so that a checkpoint costs several steps (as it
# does at scale), and a step some tens of milliseconds on one CPU thread.
MODEL = ["--d-model", "384", "--n-layers", "2", "--n-heads", "4", "--n-kv-heads", "4",
         "--d-ff", "1024", "--tokenizer", "bytes", "--seq-len", "32", "--batch-size", "2",
         "--warmup-steps", "10", "--eval-batches", "1", "--log-every", "1", "--no-progress"]
STEP = re.compile(r"step\s+(\d+) \| loss (\S+)")


@dataclass
class Attempt:
    """One process of a run: its start and end (seconds on the run's clock), the steps it
    logged with their times and losses, the step it resumed from, whether it was killed."""

    started: float
    ended: float
    steps: list[tuple[int, float, float]]  # (step, time, loss)
    resumed_from: int
    killed: bool


def _env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TORCHELASTIC_RUN_ID", None)
    return env


def attempt(argv: list[str], clock0: float, gap_s: float | None, from_first_step: bool = False,
            timeout_s: float = 600) -> Attempt:
    """Run the trainer once; SIGKILL it `gap_s` seconds after its start (or after its first
    step's line, `from_first_step`), or never (None). Step lines are timestamped on the clock
    that started at `clock0` (time.monotonic())."""
    started = time.monotonic() - clock0
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=_env())
    steps: list[tuple[int, float, float]] = []
    resumed, first = [0], threading.Event()

    def read():
        for line in proc.stdout:
            m = STEP.match(line)
            if m:
                steps.append((int(m.group(1)), time.monotonic() - clock0, float(m.group(2))))
                first.set()
            elif line.startswith("resumed from"):
                resumed[0] = int(line.rsplit(" ", 1)[1])
        first.set()  # the output ended

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    killed = False
    try:
        deadline = time.monotonic() + timeout_s
        if gap_s is not None and from_first_step:
            first.wait(timeout=timeout_s)
        fail_at = math.inf if gap_s is None else time.monotonic() + gap_s
        while proc.poll() is None:
            now = time.monotonic()
            if now >= fail_at:
                proc.send_signal(signal.SIGKILL)
                killed = True
                break
            if now >= deadline:
                raise TimeoutError(f"the trainer ran longer than {timeout_s:.0f} s")
            time.sleep(min(0.01, max(0.0, fail_at - now)))
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    reader.join(timeout=10)
    if not killed and proc.returncode != 0:
        raise RuntimeError(f"the trainer failed (exit {proc.returncode}); run "
                           f"{' '.join(argv)} by hand to see why")
    return Attempt(started, time.monotonic() - clock0, steps, resumed[0], killed)


def trainer_argv(workdir: str | os.PathLike, steps: int, ckpt_every: int = 0,
                 extra: Sequence[str] = ()) -> list[str]:
    """`python -u -m trainbook train` with the chapter's MODEL, checkpoints every `ckpt_every`
    steps in <workdir>/ckpt (the newest two kept) and --resume; no checkpoints for 0."""
    workdir = Path(workdir).resolve()
    ckpt = ["--ckpt-dir", str(workdir / "ckpt"), "--ckpt-every", str(ckpt_every), "--resume",
            "--keep-last", "2"] if ckpt_every else []
    return [sys.executable, "-u", "-m", "trainbook", "train", *MODEL, *extra, "--steps",
            str(steps), "--cache-dir", str(workdir / "cache"), *ckpt]


def _check(steps: int, ckpt_every: int, mtbf_s: float) -> None:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise ValueError(f"steps must be an integer >= 2, got {steps!r}")
    if isinstance(ckpt_every, bool) or not isinstance(ckpt_every, int) \
            or not 0 < ckpt_every <= steps:
        raise ValueError(f"ckpt_every must be an integer in [1, steps={steps}], "
                         f"got {ckpt_every!r}")
    if not (isinstance(mtbf_s, int | float) and math.isfinite(mtbf_s) and mtbf_s > 0):
        raise ValueError(f"mtbf_s must be a positive number of seconds, got {mtbf_s!r}")


def failure_gaps(mtbf_s: float, seed: int, n: int = 1000) -> list[float]:
    """Seconds between failures: exponential with mean `mtbf_s` (independent failures at a
    constant rate); the same list for the same seed."""
    return np.random.default_rng(seed).exponential(mtbf_s, n).tolist()


def run_under_failures(workdir: str | os.PathLike, steps: int, ckpt_every: int, mtbf_s: float,
                       seed: int = 0, extra: Sequence[str] = (), max_attempts: int = 100,
                       timeout_s: float = 600) -> dict:
    """Train `steps` steps, checkpointing every `ckpt_every`, SIGKILLed after each gap of
    `failure_gaps(mtbf_s, seed)` and restarted with --resume until done (a fresh `workdir`).
    Returns `account` of the attempts, and the attempts."""
    _check(steps, ckpt_every, mtbf_s)
    workdir = Path(workdir).resolve()
    if (workdir / "ckpt").exists() and any((workdir / "ckpt").iterdir()):
        raise ValueError(f"{workdir}/ckpt holds checkpoints of an earlier run; give an empty "
                         "workdir (the run resumes from whatever is there)")
    argv = trainer_argv(workdir, steps, ckpt_every, extra)
    gaps = failure_gaps(mtbf_s, seed, max_attempts)
    clock0 = time.monotonic()
    attempts = [attempt(argv, clock0, gaps[0], from_first_step=True, timeout_s=timeout_s)]
    while attempts[-1].killed:
        if len(attempts) == max_attempts:
            raise RuntimeError(f"{max_attempts} attempts did not finish {steps} steps: the "
                               f"MTBF ({mtbf_s} s) is too short for this interval and restart")
        attempts.append(attempt(argv, clock0, gaps[len(attempts)], timeout_s=timeout_s))
    return {"steps": steps, "ckpt_every": ckpt_every, "mtbf_s": mtbf_s, "seed": seed,
            **account(attempts, steps, ckpt_every),
            "attempts": [timeline(a) for a in attempts]}


def timeline(a: Attempt) -> dict:
    """One attempt in a few numbers: start, end, the first step's line, the steps it trained,
    the step it resumed from, killed or not."""
    first = a.steps[0] if a.steps else None
    return {"started": a.started, "ended": a.ended, "resumed_from": a.resumed_from,
            "first_step": first[0] if first else None, "first_step_at": first[1] if first else None,
            "last_step": a.steps[-1][0] if a.steps else None, "killed": a.killed}


@dataclass(frozen=True)
class Costs:
    """The model's inputs, measured on a run: seconds per step, per checkpoint write (beyond
    the step) and per restart (process start to the first step's line, less one step)."""

    step_s: float
    ckpt_s: float
    restart_s: float | None  # None: the run had no restart that reached a step


def costs_of(attempts: list[Attempt], ckpt_every: int) -> Costs:
    """Medians over the run's own step lines: the gap between consecutive steps of one process
    (s), the extra gap after a checkpoint step (delta), and the restarts' start-up (R)."""
    plain, after = [], []
    for a in attempts:
        for (s0, t0, _), (_, t1, _) in zip(a.steps[1:], a.steps[2:]):  # not the first step
            (after if s0 % ckpt_every == 0 else plain).append(t1 - t0)
    if not plain or not after:
        raise ValueError("the run is too short to measure its costs: it needs steps after at "
                         "least one checkpoint within one process")
    step = statistics.median(plain)
    starts = [a.steps[0][1] - a.started - step for a in attempts[1:] if a.steps]
    return Costs(step, statistics.median(after) - step,
                 statistics.median(starts) if starts else None)


def account(attempts: list[Attempt], steps: int, ckpt_every: int) -> dict:
    """Where the wall-clock time went: `wall_s` from the first step's line to the last one's;
    `failures`; `recomputed_steps` (trained again after a restart); `startup_s`, the time
    restarts spent before their first step's line; `checkpoints` written (attempted); and the
    loss of each step as finally trained."""
    if not attempts or not attempts[0].steps or attempts[-1].killed:
        raise ValueError("account needs a run whose first attempt logged a step and whose last "
                         "attempt finished")
    final = [a for a in attempts if a.steps][-1].steps  # a last attempt may resume at the end
    if final[-1][0] != steps:
        raise ValueError(f"the last attempt ended at step {final[-1][0]}, not {steps}")
    recomputed, startup, last = 0, 0.0, 0
    for prev, cur in zip(attempts, attempts[1:]):
        last = max([last] + [s for s, _, _ in prev.steps])
        recomputed += max(0, last - cur.resumed_from) if cur.steps else 0
        startup += (cur.steps[0][1] if cur.steps else cur.ended) - cur.started
    losses: dict[int, float] = {}
    for a in attempts:
        losses.update({s: loss for s, _, loss in a.steps})
    writes = sum(1 for a in attempts for s, _, _ in a.steps if s % ckpt_every == 0)
    return {"wall_s": final[-1][1] - attempts[0].steps[0][1], "failures": len(attempts) - 1,
            "recomputed_steps": recomputed, "startup_s": startup, "checkpoints": writes,
            "costs": asdict(costs_of(attempts, ckpt_every)),
            "losses": [losses[s] for s in range(1, steps + 1)]}


def pooled_costs(runs: list[dict]) -> Costs:
    """The median of the runs' own measured costs."""
    restarts = [r["costs"]["restart_s"] for r in runs if r["costs"]["restart_s"] is not None]
    if not restarts:
        raise ValueError("no run restarted: the restart time was never measured")
    return Costs(statistics.median(r["costs"]["step_s"] for r in runs),
                 statistics.median(r["costs"]["ckpt_s"] for r in runs),
                 statistics.median(restarts))


def model_rows(costs: Costs, steps: int, intervals: Sequence[int], mtbf_s: float) -> list[dict]:
    """The model's expected wall time of the run for each checkpoint interval (in steps), with
    the measured costs; Young's and Daly's optimal interval, in steps, in every row."""
    if costs.restart_s is None:
        raise ValueError("the costs have no restart time; measure them on a run that restarted")
    work = (steps - 1) * costs.step_s
    young = cost.young_interval(costs.ckpt_s, mtbf_s) / costs.step_s
    daly = cost.daly_interval(costs.ckpt_s, mtbf_s) / costs.step_s
    return [{"ckpt_every": k, "interval_s": k * costs.step_s,
             "model_wall_s": cost.expected_wall_seconds(work, k * costs.step_s, costs.ckpt_s,
                                                        mtbf_s, costs.restart_s),
             "work_s": work, "young_steps": young, "daly_steps": daly} for k in intervals]


def sweep(workdir: str | os.PathLike, steps: int, intervals: Sequence[int], mtbf_s: float,
          seeds: Sequence[int], reference: list[float], extra: Sequence[str] = (),
          progress: bool = False) -> list[dict]:
    """`run_under_failures` for every interval and seed, in an interleaved order (each seed's
    intervals run back to back, so a slow minute of a shared machine hits all of them). Each
    run's losses are compared with `reference` (an uninterrupted run's) and dropped."""
    from tqdm.auto import tqdm

    jobs = [(seed, k) for seed in seeds for k in intervals]
    rows = []
    for seed, k in tqdm(jobs, disable=not progress, desc="runs"):
        run = run_under_failures(Path(workdir) / f"k{k}-s{seed}", steps, k, mtbf_s, seed, extra)
        losses = run.pop("losses")
        rows.append({**run, "final_loss": losses[-1], "losses_equal_reference":
                     losses == reference})
    return rows


def write_sweep(path: str | os.PathLike, steps: int = 900,
                intervals: Sequence[int] = (5, 10, 20, 40, 80, 160), mtbf_s: float = 30.0,
                seeds: Sequence[int] = (0, 1, 2), workdir: str | os.PathLike | None = None
                ) -> Path:
    """Run the sweep and store it with the model's rows (for the median costs measured over
    its runs) and the provenance (command, date, versions, machine) as JSON."""
    import tempfile

    import torch

    from ..bench.gpu_truth import header, write_record

    path = Path(path)
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(workdir or tmp)
        ref = attempt(trainer_argv(base / "reference", steps), time.monotonic(), None)
        reference = [loss for _, _, loss in ref.steps]
        runs = sweep(base / "runs", steps, intervals, mtbf_s, seeds, reference, progress=True)
    costs = pooled_costs(runs)
    args = ", ".join(f"{k}={v!r}" for k, v in (("steps", steps), ("intervals", list(intervals)),
                                              ("mtbf_s", mtbf_s), ("seeds", list(seeds))))
    command = (f'python -c "from trainbook.failures import goodput; '
               f'goodput.write_sweep({str(path)!r}, {args})"')
    record = header("fault-tolerance-goodput", command, torch.device("cpu"), "small")
    record.update(model=MODEL, steps=steps, intervals=list(intervals), mtbf_s=mtbf_s,
                  seeds=list(seeds), costs=asdict(costs), reference_losses=reference,
                  model_rows=model_rows(costs, steps, intervals, mtbf_s), runs=runs)
    return write_record(path.parent, path.stem, record)


def read_sweep(path: str | os.PathLike) -> dict:
    """A record `write_sweep` stored."""
    record = read_stored(path, "fault-tolerance-goodput", "goodput.write_sweep")
    return record


def summarize(record: dict) -> list[dict]:
    """One row per interval of a stored sweep: the measured wall time (mean over the seeds and
    its standard error), failures, recomputed steps and checkpoints (means), beside the model's
    expected wall time for the pooled measured costs."""
    model = {row["ckpt_every"]: row for row in record["model_rows"]}
    rows = []
    for k in record["intervals"]:
        runs = [r for r in record["runs"] if r["ckpt_every"] == k]
        if not runs:
            raise ValueError(f"the sweep has no run for interval {k}")
        walls = [r["wall_s"] for r in runs]
        sem = statistics.stdev(walls) / math.sqrt(len(walls)) if len(walls) > 1 else math.nan
        rows.append({"ckpt_every": k, "interval_s": model[k]["interval_s"],
                     "measured_wall_s": statistics.mean(walls), "measured_sem_s": sem,
                     "model_wall_s": model[k]["model_wall_s"],
                     "failures": statistics.mean(r["failures"] for r in runs),
                     "recomputed_steps": statistics.mean(r["recomputed_steps"] for r in runs),
                     "checkpoints": statistics.mean(r["checkpoints"] for r in runs),
                     "goodput": model[k]["work_s"] / statistics.mean(walls)})
    return rows


def replica_group_goodput(mtbf_s: float, restart_s: float, groups: int, step_s: float) -> float:
    """Goodput under per-step fault tolerance (torchft-style replica groups): a failure takes
    only its replica group out for `restart_s` while the other groups train on (the job runs at
    (G - 1)/G of its speed meanwhile) and loses the step in flight; no global restart, no
    rollback to a checkpoint. 1 - R/(M G) - s/M, valid while R/M is small against G."""
    for name, v in (("mtbf_s", mtbf_s), ("restart_s", restart_s), ("step_s", step_s)):
        if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0) or \
                (name == "mtbf_s" and v == 0):
            raise ValueError(f"{name} must be a non-negative number of seconds (MTBF: positive), "
                             f"got {v!r}")
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 2:
        raise ValueError(f"groups must be an integer >= 2 (one group is a global restart), "
                         f"got {groups!r}")
    return max(0.0, 1 - restart_s / (mtbf_s * groups) - step_s / mtbf_s)
