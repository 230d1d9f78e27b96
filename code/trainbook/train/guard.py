"""What keeps a run safe from what happens around it: signals, a dead launcher, a second job.

`Guard` is installed by the trainer for the length of a run:

- **Stop signals.** SIGTERM (what `kill`, torchrun and SLURM send before killing) and SIGUSR1
  (what `sbatch --signal=USR1@60` sends before the time limit) set a flag instead of killing the
  process. The loop asks `stop_requested()` after every step; under torch.distributed every rank
  learns if any rank was signalled (one all-reduce of a flag), so all of them stop after the
  same step, checkpoint together and exit cleanly.
- **A dead launcher.** A worker started by torchrun whose agent is SIGKILLed is reparented and
  trains on, an orphan writing checkpoints into the directory its successor resumes from. On
  Linux the guard asks the kernel to SIGKILL the worker the moment its parent dies
  (`prctl(PR_SET_PDEATHSIG)`); elsewhere, and as a second line, a watchdog thread notices the
  parent's death (the parent pid changes, checked every `poll_s`) and exits the worker.
- **A second job.** Rank 0 holds an exclusive lock (`fcntl.flock`) on `<ckpt_dir>/.lock` for the
  whole run and writes its identity into it (host, pid, SLURM job or torchrun run id); a second
  job on the same directory fails at once, naming the holder, instead of interleaving
  checkpoints. The lock dies with the process. flock is reliable on local disks and most
  parallel file systems with locking enabled; on NFS without locks, use a job id per directory.
- **Stack dumps on demand.** SIGUSR2 makes every rank print the Python stack of each of its
  threads to its standard error (`faulthandler`), without stopping: `kill -USR2 <pid>` on
  every rank of a hung job shows where each one waits.

`TRAINBOOK_PARENT_WATCHDOG=0` in the environment turns both off (the kernel's signal and the
thread): only for the demonstration of what they prevent (book/failures/fault-tolerance), never
in a real job.

Chapter: book/failures/fault-tolerance; book/failures/hangs (the stack dumps).
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

# The parent when this module was first imported, before torch (seconds of start-up): a change
# by the time the guard starts means the launcher died while this process was starting.
PARENT_AT_START = os.getppid()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
DUMP_SIGNAL = signal.SIGUSR2  # print every thread's stack, keep running
LOCK = ".lock"
WATCHDOG_ENV = "TRAINBOOK_PARENT_WATCHDOG"


def say(message: str) -> None:
    """One line to stderr in one write: under PYTHONUNBUFFERED (the sbatch script sets it)
    print() writes the text and its newline separately, so two ranks signalled together glue
    their lines ("...checkpointtrainbook: rank 0 received...") and a log parser misses one."""
    sys.stderr.write(f"{message}\n")
    sys.stderr.flush()


def watchdog_default(env: dict | None = None) -> bool:
    """Watch the parent by default under torchrun (TORCHELASTIC_RUN_ID set), unless
    TRAINBOOK_PARENT_WATCHDOG=0 turns it off for a demonstration."""
    env = os.environ if env is None else env
    value = env.get(WATCHDOG_ENV, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{WATCHDOG_ENV}={value!r}: give 1 (watch the launcher, the default) "
                         "or 0 (off, for demonstrations only)")
    return "TORCHELASTIC_RUN_ID" in env and value == "1"


def identity() -> dict:
    """Who is running: host, pid, and the scheduler's job and the launcher's run, where any."""
    env = os.environ
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "slurm_job": env.get("SLURM_JOB_ID"), "slurm_restart": env.get("SLURM_RESTART_COUNT"),
            "torchrun_run": env.get("TORCHELASTIC_RUN_ID"),
            "torchrun_restart": env.get("TORCHELASTIC_RESTART_COUNT"),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def _stderr():
    """A standard error with a file descriptor for faulthandler (a notebook's has none: then
    the process's own), or None."""
    for stream in (sys.stderr, sys.__stderr__):
        try:
            stream.fileno()
            return stream
        except (AttributeError, OSError, ValueError):
            continue
    return None


def kill_with_parent() -> bool:
    """Have the kernel SIGKILL this process when its parent dies (Linux's PR_SET_PDEATHSIG);
    False where that is not available. Cleared by `kill_with_parent_off()`."""
    return _pdeathsig(signal.SIGKILL)


def kill_with_parent_off() -> bool:
    return _pdeathsig(0)


def _pdeathsig(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(1, int(sig), 0, 0, 0) == 0  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return False


def launcher_alive(parent: int) -> bool:
    """Whether `parent` can still be this worker's torchrun agent: the parent it had when this
    module was imported, and a Python process (torchrun is one; init or a subreaper that
    adopted an orphan is not). True where /proc cannot tell."""
    if parent != PARENT_AT_START:
        return False
    try:
        exe = os.readlink(f"/proc/{parent}/exe")
    except OSError:
        return True
    return "python" in Path(exe).name


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

    `watch_parent`: exit when the parent process dies (default: `watchdog_default()`, when
    launched by torchrun, which sets TORCHELASTIC_RUN_ID). Handlers are only installed from the
    main thread, where Python delivers signals; the previous handlers come back on exit. The
    SIGUSR2 stack dump is installed where no other handler holds SIGUSR2."""

    def __init__(self, ckpt_dir: str | Path | None = None, rank: int = 0,
                 watch_parent: bool | None = None, poll_s: float = 0.5):
        self.ckpt_dir, self.rank, self.poll_s = ckpt_dir, rank, poll_s
        self.watch_parent = watchdog_default() if watch_parent is None else watch_parent
        self.signal: str | None = None  # the name of the first stop signal received
        self._previous: dict = {}
        self._lock_fd: int | None = None
        self._dumps = False
        self._pdeathsig = False
        self._done = threading.Event()

    def _handler(self, signum, _frame) -> None:
        if self.signal is None:
            self.signal = signal.Signals(signum).name
            say(f"trainbook: rank {self.rank} received {self.signal}: stopping after this step "
                "with a checkpoint")

    def _watch(self, parent: int) -> None:
        while not self._done.wait(self.poll_s):
            if os.getppid() != parent:
                say(f"trainbook: rank {self.rank}: the launcher (pid {parent}) died; exiting so "
                    "that no orphan trains on")
                os._exit(1)

    def __enter__(self) -> Guard:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handler)
            stream = _stderr()
            if stream is not None and signal.getsignal(DUMP_SIGNAL) in (signal.SIG_DFL, None):
                faulthandler.register(DUMP_SIGNAL, file=stream, all_threads=True)
                self._dumps = True
        if self.watch_parent:
            parent = os.getppid()
            self._pdeathsig = kill_with_parent()
            # the launcher died while this process started (it was reparented, to init or a
            # subreaper), or before the kernel was asked to watch it
            if not launcher_alive(parent) or os.getppid() != parent:
                say(f"trainbook: rank {self.rank}: the launcher (pid {PARENT_AT_START}) died "
                    "before the run started; exiting")
                os._exit(1)
            threading.Thread(target=self._watch, args=(parent,), daemon=True,
                             name="trainbook-parent-watchdog").start()
        if self.ckpt_dir and self.rank == 0:
            self._lock_fd = lock_dir(self.ckpt_dir)
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        if self._pdeathsig:
            kill_with_parent_off()
            self._pdeathsig = False
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self._dumps:
            faulthandler.unregister(DUMP_SIGNAL)
            self._dumps = False
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
