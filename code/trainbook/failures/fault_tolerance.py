"""Fault tolerance of a torchrun job, on real processes: orphans, graceful stops, elastic restarts.

`Job` runs `python -m trainbook train` under torchrun with its output in files (as a scheduler
would), finds its worker processes and their ranks in /proc, and signals or kills the agent or one
rank by pid. Four experiments build on it:

- `orphans`: SIGKILL the torchrun agent. Without the guard's parent watchdog (turned off with
  TRAINBOOK_PARENT_WATCHDOG=0) the workers are reparented and train on, writing checkpoints into
  the directory a restarted job would resume from; the directory lock stops that restarted job
  and names the orphan. With the watchdog they exit within a poll interval.
- `sigterm`: SIGTERM to the agent, which forwards it to every worker and waits (30 s by
  default, `--shutdown-timeout`) before SIGKILL; the guard turns it into one checkpoint that
  all ranks write after the same step, and a clean exit.
- `elastic_restart`: torchrun `--max-restarts 1` with one rank SIGKILLed mid-run: the agent
  stops the other workers, starts a new generation, and the trainer's `--resume` carries on from
  the newest checkpoint; the loss curve is the uninterrupted one, bit for bit.

Process helpers (`children`, `alive`) are shared with book/failures/hangs.

Chapter: book/failures/fault-tolerance.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

# The chapter's model: small enough that a step takes milliseconds, so a run is its start-up.
TINY = ["--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--n-kv-heads", "1",
        "--d-ff", "32", "--tokenizer", "bytes", "--seq-len", "16", "--batch-size", "2",
        "--warmup-steps", "1", "--log-every", "1", "--no-progress", "--eval-batches", "1"]


def children(pid: int) -> dict[int, int]:
    """{rank: pid} of the processes whose parent is `pid` and whose environment has RANK (the
    workers a torchrun agent started)."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if parent_of(int(stat.parent.name)) != pid:
                continue
            env = (stat.parent / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        rank = [e for e in env if e.startswith(b"RANK=")]
        if rank:
            out[int(rank[0][5:])] = int(stat.parent.name)
    return out


def _stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def parent_of(pid: int) -> int | None:
    """The parent pid of a live process (1, or a subreaper, once its parent died), or None."""
    try:
        return int(_stat(pid)[1])
    except (FileNotFoundError, IndexError, ProcessLookupError):
        return None


def alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped by its parent, counts as gone)."""
    try:
        return _stat(pid)[0] != "Z"
    except (FileNotFoundError, IndexError, ProcessLookupError):
        return False


def wait_gone(pids: list[int], timeout_s: float) -> float | None:
    """Seconds until every pid is gone, or None if some still run after `timeout_s`."""
    t0 = time.monotonic()
    while any(alive(p) for p in pids):
        if time.monotonic() - t0 > timeout_s:
            return None
        time.sleep(0.05)
    return time.monotonic() - t0


class Job:
    """`torchrun --standalone --nproc_per_node N [torchrun_args] -m trainbook train ARGS` with
    standard output and error in `<workdir>/<name>.out|.err`; a context manager that kills every
    process it started (agent and workers, by pid) on exit."""

    def __init__(self, workdir: str | os.PathLike, args: list[str], nprocs: int = 2,
                 torchrun_args: list[str] | tuple[str, ...] = (), name: str = "job",
                 env: dict[str, str] | None = None):
        if not isinstance(nprocs, int) or nprocs < 1:
            raise ValueError(f"nprocs must be a positive integer, got {nprocs!r}")
        self.workdir, self.name = Path(workdir).resolve(), name
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc_per_node={nprocs}", *torchrun_args, "-m", "trainbook", "train",
                    *map(str, args)]
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        self.env.pop("TORCHELASTIC_RUN_ID", None)
        self.out, self.err = (self.workdir / f"{name}.{x}" for x in ("out", "err"))
        self.agent: subprocess.Popen | None = None
        self.seen: dict[int, int] = {}  # every worker pid seen, by rank (later generations win)

    def start(self) -> Job:
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.agent = subprocess.Popen(self.cmd, stdout=out, stderr=err, cwd=self.workdir,
                                          env=self.env)
        return self

    def __enter__(self) -> Job:
        return self.start() if self.agent is None else self

    def __exit__(self, *exc) -> None:
        self.stop()

    def workers(self) -> dict[int, int]:
        """{rank: pid} of the agent's workers now (remembered for `stop`)."""
        found = children(self.agent.pid)
        self.seen.update(found)
        return found

    def lines(self) -> list[str]:
        return self.out.read_text().splitlines() if self.out.exists() else []

    def steps(self) -> list[int]:
        """The steps rank 0 has logged so far (`step N | loss ...` lines)."""
        return [int(m.group(1)) for m in map(re.compile(r"step\s+(\d+) \|").match, self.lines())
                if m]

    def wait_for_step(self, step: int, timeout_s: float = 120) -> None:
        """Block until rank 0 has logged `step` (and the workers are known)."""
        deadline = time.monotonic() + timeout_s
        while not self.steps() or self.steps()[-1] < step:
            if self.agent.poll() is not None:
                raise RuntimeError(f"{self.name} ended (exit {self.agent.returncode}) before "
                                   f"step {step}:\n{self.err.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} did not reach step {step} in {timeout_s:.0f} s")
            time.sleep(0.05)
        self.workers()

    def wait(self, timeout_s: float = 120) -> int:
        """The agent's exit code; TimeoutError (after killing the job) if it runs longer."""
        try:
            return self.agent.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            raise TimeoutError(f"{self.name} did not finish in {timeout_s:.0f} s") from None

    def stop(self) -> None:
        """SIGKILL the agent and every worker this job has seen, by pid."""
        if self.agent is not None and self.agent.poll() is None:
            self.agent.kill()
            self.agent.wait(timeout=30)
        for pid in {**self.seen, **(children(self.agent.pid) if self.agent else {})}.values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def _written_after(ckpt: Path, t: float) -> list[str]:
    return sorted(p.name for p in ckpt.glob("step-*") if p.stat().st_mtime > t)


