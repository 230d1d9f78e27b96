"""Checkpoints that resume exactly: atomic, durable and checksummed single files, or sharded
with DCP.

One process (or DDP, where every rank holds the same state) writes one file: torch.save to a
temporary name, fsync, rename, fsync the directory, so a crash leaves the old checkpoint or the
new one, never half of one, and a power loss cannot lose a rename the job already reported. The
file's sha256, computed from the bytes as they are written (no second read), then goes into the
directory's `SHA256SUMS` (the format of `sha256sum`, so `sha256sum -c SHA256SUMS` checks it too):
written after the data, so a checkpoint with a matching entry was complete and has not changed
since. Loading checks that entry and uses `weights_only=True`: a checkpoint cannot run code.

A sharded layout (FSDP, TP, PP) writes a folder with `torch.distributed.checkpoint` (DCP): each
rank saves its shards under the reference parameter names, and DCP reshards on load, so a run
saved under one layout resumes under another (or in one process). The rest of the state (step,
data position, every rank's random state, history, configs) is a small file beside the shards,
written last; then the folder's own `SHA256SUMS` (each rank hashes the shard files it wrote).

`AsyncCheckpointer` writes single files in a background thread: the step pays for a copy of
the state, not for the write. Checksums, the write rate cap for fault injection
(TRAINBOOK_CKPT_WRITE_MBPS) and `check_resume` (a resumed run's settings and data against the
checkpoint's) live in `integrity`, re-exported here.

Chapter: book/start/first-run (resume); book/failures/checkpointing; book/failures/exact-resume.
"""

from __future__ import annotations

import os
import random
import re
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from .integrity import (  # noqa: F401  (re-exported: the checkpoint API in one place)
    DATA_ORDER,
    OPERATIONAL,
    RATE_ENV,
    SUMS,
    UNVERIFIED,
    CorruptCheckpoint,
    HashingWriter,
    _fsync_dir,
    check_resume,
    checksum_problems,
    data_digest,
    file_sha256,
    read_sums,
    record_sums,
    write_rate_limit,
)

EXTRA = "extra.pt"  # the non-tensor state beside a DCP checkpoint's shards
_STEP = re.compile(r"^step-(\d+)")


