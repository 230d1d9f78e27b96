"""What keeps a run safe from what happens around it: signals, a dead launcher, a second job.

`Guard` is installed by the trainer for the length of a run:

- **Stop signals.** SIGTERM (what `kill`, torchrun and SLURM send before killing) and SIGUSR1
  (what `sbatch --signal=USR1@60` sends before the time limit) set a flag instead of killing the
  process. The loop asks `stop_requested()` after every step; under torch.distributed every rank
  learns if any rank was signalled (one all-reduce of a flag), so all of them stop after the
  same step, checkpoint together and exit cleanly.
- **A dead launcher.** A worker started by torchrun whose agent is SIGKILLed is reparented and
  trains on, an orphan writing checkpoints into the directory its successor resumes from. A
  watchdog thread notices the parent's death (the parent pid changes) and exits the worker.
- **A second job.** Rank 0 holds an exclusive lock (`fcntl.flock`) on `<ckpt_dir>/.lock` for the
  whole run and writes its identity into it (host, pid, SLURM job or torchrun run id); a second
  job on the same directory fails at once, naming the holder, instead of interleaving
  checkpoints. The lock dies with the process. flock is reliable on local disks and most
  parallel file systems with locking enabled; on NFS without locks, use a job id per directory.

Chapter: book/failures/fault-tolerance.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
LOCK = ".lock"


def identity() -> dict:
    """Who is running: host, pid, and the scheduler's job and the launcher's run, where any."""
    env = os.environ
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "slurm_job": env.get("SLURM_JOB_ID"), "slurm_restart": env.get("SLURM_RESTART_COUNT"),
            "torchrun_run": env.get("TORCHELASTIC_RUN_ID"),
            "torchrun_restart": env.get("TORCHELASTIC_RESTART_COUNT"),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


class CheckpointDirLocked(RuntimeError):
    """Another live process holds the checkpoint directory."""


def lock_dir(ckpt_dir: str | Path) -> int:
    """Take the exclusive lock on `<ckpt_dir>/.lock` and write this process's identity into it;
    returns the open descriptor (closing it, or the process ending, releases the lock)."""
    import fcntl

    path = Path(ckpt_dir)
    path.mkdir(parents=True, exist_ok=True)
    fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = (path / LOCK).read_text().strip() or "unknown"
        os.close(fd)
        raise CheckpointDirLocked(
            f"checkpoint directory {path} is in use by another live process ({holder}); stop "
            "that job (or its orphaned workers) first, or give this run another --ckpt-dir"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, (json.dumps(identity()) + "\n").encode())
    os.fsync(fd)
    return fd


class Guard:
    """Signals, the parent watchdog and the directory lock for one run (a context manager).

    `watch_parent`: exit when the parent process dies (default: when launched by torchrun,
    which sets TORCHELASTIC_RUN_ID). Handlers are only installed from the main thread, where
    Python delivers signals; the previous handlers come back on exit."""

    def __init__(self, ckpt_dir: str | Path | None = None, rank: int = 0,
                 watch_parent: bool | None = None, poll_s: float = 0.5):
        self.ckpt_dir, self.rank, self.poll_s = ckpt_dir, rank, poll_s
        self.watch_parent = ("TORCHELASTIC_RUN_ID" in os.environ) if watch_parent is None \
            else watch_parent
        self.signal: str | None = None  # the name of the first stop signal received
        self._previous: dict = {}
        self._lock_fd: int | None = None
        self._done = threading.Event()

    def _handler(self, signum, _frame) -> None:
        if self.signal is None:
            self.signal = signal.Signals(signum).name
            print(f"trainbook: rank {self.rank} received {self.signal}: stopping after this step "
                  "with a checkpoint", file=sys.stderr, flush=True)

    def _watch(self, parent: int) -> None:
        while not self._done.wait(self.poll_s):
            if os.getppid() != parent:
                print(f"trainbook: rank {self.rank}: the launcher (pid {parent}) died; exiting so "
                      "that no orphan trains on", file=sys.stderr, flush=True)
                os._exit(1)

    def __enter__(self) -> Guard:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handler)
        if self.watch_parent:
            threading.Thread(target=self._watch, args=(os.getppid(),), daemon=True,
                             name="trainbook-parent-watchdog").start()
        if self.ckpt_dir and self.rank == 0:
            self._lock_fd = lock_dir(self.ckpt_dir)
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def stop_requested(self, device: torch.device | str = "cpu") -> str | None:
        """The stop signal's name if this rank, or under torch.distributed any rank, received
        one (every rank must call this at the same point of every step); else None."""
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([1.0 if self.signal else 0.0], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() and self.signal is None:
                return "a stop signal on another rank"
        return self.signal
