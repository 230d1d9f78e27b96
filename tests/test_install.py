"""The package installs anywhere: the Colab path, tested.

Builds the sdist from `code/` and the wheel from that sdist (as `python -m build` does, so a file
missing from the sdist is caught), installs the wheel with its `notebook` extra (what a chapter's
first cell installs in Colab) into a fresh virtual environment that sees nothing of this one (no
--system-site-packages, no requirements.txt pins: pip resolves the declared dependencies), then
runs the console command, `python -m trainbook`, and one chapter's code cells there.

One narrowing, for time: torch is constrained to the build this environment runs (on this kind of
machine a local CPU wheel; left to itself pip takes a several-GB CUDA build of the newest torch
the declared range admits). The constraint only picks within `torch>=floor`, which the test
checks. Building and installing takes about 2 minutes on 2 cores (printed at the end); run it
alone with `python -m pytest tests/test_install.py`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest
from terminal import say

pytestmark = pytest.mark.timeout(1500)  # pip resolves and installs torch and the rest: minutes
ROOT = Path(__file__).resolve().parents[1]
CODE = ROOT / "code"
NOTEBOOK = ROOT / "book" / "compute" / "flops.ipynb"  # one chapter, about 20 s of CPU
TIMES: dict[str, float] = {}

# Runs a notebook's code cells in order through IPython (magics such as the first cell's %pip
# parse), in the notebook's folder; stops at the first failing cell.
RUNNER = """
import json, os, sys
from IPython.core.interactiveshell import InteractiveShell
path = os.path.abspath(sys.argv[1])
os.chdir(os.path.dirname(path))
shell = InteractiveShell.instance()
cells = [c for c in json.load(open(path))["cells"] if c["cell_type"] == "code"]
for cell in cells:
    result = shell.run_cell("".join(cell["source"]))
    if not result.success:
        sys.exit(f"cell {cell['id']} failed")
print(f"ran {len(cells)} code cells")
"""


def _env() -> dict:
    """This process's environment without anything that points into the repository's venv."""
    drop = ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "PYTHONSTARTUP")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if ".venv" not in p)
    env.update(MPLBACKEND="Agg", PIP_NO_INPUT="1", TRAINBOOK_SIZE="small")
    return env


def _run(argv: list, cwd: Path, timeout: float, what: str) -> subprocess.CompletedProcess:
    t0 = time.perf_counter()
    out = subprocess.run([str(a) for a in argv], cwd=cwd, env=_env(), capture_output=True,
                         text=True, timeout=timeout)
    TIMES[what] = TIMES.get(what, 0.0) + time.perf_counter() - t0
    return out


def _ok(out: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert out.returncode == 0, f"{out.args}\nstdout:\n{out.stdout[-3000:]}\nstderr:\n" \
                                f"{out.stderr[-3000:]}"
    return out


def declared() -> dict[str, str]:
    """The dependencies pyproject.toml declares, name -> specifier."""
    import tomllib

    deps = tomllib.loads((CODE / "pyproject.toml").read_text())["project"]["dependencies"]
    return {re.split(r"[<>=!~ \[]", d, maxsplit=1)[0].lower(): d for d in deps}


def data_files(root: Path) -> set[str]:
    """The package's files that are not Python modules (corpus, datasets, ...)."""
    return {str(p.relative_to(root)) for p in (root / "trainbook").rglob("*")
            if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    """The sdist built from a clean copy of code/ and the wheel built from that sdist."""
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "src"
    shutil.copytree(CODE, src, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info",
                                                             "build", ".*"))
    from setuptools import __version__ as setuptools_version  # the build backend used here

    need = re.search(r"setuptools>=([\d.]+)", (CODE / "pyproject.toml").read_text())[1]
    assert tuple(map(int, setuptools_version.split(".")[:2])) >= \
        tuple(map(int, need.split(".")[:2]))
    hook = "from setuptools import build_meta as b; print(b.build_{}({!r}))"
    dist = tmp / "dist"
    sdist = _ok(_run([sys.executable, "-c", hook.format("sdist", str(dist))], src, 300,
                     "build")).stdout.split()[-1]
    with tarfile.open(dist / sdist) as tar:
        tar.extractall(tmp / "unpacked", filter="data")
    unpacked = next((tmp / "unpacked").iterdir())
    wheel = _ok(_run([sys.executable, "-c", hook.format("wheel", str(dist))], unpacked, 300,
                     "build")).stdout.split()[-1]
    return {"tmp": tmp, "sdist": dist / sdist, "wheel": dist / wheel, "unpacked": unpacked}


