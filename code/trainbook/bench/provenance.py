"""Provenance: what every stored result says about how, when, with what and on what it was made.

A number read back from the repository is only as good as what it says about its making. Every
record carries the same header (`provenance`): the command that regenerates it, the UTC date,
the git commit of the checkout (and whether the package had uncommitted changes), the versions
of Python, torch and the libraries the result depends on, and the machine class. The machine
class is what decides whether a fresh run can reproduce a record bit for bit: on a CPU, the
model, the ATen kernel set PyTorch dispatched to (`ATEN_CPU_CAPABILITY` changes it), the BLAS,
the thread count and whether the slow low-precision path was forced; on a GPU, its name and
the CUDA/cuDNN versions. Two records of the same class compare exactly; across classes only
what the chapter asserts (trainbook.records).

Chapter: book/how-to-use (stored results).
"""

from __future__ import annotations

import datetime
import functools
import importlib.metadata
import os
import platform
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path

import torch

from .. import SLOW_LOWP_ENV, __version__

# what every provenance header holds; tests and `records list` read these keys
KEYS = ("command", "date_utc", "commit", "dirty", "versions", "machine")
MACHINE_KEYS = ("kind", "name", "aten_capability", "blas", "threads", "slow_lowp")


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=Path(__file__).parents[1], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


@functools.cache
def git_commit() -> tuple[str | None, bool | None]:
    """(commit, dirty) of the trainbook checkout that measured: numbers taken with uncommitted
    changes to the package say so. (None, None) outside a git checkout."""
    commit = (_git("rev-parse", "HEAD") or "").strip()
    if not re.fullmatch(r"[0-9a-f]{40}", commit):
        return None, None
    status = _git("status", "--porcelain", "--", ".")
    return commit, None if status is None else bool(status.strip())


def library_versions(names: Sequence[str] = ()) -> dict[str, str | None]:
    """Installed versions of the named distributions (None where one is not installed)."""
    out = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def versions(libraries: Sequence[str] = ()) -> dict:
    """Everything a number depends on that is not the device: the software stack."""
    cudnn = torch.backends.cudnn.version() if torch.cuda.is_available() else None
    commit, dirty = git_commit()
    return {"python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "hip": torch.version.hip, "cudnn": cudnn,
            "trainbook": __version__, "trainbook_commit": commit,
            "trainbook_package_dirty": dirty, **library_versions(libraries)}


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what platform knows."""
    path = Path("/proc/cpuinfo")
    if path.exists():
        for line in path.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def blas() -> str | None:
    """The BLAS torch was built with (BLAS_INFO of torch.__config__.show())."""
    found = re.search(r"BLAS_INFO=([^,\s]+)", torch.__config__.show())
    return found.group(1) if found else None


def machine(device: torch.device | str = "cpu") -> dict:
    """The machine class a result belongs to (see the module docstring)."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return {"kind": "gpu", "name": torch.cuda.get_device_name(index),
                "capability": ".".join(map(str, torch.cuda.get_device_capability(index))),
                "count": torch.cuda.device_count(), "aten_capability": None, "blas": None,
                "threads": None, "slow_lowp": None}
    return {"kind": "cpu", "name": cpu_model(), "arch": platform.machine(),
            "aten_capability": torch.backends.cpu.get_cpu_capability(), "blas": blas(),
            "threads": torch.get_num_threads(),
            "slow_lowp": os.environ.get(SLOW_LOWP_ENV, "").strip() not in ("", "0")}


def machine_class(m: dict) -> tuple:
    """What must be equal for two results to be comparable bit for bit."""
    return tuple(m.get(k) for k in ("kind", "name", "aten_capability", "blas", "threads",
                                    "slow_lowp", "capability"))


def provenance(command: str, device: torch.device | str = "cpu",
               libraries: Sequence[str] = ()) -> dict:
    """The header every stored record carries (keys in KEYS)."""
    if not isinstance(command, str) or not command.strip():
        raise ValueError("provenance needs the command that regenerates the record, e.g. "
                         "'python -m trainbook records regen NAME'")
    commit, dirty = git_commit()
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return {"command": command, "date_utc": now, "commit": commit, "dirty": dirty,
            "versions": versions(libraries), "machine": machine(device)}