def orphans(workdir: str | os.PathLike, watchdog: bool, watch_s: float = 2.0,
            timeout_s: float = 120) -> dict:
    """SIGKILL the agent of a 2-rank training job after step 5 and watch its workers for
    `watch_s` seconds: who their parent is, whether they still train and write checkpoints.
    Without the watchdog, a restarted job on the same checkpoint directory then meets the
    orphans' lock. The orphans are killed at the end, by pid."""
    workdir = Path(workdir).resolve()
    ckpt = workdir / "ckpt"
    env = {} if watchdog else {"TRAINBOOK_PARENT_WATCHDOG": "0"}
    args = [*TINY, "--steps", "100000", "--ckpt-dir", str(ckpt), "--ckpt-every", "20",
            "--keep-last", "2", "--cache-dir", str(workdir / "cache")]
    with Job(workdir, args, name="first", env=env) as job:
        job.wait_for_step(5, timeout_s)
        workers = job.workers()
        before = {r: parent_of(p) for r, p in workers.items()}
        steps_at_kill = job.steps()[-1]
        t_kill = time.time()
        job.agent.kill()
        job.agent.wait(timeout=30)
        gone_s = wait_gone(list(workers.values()), watch_s)
        if gone_s is None:
            time.sleep(0.2)
        out = {"watchdog": watchdog, "agent": job.agent.pid, "workers": workers,
               "parents_before": before, "parents_after": {r: parent_of(p)
                                                           for r, p in workers.items()},
               "alive_after": {r: alive(p) for r, p in workers.items()},
               "gone_after_s": gone_s, "steps_at_kill": steps_at_kill,
               "steps_after": job.steps()[-1] - steps_at_kill,
               "checkpoints_after_kill": _written_after(ckpt, t_kill)}
        if not watchdog:  # a restarted job, as a scheduler would start, on the same directory
            second = Job(workdir, [*args, "--resume"], name="restarted")
            with second:
                code = second.wait(timeout_s)
            lock = [ln for ln in second.err.read_text().splitlines()
                    if "is in use by another live process" in ln]
            out.update(restarted_exit=code, restarted_error=lock[0] if lock else None,
                       lock_holder=json.loads((ckpt / ".lock").read_text()))
            out["orphans_still_training"] = job.steps()[-1] - steps_at_kill
    return out


def sigterm(workdir: str | os.PathLike, at_step: int = 5, timeout_s: float = 120) -> dict:
    """SIGTERM to the agent of a 2-rank FSDP job (`--dp-shard 2`, so that every rank writes its
    own shards of the checkpoint) after `at_step`: what each rank printed, the checkpoint the
    ranks wrote together, and how long the agent took to exit."""
    workdir = Path(workdir).resolve()
    ckpt = workdir / "ckpt"
    args = [*TINY, "--steps", "100000", "--dp-shard", "2", "--ckpt-dir", str(ckpt),
            "--cache-dir", str(workdir / "cache")]
    with Job(workdir, args, name="sigterm") as job:
        job.wait_for_step(at_step, timeout_s)
        t0 = time.monotonic()
        job.agent.send_signal(signal.SIGTERM)
        code = job.wait(timeout_s)
        exit_s = time.monotonic() - t0
    err = job.err.read_text().splitlines()
    stopped = [ln for ln in job.lines() if ln.startswith("stopped after step")]
    folders = sorted(p for p in ckpt.glob("step-*") if p.is_dir())
    return {"agent_exit": code, "exit_s": exit_s, "logged_last": job.steps()[-1],
            "received": [ln for ln in err if "received SIGTERM" in ln],
            "forwarded": [re.sub(r"^.*\] ", "", ln) for ln in err if "closing signal" in ln],
            "sigkill": [ln for ln in err if "forcefully exiting via" in ln],
            "stopped": stopped[0] if stopped else None,
            "checkpoint": folders[-1].name if folders else None,
            "shard_files": sorted(p.name for p in folders[-1].glob("*.distcp")) if folders
            else []}


