"""Repository tooling for notebooks: the standard first cell, stamped from _config.yml.

    python tools/notebooks.py stamp   # rewrite every notebook's first cell from _config.yml
    python tools/notebooks.py check   # exit 1 if a notebook lacks it or carries outputs
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = "# trainbook standard first cell"


def repository(config: Path = ROOT / "_config.yml") -> tuple[str, str]:
    """(url, branch) from _config.yml's repository section (read without a YAML dependency)."""
    text = config.read_text()
    section = text.split("\nrepository:", 1)[1]
    url = re.search(r"^\s+url:\s*(\S+)", section, re.M).group(1)
    branch = re.search(r"^\s+branch:\s*(\S+)", section, re.M).group(1)
    return url, branch


# Extras a part's chapters need beyond [notebook] (pyproject's optional dependencies): Part 7
# checks its methods against transformers, peft, trl, lm-eval and bitsandbytes; Part 8 builds on it.
PART_EXTRAS = {"alignment": "notebook,align", "frontier": "notebook,align"}


def extras_for(path: Path | None) -> str:
    """The extras the first cell installs for the notebook at `path` (its part's folder)."""
    part = path.parent.name if path is not None else ""
    return PART_EXTRAS.get(part, "notebook")


def first_cell_source(path: Path | None = None) -> str:
    url, branch = repository()
    package = f"trainbook[{extras_for(path)}]"
    return (
        f"{MARKER}: in Colab, install trainbook from the repository and branch the book was\n"
        "# built from (_config.yml); elsewhere use the installed package. "
        "Then seed, pick the size.\n"
        "import sys\n"
        "if \"google.colab\" in sys.modules:\n"
        f"    %pip install -q \"{package} @ git+{url}@{branch}#subdirectory=code\"\n"
        "from trainbook import nb\n"
        "ctx = nb.setup()"
    )


def notebooks() -> list[Path]:
    return sorted(p for p in (ROOT / "book").rglob("*.ipynb")
                  if ".ipynb_checkpoints" not in p.parts and "_build" not in p.parts)


def pages_markdown(book: Path = ROOT / "book") -> dict[str, str]:
    """The Markdown of every page under book/, by path from the repository root ("book/..."):
    .md files whole, notebooks' Markdown cells joined (code cells are not prose)."""
    out = {}
    for path in sorted(book.rglob("*")):
        rel = path.relative_to(book.parent).as_posix()
        if any(part.startswith((".", "_build")) for part in path.relative_to(book).parts):
            continue
        if path.suffix == ".md":
            out[rel] = path.read_text(encoding="utf-8")
        elif path.suffix == ".ipynb":
            cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
            out[rel] = "\n\n".join("".join(c["source"]) for c in cells
                                   if c["cell_type"] == "markdown")
    return out


def problems(path: Path) -> list[str]:
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    found = []
    if not code or "".join(code[0]["source"]) != first_cell_source(path):
        found.append("the first code cell is not the standard first cell "
                     "(run: python tools/notebooks.py stamp)")
    if any(c.get("outputs") or c.get("execution_count") for c in code):
        found.append("cells carry outputs or execution counts (clear them before committing)")
    ids = [c.get("id") for c in nb["cells"]]
    if None in ids or len(set(ids)) != len(ids):
        found.append("every cell needs its own id (nbformat 4.5; a missing one is an nbformat "
                     "warning today and an error later)")
    return found


def stamp(path: Path) -> None:
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    src = first_cell_source(path).splitlines(keepends=True)
    if code and "".join(code[0]["source"]).startswith(MARKER):
        code[0]["source"] = src
    else:  # insert it before the first code cell (a title cell may stay above it)
        cell = {"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [],
                "source": src}
        at = nb["cells"].index(code[0]) if code else len(nb["cells"])
        nb["cells"].insert(at, cell)
    for c in code:
        c["outputs"], c["execution_count"] = [], None
    path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    command = sys.argv[1] if len(sys.argv) > 1 else "check"
    if command == "stamp":
        for p in notebooks():
            stamp(p)
    elif command == "check":
        bad = {p: problems(p) for p in notebooks()}
        for p, msgs in bad.items():
            for m in msgs:
                print(f"{p.relative_to(ROOT)}: {m}")
        sys.exit(1 if any(bad.values()) else 0)
    else:
        sys.exit(f"unknown command {command!r}; use stamp or check")
