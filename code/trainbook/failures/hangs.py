"""Hangs of a distributed job: planted on real ranks, caught by a timeout, explained by name.

A collective completes only when every rank of its group enters it with the same operation on
tensors of the same size. When one rank does not (it skipped a collective, called them in another
order, is stuck outside any collective, or ran out of data first), the others wait until the
process group's timeout. The timeout's own message says only that a receive timed out.
`CollectiveTracer` says who is where: a dispatcher mode that, before this rank enters each
collective, publishes its sequence number, operation and tensor shape in the process group's
key-value store, so the rank that times out can read every rank's position and `diagnose`
names the rank that is behind or disagrees, and the operation (what the NCCL flight recorder
and its `fr_trace` analyser do on GPUs, reduced to its core).

`plant` runs the planted hangs of `SCENARIOS` one after the other on the ranks of
`trainbook.launch.run`, each on a fresh process group with a short timeout, and returns what
each rank saw; `planted_hangs` tabulates it. `TORCH_DISTRIBUTED_DEBUG=DETAIL` is the same
scenarios with PyTorch's own checker (`ProcessGroupWrapper`: a fingerprint of every collective
compared across ranks before it runs, and a monitored barrier that names missing ranks).
The stack dumps of a hung job are in `trainbook.failures.stacks`.

Chapter: book/failures/hangs.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

KEY = "trainbook/trace"


def op_name(opname: str) -> str:
    """c10d's dispatcher name of a collective in the words of torch.distributed:
    allreduce_ -> all_reduce, _allgather_base_ -> all_gather, recv_ -> recv."""
    base = opname.strip("_").removesuffix("_base").removesuffix("_coalesced")
    base = base.removesuffix("_into_tensor").removesuffix("_tensor")
    return {"allreduce": "all_reduce", "allgather": "all_gather", "alltoall": "all_to_all",
            "reduce_scatter": "reduce_scatter"}.get(base.strip("_"), base.strip("_"))


def _first_tensor(x: object) -> torch.Tensor | None:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, list | tuple):
        for item in x:
            t = _first_tensor(item)
            if t is not None:
                return t
    return None


@dataclass(frozen=True)
class Position:
    """Where one rank is: its `count`-th collective, `op` on a tensor of `shape`; `done` when
    it has left the traced code (its loop ended)."""

    rank: int
    count: int
    op: str | None = None
    shape: str | None = None
    done: bool = False

    def describe(self) -> str:
        if self.count == 0:
            return f"rank {self.rank} has entered no collective yet"
        where = f"{self.op} #{self.count}" + (f" ({self.shape})" if self.shape else "")
        return f"rank {self.rank} " + (f"last entered {where} and has left the traced code"
                                       if self.done else f"is in {where}")


class CollectiveTracer(TorchDispatchMode):
    """Publish this rank's position before every collective it enters (a c10d dispatcher op:
    `dist.all_reduce`, DDP's gradient buckets, FSDP's all-gathers, barriers), under
    `trainbook/trace/<name>/<rank>` in the default process group's store. One store write per
    collective (a fraction of a millisecond on a local TCP store): a debugging tool, on while a
    hang is hunted."""

    def __init__(self, name: str = "run"):
        super().__init__()
        if not dist.is_initialized():
            raise ValueError("CollectiveTracer needs a process group: create it inside "
                             "torchrun or trainbook.launch.run, after init_process_group")
        if not re.fullmatch(r"[\w.-]+", name):
            raise ValueError(f"tracer name {name!r}: use letters, digits, '.', '-' or '_'")
        self.name, self.rank, self.world = name, dist.get_rank(), dist.get_world_size()
        self.store = dist.distributed_c10d._get_default_store()
        self.count = 0
        self._publish(Position(self.rank, 0))

    def _publish(self, pos: Position) -> None:
        self.store.set(f"{KEY}/{self.name}/{self.rank}", json.dumps(asdict(pos)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self.count += 1
            op = op_name(func._opname)
            t = None if op == "barrier" else _first_tensor(args)
            shape = None if t is None else \
                f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
            self.last = Position(self.rank, self.count, op, shape)
            self._publish(self.last)
        return func(*args, **(kwargs or {}))

    def __exit__(self, exc_type, *rest):
        out = super().__exit__(exc_type, *rest)
        if exc_type is None:  # the traced code ended normally: say so (after an error, the
            last = getattr(self, "last", Position(self.rank, 0))  # last position stands)
            self._publish(Position(self.rank, last.count, last.op, last.shape, done=True))
        return out

    def positions(self) -> dict[int, Position]:
        """Every rank's last published position (a rank that never published is left out)."""
        out = {}
        for r in range(self.world):
            key = f"{KEY}/{self.name}/{r}"
            if self.store.check([key]):
                out[r] = Position(**json.loads(self.store.get(key)))
        return out


