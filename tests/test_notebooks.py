"""Every notebook starts with the standard first cell, is stored without outputs, and runs.

test_notebook_runs executes each notebook as the book build does and stores it in the build's
jupyter-cache (tools/nbcache.py), so a build after the tests reuses the outputs instead of
executing the notebook again.
"""

from pathlib import Path

import nbcache  # tools/nbcache.py
import notebooks  # tools/notebooks.py
import pytest

PATHS = notebooks.notebooks()
# Notebooks that compare a fresh computation with a stored record: CI runs them a second time
# under another kernel set (-m records, ATEN_CPU_CAPABILITY), as another CPU would.
RECORD_CHECKS = {"evaluation", "reward-models", "moe", "synthetic-data", "fp8", "mixed-precision",
                 "numerics", "clipping", "loss-spikes"}
RUNS = [pytest.param(p, marks=pytest.mark.records) if p.stem in RECORD_CHECKS else p
        for p in PATHS]


def test_there_are_notebooks():
    assert len(PATHS) >= 2


def test_the_record_checking_notebooks_read_records():
    """Each notebook run again under another kernel set reads a registered record."""
    from trainbook.records import RECORDS

    chapters = {Path(r.chapter).name for r in RECORDS}
    assert RECORD_CHECKS <= {p.stem for p in PATHS} and RECORD_CHECKS <= chapters


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.name)
def test_standard_first_cell_and_no_outputs(path):
    assert notebooks.problems(path) == []


def test_first_cell_installs_from_config_repository():
    url, branch = notebooks.repository()
    src = notebooks.first_cell_source()
    assert f"git+{url}@{branch}#subdirectory=code" in src and "nb.setup()" in src


def test_every_notebook_is_in_the_toc():
    toc = (notebooks.ROOT / "_toc.yml").read_text()
    for p in PATHS:
        assert str(p.relative_to(notebooks.ROOT).with_suffix("")) in toc, p


def test_cache_key_follows_what_the_notebooks_run(tmp_path, monkeypatch):
    """The build reuses a notebook's outputs only under the same key: the package, the files beside
    the notebooks and requirements.txt are in it; notebooks and pages are not (jupyter-cache
    matches a notebook by its code cells), nor are the package's bytecode caches."""
    files = {"code/trainbook/x.py": "a = 1\n", "book/ch.ipynb": "{}", "book/ch.md": "# ch",
             "book/data/d.jsonl": "{}", "requirements.txt": "torch==2.13.0\n"}
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    before = nbcache.fingerprint(tmp_path)
    for rel in ("book/ch.ipynb", "book/ch.md", "book/references.bib",
                "code/trainbook/__pycache__/x.cpython-311.pyc",
                "code/.ruff_cache/0.17/123", "book/.ipynb_checkpoints/ch.ipynb"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("changed")
    assert nbcache.fingerprint(tmp_path) == before
    for rel in ("code/trainbook/x.py", "book/data/d.jsonl", "requirements.txt"):
        (tmp_path / rel).write_text("changed")
        assert nbcache.fingerprint(tmp_path) != before, rel
        before = nbcache.fingerprint(tmp_path)
    monkeypatch.setenv("TRAINBOOK_SLOW_LOWP", "1")
    slow = nbcache.key()
    monkeypatch.setenv("TRAINBOOK_SLOW_LOWP", "0")
    assert "-slowlowp-" in slow and "-native-" in nbcache.key()
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert "-native-avx2-" in nbcache.key()


# No pytest timeout: as in the build, nbclient stops any cell that runs past _config.yml's timeout.
@pytest.mark.timeout(0)
@pytest.mark.parametrize("path", RUNS, ids=lambda p: p.name)
def test_notebook_runs(path):
    """Every cell runs without an error and writes nothing to stderr (the build fails on both)."""
    run = nbcache.execute(path)
    name = path.relative_to(notebooks.ROOT)
    print(f"{name}: executed in {run.seconds:.1f} s")
    if run.error is not None:
        pytest.fail(f"{name}: a cell failed\n{run.error}", pytrace=False)
    cells = nbcache.stderr_cells(run.notebook)
    assert not cells, f"{name}: cells {cells} wrote to stderr (the build turns that into an error)"
