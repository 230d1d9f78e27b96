"""Execute each notebook once: the test run and the book build share one jupyter-cache.

The book builds with myst-nb's execution mode `cache` (_config.yml): a notebook whose code cells
match an executed copy in the cache is rendered from that copy instead of being run again. The test
run (tests/test_notebooks.py) executes every notebook as myst-nb does (the notebook's kernel, the
notebook's folder as working directory, _config.yml's cell timeout, a failing cell is an error) and
stores it in that cache, so a build after the tests executes nothing. Either command alone still
executes every notebook it needs.

What may be reused is decided in two steps:

* jupyter-cache matches a notebook by its code cells (source and metadata) and kernel: a changed
  cell makes the notebook run again; a changed Markdown cell does not.
* the cache folder, `_build/.jupyter_cache/<key>`, is chosen by what jupyter-cache cannot see: the
  package (every file under code/), the files beside the notebooks that they may read (book/, other
  than .ipynb, .md and .bib), the pinned environment (requirements.txt, the Python and torch
  versions), and how the notebooks run here (device, nb.pick_size()'s size, TRAINBOOK_SLOW_LOWP).
  Editing the package or changing those variables selects another folder, so outputs of other code
  or of another setting are never served, and nothing needs clearing by hand. The newest few folders
  are kept.

    python tools/nbcache.py times    # per-notebook execution times stored in the caches
    python tools/nbcache.py where    # the cache folder a run from this shell would use
    python tools/nbcache.py clear    # delete every cache

As a Sphinx extension (sphinx.local_extensions in _config.yml) it points myst-nb at that folder.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
import tempfile
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHES = ROOT / "_build" / ".jupyter_cache"
KEEP = 4  # cache folders kept (the newest by use); older ones are deleted
# What the notebooks run besides their code cells: the package, the files beside the notebooks
# (data they may read; not the notebooks, pages and bibliography themselves) and the pinned
# environment.
HASHED = (
    ("code", ("__pycache__", ".egg-info", "build", ".pyc")),
    ("book", (".ipynb", ".md", ".bib", ".ipynb_checkpoints", "_build")),
    ("requirements.txt", ()),
)


def _skipped(path: Path, skip: tuple[str, ...]) -> bool:
    """Build products, and hidden folders that tools write between the tests and the build
    (ruff's code/.ruff_cache once changed the key and made the build run every notebook again)."""
    return any(part.endswith(s) for part in path.parts for s in skip) or \
        any(part.startswith(".") for part in path.parts)


def fingerprint(root: Path = ROOT) -> str:
    """A digest of the files the notebooks' outputs depend on, besides the notebooks' code cells."""
    h = hashlib.sha256()
    for name, skip in HASHED:
        base = root / name
        files = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file())
        for path in files:
            rel = path.relative_to(root)
            if not _skipped(rel, skip):
                h.update(f"{rel}\0".encode() + path.read_bytes() + b"\0")
    return h.hexdigest()


def conditions() -> dict[str, str]:
    """How a notebook executed from this process runs: a kernel inherits this environment."""
    import torch

    from trainbook import nb
    from trainbook.bench import lowp

    return {
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "size": nb.pick_size(),
        "lowp": "slowlowp" if lowp.slow_path_forced() else "native",
        "versions": f"py{platform.python_version()}-torch{torch.__version__}",
        # another kernel set (ATEN_CPU_CAPABILITY=avx2 or default) computes other last bits:
        # its outputs are another machine's and never the build's
        "kernels": os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower() or "native",
    }


def key() -> str:
    """The cache folder's name: readable conditions, then a digest of everything in the key."""
    c = conditions()
    digest = hashlib.sha256(f"{sorted(c.items())}{fingerprint()}".encode()).hexdigest()
    kernels = "" if c["kernels"] == "native" else f"-{c['kernels']}"
    return f"{c['size']}-{c['device']}-{c['lowp']}{kernels}-{digest[:16]}"