def diagnose(positions: dict[int, Position], waiting: int) -> str:
    """What the positions of all ranks say about a hang seen by rank `waiting` (the one whose
    collective timed out): which ranks are behind, or which disagree on the operation."""
    if waiting not in positions:
        raise ValueError(f"rank {waiting} has no position; give the rank that timed out")
    me = positions[waiting]
    lines = [f"rank {waiting} timed out in {me.op} #{me.count}"
             + (f" ({me.shape})" if me.shape else "")]
    missing = [r for r in range(max(positions) + 1) if r not in positions]
    behind = [p for p in positions.values() if p.count < me.count]
    ahead = [p for p in positions.values() if p.count > me.count]
    peers = [p for p in positions.values() if p.count == me.count and p.rank != waiting]
    for p in behind:
        gap = me.count - p.count
        why = ("it ran fewer collectives: it skipped one, or its loop ended sooner"
               if p.done else "it is stuck outside any collective (data loading, compute, "
               "I/O, a deadlock): dump its stack")
        lines.append(f"{p.describe()}: {gap} behind; {why}")
    for p in ahead:
        lines.append(f"{p.describe()}: ahead of rank {waiting}; rank {waiting} skipped one")
    for p in peers:
        if (p.op, p.shape) != (me.op, me.shape) and not p.done:
            lines.append(f"{p.describe()}: a mismatch at #{me.count}, "
                         f"{me.op} {me.shape or ''} against {p.op} {p.shape or ''}".rstrip())
        elif p.done:
            lines.append(f"{p.describe()}: it finished with as many collectives; "
                         f"rank {waiting} issued one more")
    for r in missing:
        lines.append(f"rank {r} published nothing: it never started tracing (crashed or "
                     "stuck before its first collective)")
    if len(lines) == 1:
        lines.append("every rank is in the same collective: a peer is slow or its transport "
                     "is stuck (network, GPU); check the stacks and the NCCL flight recorder")
    return "; ".join(lines)


class HangError(RuntimeError):
    """A collective timed out; the message names every rank's position (`diagnose`)."""


TIMEOUT_MARKS = ("Timed out waiting", "timed out", "Watchdog caught collective operation timeout",
                 "failed to pass monitoredBarrier")


@contextlib.contextmanager
def traced(name: str = "run") -> Iterator[CollectiveTracer]:
    """Run the body under a `CollectiveTracer`; a collective that times out becomes a
    `HangError` naming each rank's position instead of gloo's or NCCL's bare timeout."""
    tracer = CollectiveTracer(name)
    try:
        with tracer:
            yield tracer
    except RuntimeError as e:
        if not any(mark in str(e) for mark in TIMEOUT_MARKS):
            raise
        raise HangError(diagnose(tracer.positions(), tracer.rank)) from e


# --- the planted hangs ----------------------------------------------------------------------

def load_batch(rank: int, step: int, stall: tuple[int, int, float] | None = None
               ) -> torch.Tensor:
    """A stand-in for a data loader: a batch at once, except that rank `stall[0]` hangs for
    `stall[2]` seconds at step `stall[1]` (a dead worker, a stuck network file system)."""
    if stall is not None and (rank, step) == stall[:2]:
        time.sleep(stall[2])
    return torch.full((4,), float(step))


def _skip(rank: int, group: dist.ProcessGroup, timeout_s: float) -> None:
    metric = torch.ones(4)
    for step in range(1, 9):
        if rank == 1 and step == 5:  # a branch only one rank takes (a local NaN check, say)
            continue
        dist.all_reduce(metric, group=group)


def _order(rank: int, group: dist.ProcessGroup, timeout_s: float) -> None:
    grads, flag = torch.ones(4), torch.zeros(4)
    if rank == 0:  # two code paths that issue the same collectives in another order
        dist.all_reduce(grads, group=group)
        dist.broadcast(flag, group_src=0, group=group)
    else:
        dist.broadcast(flag, group_src=0, group=group)
        dist.all_reduce(grads, group=group)


def _stall(rank: int, group: dist.ProcessGroup, timeout_s: float) -> None:
    for step in range(1, 5):
        batch = load_batch(rank, step, stall=(1, 3, timeout_s + 0.5))
        dist.all_reduce(batch, group=group)


def _uneven(rank: int, group: dist.ProcessGroup, timeout_s: float, join: bool = False) -> None:
    """DDP where rank 0 has 5 batches and rank 1 has 4 (a dataset that does not divide by the
    ranks, no padding, no drop_last), then the end-of-epoch barrier. With join=True, DDP's
    `join()` lets the rank that ran out shadow the others' gradient all-reduces."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 2), process_group=group)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [torch.randn(4, 8) for _ in range(5 if rank == 0 else 4)]
    with model.join() if join else contextlib.nullcontext():
        for x in batches:
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    dist.barrier(group=group)


SCENARIOS: dict[str, Callable[[int, dist.ProcessGroup, float], None]] = {
    "skip": _skip, "order": _order, "stall": _stall, "uneven": _uneven,
    "uneven-join": lambda rank, group, timeout_s: _uneven(rank, group, timeout_s, join=True),
}
DESCRIPTIONS = {
    "skip": "rank 1 skips the 5th of 8 all-reduces",
    "order": "rank 0 calls all_reduce then broadcast, rank 1 the other way round",
    "stall": "rank 1's data loader stalls at step 3",
    "uneven": "DDP: rank 0 has 5 batches, rank 1 has 4; then a barrier",
    "uneven-join": "the same under DDP's join()",
}


@contextlib.contextmanager
def _stderr_captured() -> Iterator[list[str]]:
    """The process's file descriptor 2 (C++ logs included) into a list of one string."""
    out: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield out
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            out.append(tmp.read())