def save_checkpoint(path: str | Path, state: dict, checksum: bool = True) -> str:
    """torch.save to a temporary file, fsync, rename, fsync the folder: atomic and durable.
    Then (checksum=True) the file's sha256 goes into the folder's SHA256SUMS. Returns the sha256."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as fh:
        sink = HashingWriter(fh, write_rate_limit())
        torch.save(state, sink)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    if checksum:
        record_sums(path.parent, {path.name: sink.sha256})
    return sink.sha256


UNVERIFIED_RULES = ("ignore", "warn", "refuse")


def _refuse_corrupt(path: Path, problems: list[str], unverified_rule: str = "ignore") -> None:
    """Raise CorruptCheckpoint for a file whose bytes changed, naming the checkpoint before it.
    A file with no recorded checksum (a copy made without its SHA256SUMS, or a file from
    elsewhere) has nothing to vouch for its bytes: `unverified_rule` says whether to load it
    anyway ("ignore": any PyTorch checkpoint, for the tools), with a warning on stderr ("warn")
    or not at all ("refuse": the trainer's resume)."""
    if unverified_rule not in UNVERIFIED_RULES:
        raise ValueError(f"unverified_rule must be one of {UNVERIFIED_RULES}, got "
                         f"{unverified_rule!r}")
    bad = [p for p in problems if UNVERIFIED not in p]
    unverified = [p for p in problems if UNVERIFIED in p]
    if bad:
        step = _step_of(path)
        older = [p for p in complete_checkpoints(path.parent)
                 if step is not None and _step_of(p) < step]
        fix = f"resume from the one before it (--resume-from {older[-1]})" if older else \
            "there is no older checkpoint to fall back to"
        raise CorruptCheckpoint(f"checkpoint {path} is corrupt: {'; '.join(bad)}. Do not load "
                                f"it; {fix}, and check the storage")
    if not unverified or unverified_rule == "ignore":
        return
    why = (f"checkpoint {path} has no recorded checksum ({SUMS} is missing or does not list it: "
           "a copy made without it, or a file written elsewhere), so nothing vouches that its "
           "bytes are the ones written")
    if unverified_rule == "refuse":
        raise CorruptCheckpoint(f"{why}; verify it another way, then resume with "
                                "--allow-unverified")
    print(f"warning: {why}; loading it as --allow-unverified asks", file=sys.stderr, flush=True)


def load_checkpoint(path: str | Path, verify: bool = True,
                    unverified_rule: str = "ignore") -> dict:
    """Load with weights_only=True: a checkpoint cannot run code. With verify (default), first
    check the file's recorded sha256 (when there is one): a corrupt file raises
    CorruptCheckpoint naming the previous checkpoint; a file with none is loaded, warned about
    or refused as `unverified_rule` says (the trainer's resume refuses it)."""
    path = Path(path)
    if verify and path.name != EXTRA:  # a DCP folder's extra state: load_sharded checks it
        _refuse_corrupt(path, checksum_problems(path)[1], unverified_rule)
    return torch.load(path, map_location="cpu", weights_only=True)


def checkpoint_path(ckpt_dir: str | Path, step: int, sharded: bool = False) -> Path:
    """step-000042.pt (one file) or step-000042/ (a DCP folder)."""
    return Path(ckpt_dir) / (f"step-{step:06d}" if sharded else f"step-{step:06d}.pt")


def is_sharded(path: str | Path) -> bool:
    """A DCP folder (its metadata and the extra state written), not a single file."""
    path = Path(path)
    return path.is_dir() and (path / ".metadata").is_file() and (path / EXTRA).is_file()


def _step_of(path: Path) -> int | None:
    m = _STEP.match(path.name)
    return int(m.group(1)) if m else None


def complete_checkpoints(ckpt_dir: Path) -> list[Path]:
    """The complete checkpoints of a directory (files and DCP folders), oldest first."""
    found = [p for p in Path(ckpt_dir).glob("step-*")
             if (p.suffix == ".pt" and p.is_file()) or is_sharded(p)]
    return sorted(found, key=lambda p: (_step_of(p), p.name))


def latest_checkpoint(ckpt_dir: str | Path) -> Path | None:
    """The highest-step complete checkpoint in ckpt_dir (file or DCP folder), or None."""
    found = complete_checkpoints(Path(ckpt_dir))
    return found[-1] if found else None


def prune_checkpoints(ckpt_dir: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints (files or DCP folders) in ckpt_dir,
    and their SHA256SUMS entries; returns what was deleted. Incomplete writes (`*.tmp`, a DCP
    folder without its extra state) older than the newest complete checkpoint go too: no
    process is still writing them (the run holds the directory's lock)."""
    import shutil

    if keep < 1:
        raise ValueError(f"keep must be >= 1 (the newest checkpoint is never deleted), got {keep}")
    ckpt_dir = Path(ckpt_dir)
    complete = complete_checkpoints(ckpt_dir)
    if not complete:
        return []
    newest = _step_of(complete[-1])
    stale = [p for p in ckpt_dir.glob("step-*") if p not in complete
             and _step_of(p) is not None and _step_of(p) < newest]
    gone = complete[:-keep] + stale
    for p in gone:
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    listed = read_sums(ckpt_dir)
    if any(p.name in listed for p in gone):
        record_sums(ckpt_dir, {}, drop=[p.name for p in gone])
    return gone


def as_one_module(parts: list) -> torch.nn.Module:
    """The model parts of this rank (pipeline stages, or the whole model) under one module with
    the reference names ("blocks.3.attn.q.weight"), so DCP keys are the same in every layout."""
    one, blocks = torch.nn.Module(), torch.nn.ModuleDict()
    for part in parts:
        for name, child in part.named_children():
            if name == "blocks":
                keyed = isinstance(child, torch.nn.ModuleDict)
                items = child.items() if keyed else enumerate(child)
                blocks.update({str(k): b for k, b in items})
            elif child is not None:
                setattr(one, name, child)
    one.blocks = blocks
    return one


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


@contextmanager
def single_process_dcp() -> Iterator[bool]:
    """DCP in one process (no process group) warns that it assumes one process on every call;
    that is the intent here: silence it. Yields `no_dist` for DCP's calls."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield not dist.is_initialized()


def save_sharded(path: str | Path, parts: list, optimizer: torch.optim.Optimizer,
                 extra: dict) -> None:
    """Every rank writes its shards of model and optimizer state (DCP) and hashes the files it
    wrote; rank 0 writes the extra state, last, so a folder with `extra.pt` in it is complete,
    then the folder's SHA256SUMS."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    path = Path(path)
    model_sd, optim_sd = get_state_dict(as_one_module(parts), optimizer)
    with single_process_dcp() as no_dist:
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path), no_dist=no_dist)
    mine = {p.name: file_sha256(p) for p in path.glob(f"__{_rank()}_*.distcp")}
    every = [mine]
    if dist.is_initialized():
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    if _rank() == 0:
        sums = {k: v for d in every for k, v in d.items()}
        sums[".metadata"] = file_sha256(path / ".metadata")
        sums[EXTRA] = save_checkpoint(path / EXTRA, extra, checksum=False)
        record_sums(path, sums)
    if dist.is_initialized():
        dist.barrier()


def verify_sharded(path: str | Path, unverified_rule: str = "ignore") -> None:
    """Check every file of a DCP folder against its SHA256SUMS before any of it is loaded: the
    ranks split the files (each hashes every world-size-th), then share what they found, so
    every rank refuses a corrupt checkpoint together and the folder is read once in all."""
    path = Path(path)
    names = sorted({p.name for p in path.iterdir() if p.is_file() and p.name != SUMS}
                   | set(read_sums(path)))
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    problems = checksum_problems(path, only=names[rank::world])[1]
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, problems)
        problems = [p for found in every for p in found]
    _refuse_corrupt(path, problems, unverified_rule)