@pytest.fixture(scope="module")
def venv(built) -> Path:
    """A fresh virtual environment with the wheel and its notebook extra installed by pip."""
    import torch

    home = built["tmp"] / "venv"
    _ok(_run([sys.executable, "-m", "venv", home], built["tmp"], 300, "venv"))
    floor = re.search(r"torch>=([\d.]+)", declared()["torch"])[1]
    assert tuple(map(int, torch.__version__.split("+")[0].split(".")[:2])) >= \
        tuple(map(int, floor.split(".")[:2]))  # the constraint stays inside the declared range
    (built["tmp"] / "constraints.txt").write_text(f"torch=={torch.__version__}\n")
    _ok(_run([home / "bin" / "python", "-m", "pip", "install", "-q", "-c",
              built["tmp"] / "constraints.txt", f"{built['wheel']}[notebook]"],
             built["tmp"], 1500, "pip install"))
    return home


@pytest.fixture(scope="module", autouse=True)
def _report(request):
    yield
    if TIMES:
        say(request, "test_install: " + ", ".join(f"{k} {v:.0f} s" for k, v in TIMES.items()))


def test_sdist_and_wheel_carry_every_data_file(built):
    want = data_files(CODE)
    assert {"trainbook/corpus/tinyshakespeare.txt"} <= want
    assert data_files(built["unpacked"]) == want  # the sdist
    with zipfile.ZipFile(built["wheel"]) as whl:
        names = set(whl.namelist())
        entry = whl.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert want <= names  # the wheel
    assert re.search(r"^trainbook = trainbook.__main__:main$", entry, re.M)


def test_installed_from_the_wheel_with_declared_dependencies(venv, built):
    py = venv / "bin" / "python"
    code = ("import json, trainbook, torch; from trainbook.data import load_corpus; "
            "from importlib import resources; "
            "print(json.dumps({'file': trainbook.__file__, 'torch': torch.__version__, "
            "'corpus': len(load_corpus()), 'csv': resources.files('trainbook.datasets')"
            ".joinpath('chinchilla-fig4-points.csv').is_file()}))")
    info = json.loads(_ok(_run([py, "-c", code], built["tmp"], 300, "checks")).stdout)
    assert Path(info["file"]).is_relative_to(venv)  # the installed copy, not the repository's
    assert info["corpus"] > 1_000_000 and info["csv"]  # load_corpus checks the sha256 too
    freeze = _ok(_run([py, "-m", "pip", "list", "--format", "json"], built["tmp"], 300,
                      "checks")).stdout
    installed = {p["name"].lower().replace("_", "-") for p in json.loads(freeze)}
    assert set(declared()) <= installed
    _ok(_run([py, "-m", "pip", "check"], built["tmp"], 300, "checks"))


def test_console_command_and_python_m(venv, built):
    exe = venv / "bin" / "trainbook"
    out = _ok(_run([exe, "--help"], built["tmp"], 300, "commands"))
    assert out.stdout.startswith("usage: trainbook") and "params" in out.stdout
    out = _ok(_run([venv / "bin" / "python", "-m", "trainbook", "params", "--model",
                    "llama-3-8b"], built["tmp"], 300, "commands"))
    assert "8,030,261,248" in out.stdout
    bad = _run([exe, "params", "--model", "llama-9"], built["tmp"], 300, "commands")
    assert bad.returncode == 2 and bad.stderr.startswith("error: ")  # the shell sees the status
    assert "Traceback" not in bad.stderr


def test_a_chapter_runs_in_the_clean_environment(venv, built):
    work = built["tmp"] / "book" / NOTEBOOK.parent.name
    shutil.copytree(NOTEBOOK.parent, work)  # the chapter's folder: files it may read or write
    runner = built["tmp"] / "run_cells.py"
    runner.write_text(RUNNER)
    out = _ok(_run([venv / "bin" / "python", runner, work / NOTEBOOK.name], built["tmp"], 600,
                   "notebook"))
    assert "ran " in out.stdout.splitlines()[-1]