def _check_runs(runs: list[tuple[str, bool]], timeout_s: float) -> None:
    for kind, _detail in runs:
        if kind not in SCENARIOS:
            raise ValueError(f"unknown planted hang {kind!r}; choose from "
                             f"{', '.join(SCENARIOS)}")
    if not 0.2 <= timeout_s <= 60:
        raise ValueError(f"timeout_s must be in [0.2, 60] seconds (a planted hang waits this "
                         f"long), got {timeout_s}")


def _warm_up() -> None:
    """Pay the one-time costs (the first dispatcher mode, the first DDP model: about a second
    each on a busy CPU) before any planted collective's short timeout starts to count."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    with traced("warm-up"):
        DDP(torch.nn.Linear(2, 2))(torch.ones(1, 2)).sum().backward()


def plant(runs: list[tuple[str, bool]], timeout_s: float = 2.0) -> list[dict]:
    """On every rank of a 2-rank group (inside `trainbook.launch.run`): each planted hang of
    `runs` ((scenario, TORCH_DISTRIBUTED_DEBUG=DETAIL or not)) on a fresh process group whose
    collectives time out after `timeout_s`, under `traced`. Returns this rank's outcome of each:
    seconds to the error, the error (gloo's or DETAIL's) and the tracer's diagnosis."""
    _check_runs(runs, timeout_s)
    if dist.get_world_size() != 2:
        raise ValueError(f"the planted hangs are written for 2 ranks, not "
                         f"{dist.get_world_size()}")
    rank, out = dist.get_rank(), []
    _warm_up()
    for i, (kind, detail) in enumerate(runs):
        dist.barrier()  # the last scenario's ranks may leave it seconds apart
        before = dist.get_debug_level()
        dist.set_debug_level(dist.DebugLevel.DETAIL if detail else dist.DebugLevel.OFF)
        try:
            group = dist.new_group(timeout=datetime.timedelta(seconds=timeout_s))
        finally:
            dist.set_debug_level(before)
        row = {"scenario": kind, "detail": detail, "rank": rank, "error": None,
               "diagnosis": None}
        dist.barrier()  # on the healthy default group: both ranks start the scenario together
        t0 = time.perf_counter()
        with _stderr_captured() as log:
            try:
                with traced(f"{i}-{kind}"):
                    SCENARIOS[kind](rank, group, timeout_s)
            except HangError as e:
                row.update(error=str(e.__cause__), diagnosis=str(e))
            except RuntimeError as e:  # DETAIL's mismatch report, a closed connection
                row["error"] = str(e)
            finally:
                row["seconds"] = time.perf_counter() - t0
                # neither rank tears the group down before the other has met its own error: on
                # a busy machine the first to time out closed the connection, and its peer saw
                # "connection closed" instead of its timeout (and no diagnosis)
                dist.barrier()
                dist.destroy_process_group(group)
        row["log"] = log[0]
        out.append(row)
    dist.barrier()
    return out


def _short(error: str | None) -> str | None:
    """An error's message without gloo's source-location prefix, DETAIL's long fingerprints cut
    to the operation, shape and dtype."""
    if error is None:
        return None
    error = re.sub(r"^\[[^\]]*\.cc:\d+\]\s*", "", error).split(" This is typically")[0]
    fp = r"CollectiveFingerPrint\(SequenceNumber=\d+, OpType=(\w+), TensorShape=(\[[^\]]*\])," \
         r" TensorDtypes=(\w+),.*?\)\)\)"
    return re.sub(fp, r"\1 \2 \3", error).split(".Collectives differ")[0]


def planted_hangs(runs: list[tuple[str, bool]], timeout_s: float = 2.0,
                  launch_timeout_s: float = 180) -> list[dict]:
    """Run `plant` on 2 gloo ranks and return one row per scenario and rank: how long until the
    error, gloo's or DETAIL's message (shortened) and the tracer's diagnosis."""
    from ..launch import run

    _check_runs(runs, timeout_s)
    ranks = run(plant, 2, args=(runs, timeout_s), timeout_s=launch_timeout_s)
    rows = []
    for r in ranks:
        for row in r.value:
            rows.append({**row, "what": DESCRIPTIONS[row["scenario"]],
                         "message": _short(row["error"])})
    return sorted(rows, key=lambda row: (runs.index((row["scenario"], row["detail"])),
                                         row["rank"]))
