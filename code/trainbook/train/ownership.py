"""Who owns a checkpoint folder: the run that writes into it, and no other.

Checkpoints are named by step, so a new run started in a folder that holds another run's
checkpoints overwrites them by name, leaves the folder mixing two runs, and, with --keep-last,
prunes its own fresh checkpoints because the other run's step is "newest". So a folder records
its owner in `RUN.json` (the identity of the run: a digest of the settings that decide what it
computes, its seed and a digest of its data) and a run may write into a folder only if the
folder holds no complete checkpoint, or if it resumes (--resume: the same run, which `check_resume`
verifies against the checkpoint itself), or if it is told to take the folder over
(--overwrite: the other run's checkpoints are deleted when this run writes its first, so a run
that dies before then has destroyed nothing).

Chapter: book/failures/checkpointing.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import shutil
from pathlib import Path

from .checkpoint import complete_checkpoints
from .integrity import OPERATIONAL, SUMS, _fsync_dir, read_sums, record_sums

OWNER = "RUN.json"


def identity(cfg: dict, data_sha256: str | None) -> dict:
    """What makes a run this run: the digest of its computing settings (a TrainConfig as a dict,
    less the operational ones), its seed and the digest of its data."""
    settings = {k: v for k, v in sorted(cfg.items()) if k not in OPERATIONAL}
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode())
    return {"config_sha256": digest.hexdigest(), "seed": cfg.get("seed"),
            "data_sha256": data_sha256}


def read_owner(folder: str | Path) -> dict | None:
    """The folder's RUN.json, or None (no owner recorded, or unreadable)."""
    try:
        return json.loads((Path(folder) / OWNER).read_text())
    except (OSError, ValueError):
        return None


def _describe(folder: Path, found: list[Path]) -> str:
    owner = read_owner(folder)
    started = f", started {owner['started_utc']}" if owner and owner.get("started_utc") else ""
    seed = f"seed {owner['identity']['seed']}, " if owner and owner.get("identity") else ""
    return f"{len(found)} checkpoint(s) of another run ({seed}newest {found[-1].name}{started})"


def claim(folder: str | Path, resume: bool, overwrite: bool) -> list[Path]:
    """Check, before any work, that this run may write into `folder` (every rank may call it:
    it only reads). Returns the entries an --overwrite run deletes at its first checkpoint;
    raises ValueError naming the way out when the folder belongs to another run."""
    folder = Path(folder)
    if resume and overwrite:
        raise ValueError("resume and overwrite contradict each other: --resume continues the run "
                         "in ckpt_dir, --overwrite replaces it; pass one")
    found = complete_checkpoints(folder) if folder.is_dir() else []
    if resume or not found:
        return []
    if not overwrite:
        raise ValueError(f"--ckpt-dir {folder} holds {_describe(folder, found)}: a new run there "
                         "would overwrite them by name; resume that run with --resume, write to "
                         "another --ckpt-dir, or pass --overwrite to replace them (deleted when "
                         "this run writes its first checkpoint)")
    return sorted(folder.glob("step-*"))  # with the other run's half-written ones


def record_owner(folder: str | Path, ident: dict) -> None:
    """Write RUN.json (rank 0): this run owns the folder from now on."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    owner = read_owner(folder)
    if owner and owner.get("identity") == ident:
        return
    doc = {"identity": ident, "started_utc": datetime.datetime.now(
        datetime.timezone.utc).isoformat(timespec="seconds"), "pid": os.getpid()}
    tmp = folder / (OWNER + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, folder / OWNER)
    _fsync_dir(folder)


def take_over(folder: str | Path, doomed: list[Path]) -> None:
    """Delete another run's checkpoints (and their SHA256SUMS entries): --overwrite, at this
    run's first checkpoint."""
    folder = Path(folder)
    for p in doomed:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        elif p.exists():
            p.unlink()
    listed = read_sums(folder)
    gone = [p.name for p in doomed if p.name in listed]
    if gone:
        record_sums(folder, {}, drop=gone)
    if not read_sums(folder) and (folder / SUMS).is_file():
        (folder / SUMS).unlink()
