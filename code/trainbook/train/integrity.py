"""The integrity of checkpoints: checksums recorded after the data and checked on load, a
write rate cap for fault injection, and the checks a resumed run makes against the
checkpoint's settings and data.

`HashingWriter` hashes (sha256) the bytes torch.save writes as they go, so a checkpoint's
checksum costs no second read; `record_sums` keeps a folder's `SHA256SUMS` (the format of
`sha256sum`, so `sha256sum -c SHA256SUMS` checks it too), written atomically after the files
it lists; `checksum_problems` compares files with it. TRAINBOOK_CKPT_WRITE_MBPS=<MB/s> caps the
rate at which checkpoint files are written (decimal MB/s), to play a slow file system and to
kill a run in the middle of a write. `data_digest` fingerprints the training data and
`check_resume` refuses a resume whose data order would not continue where it stopped, and
names every other setting that changed.

Chapter: book/failures/checkpointing; book/failures/exact-resume.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

import torch

SUMS = "SHA256SUMS"  # checksums of a directory's checkpoint files (sha256sum's format)
RATE_ENV = "TRAINBOOK_CKPT_WRITE_MBPS"
UNVERIFIED = "no checksum recorded"  # checksum_problems' words for a file nothing vouches for
_CHUNK = 1 << 16  # bytes per write when the rate is capped: the file grows smoothly


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_rate_limit() -> float | None:
    """The checkpoint write rate cap in bytes/s from TRAINBOOK_CKPT_WRITE_MBPS, or None."""
    text = os.environ.get(RATE_ENV, "").strip()
    if not text:
        return None
    try:
        mbps = float(text)
    except ValueError:
        mbps = float("nan")
    if not 0 < mbps < float("inf"):
        raise ValueError(f"{RATE_ENV}={text!r} must be a positive number of MB/s (e.g. 2), or "
                         "unset")
    return mbps * 1e6


class HashingWriter:
    """A file-like sink for torch.save: passes the bytes on to `fh`, hashes them (sha256) and
    counts them; with `rate` (bytes/s) it also writes no faster than that."""

    def __init__(self, fh: BinaryIO, rate: float | None = None):
        self.fh, self.rate = fh, rate
        self.digest = hashlib.sha256()
        self.bytes = 0
        self._start = time.perf_counter()

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        step = _CHUNK if self.rate else max(len(view), 1)
        for i in range(0, len(view), step):
            piece = view[i:i + step]
            self.fh.write(piece)
            self.digest.update(piece)
            self.bytes += len(piece)
            if self.rate:
                ahead = self.bytes / self.rate - (time.perf_counter() - self._start)
                if ahead > 0:
                    self.fh.flush()  # the bytes so far are on their way: the file grows
                    time.sleep(ahead)
        return len(view)

    def flush(self) -> None:
        self.fh.flush()

    @property
    def sha256(self) -> str:
        return self.digest.hexdigest()


def file_sha256(path: str | Path) -> str:
    """sha256 of a file's bytes, read in 8 MiB pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while piece := fh.read(8 << 20):
            h.update(piece)
    return h.hexdigest()


def read_sums(folder: str | Path) -> dict[str, str]:
    """name -> sha256 from a folder's SHA256SUMS ({} when it has none)."""
    path = Path(folder) / SUMS
    if not path.is_file():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        digest, sep, name = line.partition("  ")
        if sep and re.fullmatch(r"[0-9a-f]{64}", digest):
            out[name] = digest
    return out


def record_sums(folder: str | Path, add: dict[str, str], drop: Iterable[str] = ()) -> None:
    """Add (or replace) and drop entries of a folder's SHA256SUMS, atomically and durably."""
    folder = Path(folder)
    sums = {k: v for k, v in read_sums(folder).items() if k not in set(drop)}
    sums.update(add)
    tmp = folder / (SUMS + ".tmp")
    with open(tmp, "w") as fh:
        fh.writelines(f"{sums[k]}  {k}\n" for k in sorted(sums))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, folder / SUMS)
    _fsync_dir(folder)


