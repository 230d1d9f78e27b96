"""Every module of the package names the chapter that teaches it (d2l's "Defined in", per module),
and the chapter exists: the reader of the code can find the prose, and a moved chapter is caught."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted((ROOT / "code" / "trainbook").rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT / "code")))
def test_module_names_an_existing_chapter(path):
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    line = next((ln[ln.index("Chapter:"):] for ln in doc.splitlines() if "Chapter:" in ln), None)
    assert line, f"{path.name}: add a 'Chapter: book/<part>/<chapter>' line to the docstring"
    chapters = re.findall(r"book/[\w/-]+", line)
    assert chapters, f"{path.name}: the Chapter line names no book/ path: {line!r}"
    for ch in chapters:
        assert any((ROOT / f"{ch.rstrip('/')}{ext}").exists() for ext in (".ipynb", ".md", "")), \
            f"{path.name} names {ch}, which does not exist"