def elastic_restart(workdir: str | os.PathLike, steps: int = 30, ckpt_every: int = 5,
                    kill_rank: int = 1, at_step: int = 12, max_restarts: int = 1,
                    share_store: bool = False, timeout_s: float = 180) -> dict:
    """`torchrun --max-restarts` with rank `kill_rank` SIGKILLed once rank 0 has logged
    `at_step`; the job resumes by itself from its newest checkpoint (`--resume`). Returns the
    run's history (rank 0's `--json-out`, which carries the steps before the failure in the
    checkpoint), the step it resumed from and what the agent logged.

    `share_store=False` sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: in torch 2.13 the workers of
    every generation otherwise share the agent's key-value store under the same keys, and a
    restarted rank can read a dead rank's gloo address and fail to connect (measured in
    book/failures/fault-tolerance)."""
    if not 0 < at_step < steps:
        raise ValueError(f"at_step must be in (0, steps={steps}), got {at_step}")
    workdir = Path(workdir).resolve()
    args = [*TINY, "--steps", str(steps), "--ckpt-dir", str(workdir / "ckpt"), "--ckpt-every",
            str(ckpt_every), "--resume", "--json-out", str(workdir / "run.json"),
            "--cache-dir", str(workdir / "cache")]
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0" if share_store else "1"}
    with Job(workdir, args, torchrun_args=["--max-restarts", str(max_restarts)],
             name="elastic", env=env) as job:
        job.wait_for_step(at_step, timeout_s)
        victim = job.workers()[kill_rank]
        killed_after = job.steps()[-1]
        os.kill(victim, signal.SIGKILL)
        code = job.wait(timeout_s)
    lines, err = job.lines(), job.err.read_text().splitlines()
    resumed = [ln for ln in lines if ln.startswith("resumed from")]
    record = json.loads((workdir / "run.json").read_text()) if code == 0 else {}
    return {"exit": code, "killed_rank": kill_rank, "killed_pid": victim,
            "killed_after_step": killed_after, "resumed": resumed,
            "resumed_step": int(resumed[0].rsplit(" ", 1)[1]) if resumed else None,
            "agent_restarts": [re.sub(r"^.*\] ", "", ln) for ln in err
                               if "restart" in ln.lower() and "worker group" in ln],
            "connect_failed": any("connectFullMesh failed" in ln for ln in err),
            "history": record.get("history", []), "stderr_tail": "\n".join(err[-20:])}


def reference(workdir: str | os.PathLike, steps: int = 30, timeout_s: float = 180) -> list[dict]:
    """The same 2-rank run as `elastic_restart`, uninterrupted and without checkpoints: rank 0's
    history."""
    workdir = Path(workdir).resolve()
    args = [*TINY, "--steps", str(steps), "--json-out", str(workdir / "reference.json"),
            "--cache-dir", str(workdir / "cache")]
    with Job(workdir, args, name="reference") as job:
        code = job.wait(timeout_s)
    if code:
        raise RuntimeError(f"the reference run failed (exit {code}):\n"
                           f"{job.err.read_text()[-3000:]}")
    return json.loads((workdir / "reference.json").read_text())["history"]


def write_record(path: str | os.PathLike, trials: int = 3, steps: int = 30,
                 workdir: str | os.PathLike | None = None) -> Path:
    """Run the chapter's long experiments and store them as JSON with their provenance:
    `sigterm`; `reference`; `elastic_restart` `trials` times with torch's shared rendezvous store
    and `trials` times without it (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, what the chapter
    recommends). A trial that hangs past its timeout is recorded as such."""
    import tempfile

    import torch

    from ..bench.gpu_truth import header
    from ..bench.gpu_truth import write_record as write_json

    if not isinstance(trials, int) or trials < 1:
        raise ValueError(f"trials must be a positive integer, got {trials!r}")
    path = Path(path)
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(workdir or tmp)
        term = sigterm(base / "sigterm")
        ref = reference(base / "reference", steps)
        restarts = []
        for share in (False, True):
            for i in range(trials):
                try:
                    r = elastic_restart(base / f"elastic-{share}-{i}", steps, share_store=share)
                    r["timed_out"] = False
                except TimeoutError as e:
                    r = {"exit": None, "timed_out": True, "error": str(e), "history": []}
                r["share_store"] = share
                r["history_equals_reference"] = [h["loss"] for h in r["history"]] == \
                    [h["loss"] for h in ref]
                restarts.append(r)
    command = (f'python -c "from trainbook.failures import fault_tolerance; '
               f'fault_tolerance.write_record({str(path)!r}, trials={trials}, steps={steps})"')
    record = header("fault-tolerance-restarts", command, torch.device("cpu"), "small")
    record.update(model=TINY, steps=steps, sigterm=term, reference=ref, restarts=restarts)
    return write_json(path.parent, path.stem, record)


def read_record(path: str | os.PathLike) -> dict:
    """A record `write_record` stored."""
    from ..bench.gpu_truth import read_record as read_stored

    record = read_stored(path, "fault-tolerance-restarts", "fault_tolerance.write_record")
    return record
