"""Every notebook starts with the standard first cell and is stored without outputs.

nbval executes the notebooks themselves (pytest collects book/**/*.ipynb with --nbval-lax).
"""

import notebooks  # tools/notebooks.py
import pytest

PATHS = notebooks.notebooks()


def test_there_are_notebooks():
    assert len(PATHS) >= 2


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
