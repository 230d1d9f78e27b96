"""Checkpoints that resume exactly: atomic and durable single files, or sharded with DCP.

One process (or DDP, where every rank holds the same state) writes one file: torch.save to a
temporary name, fsync, rename, fsync the directory, so a crash leaves the old checkpoint or the
new one, never half of one, and a power loss cannot lose a rename the job already reported.
Loading uses `weights_only=True`: a checkpoint cannot run code.

A sharded layout (FSDP, TP, PP) writes a folder with `torch.distributed.checkpoint` (DCP): each
rank saves its shards under the reference parameter names, and DCP reshards on load, so a run
saved under one layout resumes under another (or in one process). The rest of the state (step,
data position, history, configs) is a small file beside the shards.

Chapter: book/start/first-run (resume); Part 6 (failures and recovery) builds on it.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import torch
import torch.distributed as dist

EXTRA = "extra.pt"  # the non-tensor state beside a DCP checkpoint's shards


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(path: str | Path, state: dict) -> None:
    """torch.save to a temporary file, fsync, rename, fsync the folder: atomic and durable."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as fh:
        torch.save(state, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def checkpoint_path(ckpt_dir: str | Path, step: int, sharded: bool = False) -> Path:
    """step-000042.pt (one file) or step-000042/ (a DCP folder)."""
    return Path(ckpt_dir) / (f"step-{step:06d}" if sharded else f"step-{step:06d}.pt")


def is_sharded(path: str | Path) -> bool:
    """A DCP folder (its metadata and the extra state written), not a single file."""
    path = Path(path)
    return path.is_dir() and (path / ".metadata").is_file() and (path / EXTRA).is_file()


def latest_checkpoint(ckpt_dir: str | Path) -> Path | None:
    """The highest-step complete checkpoint in ckpt_dir (file or DCP folder), or None."""
    found = [p for p in Path(ckpt_dir).glob("step-*")
             if (p.suffix == ".pt" and p.is_file()) or is_sharded(p)]
    return max(found, key=lambda p: p.name.removesuffix(".pt")) if found else None


def prune_checkpoints(ckpt_dir: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints (files or DCP folders) in ckpt_dir;
    returns what was deleted. Incomplete writes (`*.tmp`, a DCP folder without its extra state)
    older than the newest complete checkpoint go too: no process is still writing them (the
    run holds the directory's lock)."""
    import shutil

    if keep < 1:
        raise ValueError(f"keep must be >= 1 (the newest checkpoint is never deleted), got {keep}")
    ckpt_dir = Path(ckpt_dir)
    complete = sorted((p for p in ckpt_dir.glob("step-*")
                       if (p.suffix == ".pt" and p.is_file()) or is_sharded(p)),
                      key=lambda p: p.name.removesuffix(".pt"))
    if not complete:
        return []
    newest = complete[-1].name.removesuffix(".pt")
    stale = [p for p in ckpt_dir.glob("step-*") if p not in complete
             and p.name.removesuffix(".tmp").removesuffix(".pt") < newest]
    gone = complete[:-keep] + stale
    for p in gone:
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    return gone


def load_checkpoint(path: str | Path) -> dict:
    """Load with weights_only=True: a checkpoint cannot run code."""
    return torch.load(path, map_location="cpu", weights_only=True)


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


def save_sharded(path: str | Path, parts: list, optimizer: torch.optim.Optimizer,
                 extra: dict) -> None:
    """Every rank writes its shards of model and optimizer state (DCP); rank 0 the extra state,
    last, so a folder with `extra.pt` in it is complete."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    path = Path(path)
    model_sd, optim_sd = get_state_dict(as_one_module(parts), optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
    if dist.is_initialized():
        dist.barrier()
    if not dist.is_initialized() or dist.get_rank() == 0:
        save_checkpoint(path / EXTRA, extra)
    if dist.is_initialized():
        dist.barrier()


def load_sharded(path: str | Path, parts: list, optimizer: torch.optim.Optimizer) -> dict:
    """Load a DCP checkpoint into this layout's model parts and optimizer (resharding as
    needed); returns the extra state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    one = as_one_module(parts)
    model_sd, optim_sd = get_state_dict(one, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(one, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    return load_checkpoint(Path(path) / EXTRA)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