def checksum_problems(path: str | Path, only: Iterable[str] | None = None) -> tuple[list[str],
                                                                                     list[str]]:
    """(files checked, problems) of a checkpoint against its recorded sha256s: a single file's
    entry in its folder's SHA256SUMS, or every file of a DCP folder against the folder's
    (`only`: just these names). A file without a recorded checksum is a problem: nothing can
    vouch for it."""
    path = Path(path)
    if path.is_dir():
        sums, folder = read_sums(path), path
        names = sorted(only) if only is not None else \
            sorted({p.name for p in path.iterdir() if p.is_file() and p.name != SUMS} | set(sums))
    else:
        sums, folder, names = read_sums(path.parent), path.parent, [path.name]
    checked, problems = [], []
    for name in names:
        if name not in sums:
            problems.append(f"{name}: {UNVERIFIED} in {folder / SUMS} (a crash between "
                            "the write and its checksum, or a file written without one)")
            continue
        if not (folder / name).is_file():
            problems.append(f"{name}: listed in {SUMS} but missing (an incomplete copy?)")
            continue
        checked.append(name)
        got = file_sha256(folder / name)
        if got != sums[name]:
            problems.append(f"{name}: sha256 {got[:16]}... differs from the recorded "
                            f"{sums[name][:16]}...: its bytes changed after it was written")
    return checked, problems


class CorruptCheckpoint(ValueError):
    """A checkpoint whose bytes differ from the checksum recorded when it was written."""


def data_digest(blocks: torch.Tensor) -> str:
    """sha256 of the training data's token blocks: a checkpoint records it, so a run resumed
    on a corpus that changed (same name, other bytes) is refused instead of silently differing."""
    return hashlib.sha256(blocks.contiguous().numpy().tobytes()).hexdigest()


# Settings that decide which data each step sees: a resumed run must keep them (the loader
# itself refuses another batch_size or data-parallel size).
DATA_ORDER = ("seed", "corpus", "tokenizer")
# Settings that change how a run is operated, not what it computes.
OPERATIONAL = ("ckpt_dir", "ckpt_every", "keep_last", "resume", "resume_from", "stop_after",
               "timeout_s", "progress", "cache_dir", "log_every", "eval_every", "eval_batches",
               "monitor", "device", "layout", "dp_replicate", "dp_shard", "tp", "pp", "cp",
               "pp_schedule", "recompute", "ckpt_async", "overwrite", "allow_unverified")


def check_resume(state: dict, cfg: dict, data_sha256: str | None = None,
                 where: str = "the checkpoint") -> list[str]:
    """Compare a checkpoint's training settings (state['train_config']) and data with the
    resuming run's (`cfg`, a TrainConfig as a dict). Raises ValueError when the data order
    would not continue where it stopped (another seed, corpus or tokenizer, or a corpus whose
    bytes changed); returns a note naming every other setting that changed, since from there
    on the run is not the uninterrupted one (a deliberate change is fine: it is logged)."""
    saved = state.get("train_config") or {}
    # the corpus and tokenizer are compared by what they produce (the token blocks' digest)
    # where both sides have it, not by how their paths are spelled
    by_content = bool(data_sha256 and state.get("data_sha256"))
    for key in DATA_ORDER:
        if by_content and key in ("corpus", "tokenizer"):
            continue
        if key in saved and saved[key] != cfg.get(key):
            raise ValueError(f"{where} was trained with {key}={saved[key]!r}, this run has "
                             f"{key}={cfg.get(key)!r}: the data order would not continue where "
                             f"it stopped; resume with the same {key}, or train from scratch "
                             "in another ckpt_dir")
    if data_sha256 and state.get("data_sha256") not in (None, data_sha256):
        raise ValueError(f"the training data differs from {where}'s (sha256 "
                         f"{data_sha256[:12]}... vs {state['data_sha256'][:12]}...): the corpus "
                         "or tokenizer file changed since it was written; resume on the same "
                         "data, or train from scratch in another ckpt_dir")
    changed = [f"{k} {saved[k]!r} -> {cfg[k]!r}" for k in sorted(saved)
               if k in cfg and k not in OPERATIONAL and saved[k] != cfg[k]
               and not (by_content and k in ("corpus", "tokenizer"))]
    return [f"resumed with changed settings ({'; '.join(changed)}): from here on the run is "
            "not the uninterrupted one"] if changed else []