def load_sharded(path: str | Path, parts: list, optimizer: torch.optim.Optimizer,
                 unverified_rule: str = "ignore") -> dict:
    """Load a DCP checkpoint into this layout's model parts and optimizer (resharding as
    needed), after checking every file of it, shards included, against the folder's
    SHA256SUMS (`verify_sharded`); returns the extra state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = Path(path)
    verify_sharded(path, unverified_rule)
    one = as_one_module(parts)
    model_sd, optim_sd = get_state_dict(one, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    with single_process_dcp() as no_dist:
        dcp.load(state, checkpoint_id=str(path), no_dist=no_dist)
    set_state_dict(one, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    return torch.load(path / EXTRA, map_location="cpu", weights_only=True)


def _local_rng() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def rng_state() -> dict:
    """This process's random state (torch CPU and CUDA, Python's). Under torch.distributed,
    every rank must call it: the result also holds every rank's state, in rank order
    (`ranks`), so that each rank resumes its own stream, not rank 0's."""
    state = _local_rng()
    if dist.is_initialized() and dist.get_world_size() > 1:
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, state)
        state["ranks"] = ranks
    return state


def set_rng_state(state: dict) -> None:
    """Restore what rng_state saved: this rank's own state when the checkpoint holds every
    rank's and the world size is the same, else the saved (rank 0's) one."""
    ranks = state.get("ranks")
    if ranks and dist.is_initialized() and len(ranks) == dist.get_world_size():
        state = ranks[dist.get_rank()]
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def staged(state: object) -> object:
    """A copy of a state whose tensors are cloned to the CPU: what an asynchronous save writes
    while training goes on changing the originals."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: staged(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(staged(v) for v in state)
    return state


class AsyncCheckpointer:
    """Single-file checkpoints written in a background thread. `save` copies the state (the
    step's stall), waits for the previous write to finish first (one in flight: memory for
    one copy), then returns while the thread writes it with save_checkpoint and calls `after`
    (e.g. pruning). `wait()` blocks until the write is done and re-raises its error."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, path: str | Path, state: dict,
             after: Callable[[], object] | None = None) -> None:
        self.wait()
        copy = staged(state)

        def write():
            try:
                save_checkpoint(path, copy)
                if after is not None:
                    after()
            except BaseException as e:  # re-raised by wait(), in the training thread
                self._error = e

        self._thread = threading.Thread(target=write, name="trainbook-ckpt-writer", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
