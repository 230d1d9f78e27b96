"""Every public function and method of the package has type hints on its parameters and a return
annotation: a public function says what it takes and what it returns, so a reader of the code (and
an editor's completion and checks) can rely on the signature instead of reading the body.

Public: module-level functions and methods of classes whose names do not start with "_";
`__init__` needs parameter hints only, other dunders are exempt, and so are self, cls and the
ctx of torch.autograd.Function's static methods.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "code" / "trainbook"


def unannotated(path: Path) -> list[str]:
    """'file:line name [parameters without hints]' for each public function missing a hint."""
    out = []
    for node in ast.parse(path.read_text()).body:
        public_class = isinstance(node, ast.ClassDef) and not node.name.startswith("_")
        members = node.body if public_class else [node]
        for fn in (m for m in members if isinstance(m, ast.FunctionDef)):
            if fn.name.startswith("_") and fn.name != "__init__":
                continue
            a = fn.args
            params = [p for p in a.args + a.kwonlyargs if p.arg not in ("self", "cls", "ctx")]
            params += [p for p in (a.vararg, a.kwarg) if p is not None]
            bare = [p.arg for p in params if p.annotation is None]
            if bare or (fn.returns is None and fn.name != "__init__"):
                out.append(f"{path.relative_to(PACKAGE.parent)}:{fn.lineno} {fn.name} {bare}")
    return out


def test_public_functions_are_annotated():
    missing = [m for f in sorted(PACKAGE.rglob("*.py")) for m in unannotated(f)]
    assert not missing, f"{len(missing)} public functions lack type hints:\n" + "\n".join(missing)
