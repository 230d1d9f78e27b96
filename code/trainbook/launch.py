"""Run a function on N processes in a fresh process group, with a timeout, from a notebook or test.

`run(fn, nprocs)` spawns N processes, joins them into one torch.distributed group (gloo by
default, since the book's demos keep their tensors on the CPU; backend="nccl" for a function
that puts its tensors on cuda:LOCAL_RANK), calls fn(*args) on every rank and returns each
rank's return value and printed output in rank order. If a rank raises, the error names the
rank and carries its traceback; if the job runs past `timeout_s` (a mismatched collective, a
deadlock), every process is killed and a TimeoutError says so. No chapter or test can hang.

`rank_device()` is the one answer to "where do this rank's tensors live": cuda:LOCAL_RANK
under NCCL, the CPU under gloo. Every parallel module asks it. `threads(n)` sets torch's CPU
thread count for a block or a function and restores it: the book's small runs use one.

Chapter: book/parallelism/collectives.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.multiprocessing as mp


@dataclass
class RankResult:
    rank: int
    value: Any
    stdout: str


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device() -> torch.device:
    """This rank's device: cuda:LOCAL_RANK under NCCL (torchrun and `run` set LOCAL_RANK), else
    the CPU. Call it inside a process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("rank_device() needs a process group: run under torchrun or "
                         "trainbook.launch.run")
    if dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    return torch.device("cpu")


def resolve_device(name: str = "auto", local_rank: int = 0) -> torch.device:
    """The one reading of a --device option: 'auto' is cuda when a GPU (NVIDIA or ROCm, which
    PyTorch calls cuda) is visible, else cpu; a bare 'cuda' is this process's GPU, cuda:LOCAL_RANK
    under torchrun."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {name!r}: device must be auto, cpu, cuda or "
                         "cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {name!r}: device must be auto, cpu, cuda or cuda:N "
                         "(ROCm GPUs are cuda in PyTorch)")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for, but no GPU is visible "
                         "(torch.cuda.is_available() is False); use --device cpu")
    return torch.device("cuda", local_rank) if dev.type == "cuda" and dev.index is None else dev


@contextlib.contextmanager
def threads(n: int = 1) -> Iterator[None]:
    """torch's intra-op thread count set to `n` inside the block (or the decorated function:
    `@threads(1)`) and restored afterwards, whatever happens.

    The book's small models and tensors are overhead-bound: one thread runs them as fast as two,
    and on a busy 2-core machine two threads can be 10-40 times slower (OpenMP workers spin
    waiting for each other; measured while writing Parts 2-4). On a GPU it changes nothing that
    matters: the CPU only launches kernels."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"the thread count must be a whole number >= 1, got {n!r}")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(n)
        yield
    finally:
        torch.set_num_threads(before)


def _worker(rank, world_size, port, backend, timeout_s, fn, args, kwargs, results):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    out = io.StringIO()
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        with contextlib.redirect_stdout(out):
            value = fn(*args, **kwargs)
        dist.barrier()
        dist.destroy_process_group()
        # plain pickle: tensors travel as bytes, not as shared-memory handles that die with the rank
        results.put((rank, "ok", pickle.dumps(value), out.getvalue()))
    except BaseException:  # report every failure to the parent, with its rank
        results.put((rank, "error", traceback.format_exc(), out.getvalue()))


def run(fn: Callable, nprocs: int = 2, args: tuple = (), kwargs: dict | None = None,
        timeout_s: float = 120, backend: str = "gloo") -> list[RankResult]:
    """fn(*args, **kwargs) on `nprocs` ranks; results in rank order. fn must be importable
    (a module-level function of a package), since each rank is a fresh spawned process."""
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    if (getattr(fn, "__module__", "__main__") == "__main__"
            or "<locals>" in getattr(fn, "__qualname__", "")):
        raise ValueError(f"{getattr(fn, '__qualname__', fn)!r} is defined in a notebook or a "
                         "function; spawned ranks can only import module-level functions "
                         "from a package")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be gloo or nccl, got {backend!r}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, daemon=True,
                         args=(r, nprocs, port, backend, timeout_s, fn, args, kwargs or {},
                               results))
             for r in range(nprocs)]
    for p in procs:
        p.start()
    collected: dict[int, tuple] = {}
    deadline = timeout_s + 30  # collectives time out first; the margin covers start-up
    end = time.monotonic() + deadline
    try:
        while len(collected) < nprocs:
            try:
                wait = max(0.1, min(1.0, end - time.monotonic()))
                rank, status, value, stdout = results.get(timeout=wait)
            except queue.Empty:
                if time.monotonic() > end:
                    missing = sorted(set(range(nprocs)) - set(collected))
                    raise TimeoutError(f"{fn.__qualname__} on {nprocs} ranks did not finish in "
                                       f"{deadline:.0f} s; ranks {missing} never reported "
                                       "(a hang or a mismatched collective?)") from None
                dead = [i for i, p in enumerate(procs)
                        if p.exitcode not in (None, 0) and i not in collected]
                if dead:
                    raise RuntimeError(f"rank {dead[0]} died with exit code "
                                       f"{procs[dead[0]].exitcode} before reporting "
                                       "(out of memory? killed?)") from None
                continue
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}\n"
                                   f"--- rank {rank} output ---\n{stdout}")
            collected[rank] = (pickle.loads(value), stdout)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return [RankResult(r, *collected[r]) for r in range(nprocs)]


def torchrun(args: list[str], nprocs: int, timeout_s: float = 300,
             cwd: str | os.PathLike | None = None, threads: int = 1) -> str:
    """`python -m trainbook ARGS` under torchrun on `nprocs` local ranks (gloo on a CPU, NCCL
    on GPUs, as the command chooses), with a timeout; returns rank 0's standard output.

    What a reader types in a shell, run from a notebook or a test: `threads` OpenMP threads per
    rank (several ranks on a few cores thrash with more). A failure raises with the end of the
    ranks' error output; a run past `timeout_s` is killed and raises TimeoutError."""
    import subprocess
    import sys

    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive integer, got {nprocs!r}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nprocs}", "-m", "trainbook", *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env,
                           cwd=cwd)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"torchrun -m trainbook {' '.join(map(str, args))} on {nprocs} ranks "
                           f"did not finish in {timeout_s:.0f} s") from None
    if r.returncode:
        raise RuntimeError(f"torchrun -m trainbook {' '.join(map(str, args))} failed "
                           f"(exit {r.returncode}):\n{r.stderr[-3000:]}")
    return r.stdout