def cache_path() -> Path:
    """This process's cache folder (created, marked as just used; the oldest beyond KEEP go)."""
    path = CACHES / key()
    path.mkdir(parents=True, exist_ok=True)
    path.touch()
    folders = sorted((p for p in CACHES.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
    for old in folders[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)
    return path


@dataclass(frozen=True)
class Settings:
    timeout: int | None
    allow_errors: bool
    run_in_temp: bool


def settings(config: Path = ROOT / "_config.yml") -> Settings:
    """The build's execution settings (_config.yml's execute section, jupyter-book's defaults)."""
    import yaml

    execute = yaml.safe_load(config.read_text()).get("execute") or {}
    return Settings(execute.get("timeout", 30), bool(execute.get("allow_errors", False)),
                    bool(execute.get("run_in_temp", False)))


@dataclass
class Run:
    notebook: object  # the executed nbformat.NotebookNode
    seconds: float
    error: str | None  # the traceback of the failing cell, None when every cell ran


def execute(path: Path) -> Run:
    """Execute a notebook as the book build does (myst_nb.core.execute.cache) and, when every
    cell ran, store it in the cache the build reads; a failure is recorded, nothing is stored."""
    import nbformat
    from jupyter_cache import get_cache
    from jupyter_cache.base import CacheBundleIn
    from jupyter_cache.cache.db import NbProjectRecord
    from jupyter_cache.executors.utils import single_nb_execution

    path = Path(path).resolve()
    s = settings()
    cache = get_cache(str(cache_path()))
    notebook = nbformat.read(path, as_version=4)
    record = cache.add_nb_to_project(str(path))
    NbProjectRecord.remove_tracebacks([record.pk], cache.db)
    folder = tempfile.TemporaryDirectory() if s.run_in_temp else nullcontext(str(path.parent))
    with folder as cwd:
        result = single_nb_execution(notebook, cwd=cwd, allow_errors=s.allow_errors,
                                     timeout=s.timeout, meta_override=True)
    if result.err is not None:
        NbProjectRecord.set_traceback(record.uri, result.exc_string, cache.db)
        return Run(notebook, result.time, result.exc_string)
    cache.cache_notebook_bundle(
        CacheBundleIn(notebook, record.uri,
                      data={"execution_seconds": result.time, "executed_by": "tests"}),
        check_validity=False, overwrite=True)
    return Run(notebook, result.time, None)


def stderr_cells(notebook) -> list[int]:
    """1-based indexes of the cells whose stderr output the build turns into an error
    (nb_output_stderr: warn, and -W), as myst-nb numbers them in its warning."""
    found = []
    for i, cell in enumerate(notebook.cells):
        tags = cell.get("metadata", {}).get("tags", [])
        if cell.cell_type != "code" or "remove-stderr" in tags:
            continue
        if any(o.get("output_type") == "stream" and o.get("name") == "stderr"
               for o in cell.get("outputs", [])):
            found.append(i + 1)
    return found


def times() -> list[str]:
    """One line per cached notebook: its stored execution time and which command executed it."""
    from jupyter_cache import get_cache

    lines = []
    folders = sorted(p for p in CACHES.iterdir() if p.is_dir()) if CACHES.exists() else []
    for folder in folders:
        cache = get_cache(str(folder))
        rows = []
        for record in cache.list_project_records():
            if not Path(record.uri).exists():
                continue
            cached = cache.get_cached_project_nb(record.uri)
            if cached is not None:
                seconds = cached.data.get("execution_seconds") or 0.0
                by = cached.data.get("executed_by", "build")
                uri = Path(record.uri)
                rows.append((seconds, uri.relative_to(ROOT) if uri.is_relative_to(ROOT) else uri,
                             by))
        if not rows:
            continue
        lines.append(f"{folder.relative_to(ROOT)}: {len(rows)} notebooks, "
                     f"{sum(r[0] for r in rows):.1f} s in all")
        lines += [f"{sec:8.1f} s  {rel}  (executed by the {by})"
                  for sec, rel, by in sorted(rows, reverse=True)]
    return lines


def _use_cache(app, config) -> None:
    if config.nb_execution_mode == "cache":
        config.nb_execution_cache_path = str(cache_path())


def setup(app):
    """Sphinx extension: myst-nb's `cache` mode reads and writes this process's cache folder."""
    app.connect("config-inited", _use_cache)
    return {"parallel_read_safe": True, "parallel_write_safe": True}


if __name__ == "__main__":
    command = sys.argv[1] if len(sys.argv) > 1 else "times"
    if command == "times":
        print("\n".join(times()) or f"no notebook cache under {CACHES.relative_to(ROOT)}")
    elif command == "where":
        print(CACHES / key())
    elif command == "clear":
        shutil.rmtree(CACHES, ignore_errors=True)
    else:
        sys.exit(f"unknown command {command!r}; use times, where or clear")
