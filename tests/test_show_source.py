"""Every object a chapter shows with `nb.show_source(...)` exists in the package, so a rename
in the package cannot leave a chapter pointing at nothing (the build would fail later, in the
middle of executing the notebook). Read from the notebooks' code, without running them."""

import ast
import inspect
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "book").rglob("*.ipynb"))


def cells(path: Path) -> list[str]:
    nb = json.loads(path.read_text())
    def plain(line: str) -> str:  # IPython magics and shell lines become `pass`
        stripped = line.lstrip()
        return line[:len(line) - len(stripped)] + "pass" if stripped[:1] in "%!" and stripped \
            else line
    return ["\n".join(map(plain, "".join(c["source"]).splitlines()))
            for c in nb["cells"] if c["cell_type"] == "code"]


def shown(path: Path) -> tuple[list[ast.AST], list[str], set[str]]:
    """(import statements, show_source argument expressions, names the notebook assigns)."""
    imports, targets, assigned = [], [], set()
    for src in cells(path):
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                imports.append(node)
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "show_source":
                targets.append(ast.unparse(node.args[0]))
            elif isinstance(node, (ast.Name,)) and isinstance(node.ctx, ast.Store):
                assigned.add(node.id)
    return imports, targets, assigned


CASES = [(p, t) for p in NOTEBOOKS for t in shown(p)[1]]


def test_chapters_show_package_source():
    assert len(CASES) >= 20  # the chapters do show their code


@pytest.mark.parametrize("path, target", CASES,
                         ids=[f"{p.stem}:{t}" for p, t in CASES])
def test_shown_object_exists(path, target):
    imports, _, assigned = shown(path)
    namespace: dict = {}
    for node in imports:
        exec(compile(ast.Module([node], []), str(path), "exec"), namespace)
    root = target.split(".")[0]
    if root not in namespace and root in assigned:
        pytest.skip(f"{target} is a value the notebook computes")
    obj = eval(target, namespace)
    assert inspect.getsource(obj).strip(), f"{path.name} shows {target}, which has no source"
