"""The contract for stored results: one registry (`registry.RECORDS`), one provenance header,
and one way to list, check and regenerate every file under `book/*/data` and `data/`.

- `regen(record)` runs the record's writer into a temporary folder, stamps each JSON file with
  the provenance header (`bench.provenance`: command `python -m trainbook records regen NAME`,
  date, commit, versions, machine class) and only then moves the files into the repository.
- `check(record)` regenerates into a temporary folder and compares with what is stored: on the
  machine class that wrote a deterministic record, every value must be equal; on another, every
  value within the record's tolerance; chaotic runs and measurements are held to what the
  chapter asserts (the record's `check` function). Nothing in the repository changes.

A CPU stands in for another with `ATEN_CPU_CAPABILITY=avx2` (or `default`): PyTorch then
dispatches another set of vectorised kernels, which round differently, and the record is
compared as if from another machine class.

Chapter: book/how-to-use (stored results).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..bench.provenance import KEYS, machine_class, provenance
from .registry import KINDS, RECORDS, Record

# header fields of the writers that differ run to run and say nothing about the result
VOLATILE = {"provenance", "command", "date", "date_utc", "versions", "device", "device_name",
            "machine", "host", "threads", "torch", "python", "cuda", "hip", "commit",
            "uncommitted_changes", "transformers_version", "lm_eval_version"}
DATA_GLOBS = ("book/*/data/**/*", "data/**/*")


def root(start: str | os.PathLike | None = None) -> Path:
    """The repository: the first folder from `start` upwards that holds `_toc.yml` and `book/`;
    without `start`, from the working directory, then from this package."""
    bases = [Path(start).resolve()] if start else [Path.cwd(), Path(__file__).resolve()]
    for base in bases:
        for folder in (base, *base.parents):
            if (folder / "_toc.yml").is_file() and (folder / "book").is_dir():
                return folder
    raise ValueError(f"records need the trainbook repository (a folder with _toc.yml and book/)"
                     f"{f'; {start} is not in one' if start else ''}: run from a clone, or pass "
                     "--root PATH")


def get(name: str) -> Record:
    """The record called `name`, or a ValueError listing the names."""
    for r in RECORDS:
        if r.name == name:
            return r
    raise ValueError(f"no record named {name!r}; `python -m trainbook records list` names all "
                     f"{len(RECORDS)}")


def stored_files(repo: Path) -> list[str]:
    """Every file under book/*/data and data/, relative to the repository."""
    found = {str(p.relative_to(repo)) for g in DATA_GLOBS for p in repo.glob(g) if p.is_file()}
    return sorted(found)


def undeclared(repo: Path) -> list[str]:
    """Files under the data folders that no record declares."""
    declared = {f for r in RECORDS for f in r.files}
    return [f for f in stored_files(repo) if f not in declared]


def read_provenance(repo: Path, record: Record) -> dict | None:
    """The stored provenance header of the record's first JSON file (None for inputs and
    files without one)."""
    for f in record.files:
        if f.endswith(".json") and (repo / f).is_file():
            return json.loads((repo / f).read_text()).get("provenance")
    return None


def listing(repo: Path) -> list[dict]:
    """One row per record: name, chapter, kind, machine, date, size on disk."""
    rows = []
    for r in RECORDS:
        prov = read_provenance(repo, r) or {}
        m = prov.get("machine") or {}
        where = m.get("name") and f"{m['name']} ({m.get('aten_capability') or '?'})"
        size = sum((repo / f).stat().st_size for f in r.files if (repo / f).is_file())
        rows.append({"name": r.name, "chapter": r.chapter, "kind": r.kind,
                     "machine": where or "-", "date": (prov.get("date_utc") or "-")[:10],
                     "bytes": size, "minutes": r.minutes})
    return rows


# ---- running a writer -------------------------------------------------------------------------

def _resolve(spec: str):
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


def _arguments(record: Record, repo: Path, out: Path) -> dict:
    args = {}
    for key, value in record.args.items():
        if isinstance(value, str) and value.startswith(("book/", "data/")):
            value = str(repo / value)
        if key in record.build:
            make = _resolve(record.build[key])
            value = make(**value) if isinstance(value, dict) else make(value)
        args[key] = value
    args[record.out] = str(out)
    return args


def command(record: Record) -> str:
    return f"python -m trainbook records regen {record.name}"


def _write(record: Record, repo: Path, folder: Path) -> None:
    """Run the record's writer so that its files land in `folder` (no provenance yet)."""
    target = folder if record.out_kind == "folder" else folder / Path(record.files[0]).name
    if record.argv:
        argv = [str(target) if a == "{out}" else a for a in record.argv]
        argv = [str(repo / a) if a.startswith(("book/", "data/")) else a for a in argv]
        if argv[0] == "python":
            argv[0] = sys.executable
        subprocess.run(argv, cwd=repo, check=True)
    else:
        _resolve(record.writer)(**_arguments(record, repo, target))


def _stamp(record: Record, folder: Path) -> None:
    header = provenance(command(record))
    header.update(record=record.name, writer=record.writer or " ".join(record.argv),
                  arguments=record.args)
    for f in record.files:
        path = folder / Path(f).name
        if path.suffix == ".json":
            doc = json.loads(path.read_text())
            doc["provenance"] = header
            path.write_text(json.dumps(doc, indent=1, default=str) + "\n")


def _check_runnable(record: Record) -> None:
    if record.kind == "input":
        raise ValueError(f"{record.name} is {KINDS['input']}; edit it by hand")


@contextmanager
def _fresh(record: Record, repo: Path) -> Iterator[Path]:
    """A regeneration in a temporary folder, stamped (deleted when the context ends)."""
    _check_runnable(record)
    with tempfile.TemporaryDirectory(prefix=f"trainbook-{record.name}-") as tmp:
        _write(record, repo, Path(tmp))
        missing = [f for f in record.files if not (Path(tmp) / Path(f).name).is_file()]
        if missing:
            raise RuntimeError(f"{record.name}: the writer did not write {missing}")
        _stamp(record, Path(tmp))
        yield Path(tmp)


def regen(record: Record, repo: Path) -> list[Path]:
    """Regenerate the record's files in the repository (written whole, each by a rename)."""
    written = []
    with _fresh(record, repo) as folder:
        for f in record.files:
            dest = repo / f
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(dest.name + ".tmp")
            shutil.copyfile(folder / dest.name, tmp)
            os.replace(tmp, dest)
            written.append(dest)
    return written


# ---- comparing ----------------------------------------------------------------------------------

def compare_values(stored: Any, fresh: Any, rtol: float, atol: float,
                   ignore: Iterable[str] = (), path: str = "") -> list[str]:
    """Where two JSON documents differ beyond |a - b| <= atol + rtol |a| (numbers), or at all
    (anything else); keys in VOLATILE or `ignore` are skipped."""
    if isinstance(stored, dict) and isinstance(fresh, dict):
        out = []
        skip = VOLATILE | set(ignore)
        for k in sorted(set(stored) | set(fresh), key=str):
            if k in skip:
                continue
            if k not in stored or k not in fresh:
                out.append(f"{path}/{k}: only in the {'fresh' if k in fresh else 'stored'} run")
                continue
            out += compare_values(stored[k], fresh[k], rtol, atol, ignore, f"{path}/{k}")
        return out
    if isinstance(stored, list) and isinstance(fresh, list):
        if len(stored) != len(fresh):
            return [f"{path}: {len(stored)} items stored, {len(fresh)} fresh"]
        return [d for i, (a, b) in enumerate(zip(stored, fresh))
                for d in compare_values(a, b, rtol, atol, ignore, f"{path}[{i}]")]
    numbers = (int, float)
    if isinstance(stored, numbers) and isinstance(fresh, numbers) \
            and not isinstance(stored, bool) and not isinstance(fresh, bool):
        a, b = float(stored), float(fresh)
        if math.isnan(a) and math.isnan(b) or a == b:
            return []
        if math.isfinite(a) and math.isfinite(b) and abs(a - b) <= atol + rtol * abs(a):
            return []
        return [f"{path}: stored {stored!r}, fresh {fresh!r}"]
    return [] if stored == fresh else [f"{path}: stored {stored!r}, fresh {fresh!r}"]


def largest_difference(stored: Any, fresh: Any,
                       ignore: Iterable[str] = ()) -> tuple[float, float]:
    """(largest |a - b|, largest |a - b| / |a|) over the numbers the two documents share at the
    same place: what a kernel set or a machine changed."""
    if isinstance(stored, dict) and isinstance(fresh, dict):
        pairs = [(stored[k], fresh[k]) for k in set(stored) & set(fresh)
                 if k not in VOLATILE | set(ignore)]
    elif isinstance(stored, list) and isinstance(fresh, list):
        pairs = list(zip(stored, fresh))
    elif (isinstance(stored, (int, float)) and isinstance(fresh, (int, float))
          and not isinstance(stored, bool) and math.isfinite(stored) and math.isfinite(fresh)):
        d = abs(float(stored) - float(fresh))
        return d, (d / abs(stored) if stored else (0.0 if d == 0 else math.inf))
    else:
        return 0.0, 0.0
    found = [largest_difference(a, b, ignore) for a, b in pairs]
    return (max((f[0] for f in found), default=0.0), max((f[1] for f in found), default=0.0))


def same_class(stored_prov: dict | None) -> bool:
    """Whether this process runs on the machine class that wrote the record."""
    if not stored_prov or not stored_prov.get("machine"):
        return False
    return machine_class(stored_prov["machine"]) == machine_class(provenance("x")["machine"])


def compare_record(record: Record, stored: dict, fresh: dict) -> list[str]:
    """What a fresh regeneration of `record` must reproduce of the stored one (KINDS)."""
    if record.check:
        return list(_resolve(record.check)(stored, fresh))
    if record.kind == "deterministic":
        rtol, atol = (0.0, 0.0) if same_class(stored.get("provenance")) else record.tolerance
        return compare_values(stored, fresh, rtol, atol, record.ignore)
    return _structure(stored, fresh)


def _structure(stored, fresh, path: str = "") -> list[str]:
    """Same keys at every level (measurements: the values are this machine's)."""
    if isinstance(stored, dict) and isinstance(fresh, dict):
        keys = (set(stored) ^ set(fresh)) - VOLATILE
        out = [f"{path}/{k}: only in the {'fresh' if k in fresh else 'stored'} run" for k in keys]
        return out + [d for k in set(stored) & set(fresh) if k not in VOLATILE
                      for d in _structure(stored[k], fresh[k], f"{path}/{k}")]
    return []


def check(record: Record, repo: Path, differences: dict | None = None) -> list[str]:
    """Regenerate in a temporary folder and compare with the stored files: the problems found
    (none when the record reproduces). Safetensors files compare by tensor. `differences`, if
    given, receives each JSON file's largest_difference."""
    problems = []
    exact = same_class(read_provenance(repo, record))
    with _fresh(record, repo) as folder:
        for f in record.files:
            new = folder / Path(f).name
            if f.endswith(".json"):
                stored, doc = json.loads((repo / f).read_text()), json.loads(new.read_text())
                problems += [f"{f}{p}" for p in compare_record(record, stored, doc)]
                if differences is not None:
                    differences[f] = largest_difference(stored, doc, record.ignore)
            elif f.endswith(".safetensors"):
                problems += [f"{f}: {p}" for p in _compare_tensors(repo / f, new, record, exact)]
    return problems


def _compare_tensors(stored: Path, fresh: Path, record: Record, exact: bool) -> list[str]:
    from safetensors.torch import load_file

    a, b = load_file(str(stored)), load_file(str(fresh))
    if set(a) != set(b):
        return [f"tensors differ: {sorted(set(a) ^ set(b))}"]
    rtol, atol = (0.0, 0.0) if exact else record.tolerance
    out = []
    for k in sorted(a):
        diff = (a[k].double() - b[k].double()).abs()
        bound = atol + rtol * a[k].double().abs()
        if a[k].shape != b[k].shape or bool((diff > bound).any()):
            out.append(f"{k}: max |difference| {diff.max().item():.3g}")
    return out


__all__ = ["KEYS", "KINDS", "RECORDS", "Record", "check", "command", "compare_values", "get",
           "listing", "regen", "root", "stored_files", "undeclared"]
