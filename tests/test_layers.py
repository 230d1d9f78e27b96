"""The package's layers, read from the source: imports go downwards only, and nothing cycles.

core (the reference model, configs, data, the hardware table, the launcher) -> compute (Part 1
analytics) -> bench (measurements of this machine) -> train (the runtime) -> one package per
book part -> commands and notebook helpers. Imports inside functions count too: hiding an import
in a function does not make an upward dependency go away.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "code" / "trainbook"

LAYERS = {  # top-level name under trainbook -> layer
    "__init__": 0, "configs": 0, "model": 0, "data": 0, "hardware": 0, "datasets": 0,
    "corpus": 0, "report": 0, "launch": 0, "layout": 0, "compat": 0, "formats": 0,
    "compute": 1,
    "bench": 2,
    "train": 3,
    # one package per book part: they build on the runtime and on each other only as declared
    "parallel": 4, "pretrain": 4, "precision": 4, "stability": 4, "failures": 4, "align": 4,
    "frontier": 4,
    "records": 5, "commands": 5, "nb": 5, "__main__": 5,
}
PART_DEPS: dict[str, set[str]] = {  # part -> the other parts it may import
    "stability": {"precision", "pretrain"},
    "align": {"pretrain"},  # the evaluation chapter reuses pretraining's loss, dedup and BPE
    "frontier": {"align", "pretrain", "parallel"},  # Part 8 builds on Parts 2, 5 and 7
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, source: str | None = None) -> list[tuple[str, int]]:
    """(imported trainbook module, line) for every import in the file, nested ones included."""
    mod = module_name(path)
    package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    out = []
    tree = ast.parse(path.read_text() if source is None else source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("trainbook"):
                continue
            if node.module is None or target == "trainbook":  # from . import a, b
                out += [(f"{target}.{a.name}", node.lineno) for a in node.names]
            else:
                out.append((target, node.lineno))
        elif isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.startswith("trainbook")]
    return out


def top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def resolve(module: str, known: set[str]) -> str:
    """`trainbook.bench.matmul.Timer` -> `trainbook.bench.matmul` (the longest known prefix)."""
    while module not in known and "." in module:
        module = module.rsplit(".", 1)[0]
    return module


FILES = sorted(PACKAGE.rglob("*.py"))
MODULES = {module_name(f) for f in FILES}
GRAPH = {module_name(f): {resolve(t, MODULES) for t, _ in imports(f)} for f in FILES}


def test_every_package_has_a_layer():
    names = {top(m) for m in MODULES}
    missing = sorted(names - set(LAYERS))
    assert not missing, f"give these a layer in tests/test_layers.py LAYERS: {missing}"


def wrong_way(path: Path, source: str | None = None) -> list[str]:
    """The imports of one file that go up a layer, or across to an undeclared part."""
    me = top(module_name(path))
    bad = []
    for target, line in imports(path, source):
        other = top(target)
        if other == me or other not in LAYERS:
            continue
        up = LAYERS[other] > LAYERS[me]
        sideways_part = (LAYERS[other] == LAYERS[me] == 4 and other not in PART_DEPS.get(me, set()))
        if up or sideways_part:
            bad.append(f"line {line}: {target} (layer {LAYERS[other]}) from layer {LAYERS[me]}")
    return bad


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_go_downwards(path):
    bad = wrong_way(path)
    assert not bad, f"{path.relative_to(PACKAGE)} imports upwards or across parts: {bad}"


def test_no_import_cycles():
    """Depth-first search over modules (a package's __init__ counts as a module)."""
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(GRAPH.get(m, ())):
            if n == m or n not in GRAPH:
                continue
            if state.get(n) == "open":
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = "done"

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_checker_finds_planted_violations():
    """The tests above can fail: upward, hidden-in-a-function and cross-part imports are found."""
    compute = PACKAGE / "compute" / "probe.py"
    assert wrong_way(compute, "def f():\n    from ..train import train\n")
    assert wrong_way(compute, "import trainbook.parallel.zero\n")
    assert not wrong_way(compute, "from ..hardware import get\nfrom . import flops\n")
    part = PACKAGE / "pretrain" / "probe.py"
    assert wrong_way(part, "from ..parallel import zero\n")
    assert not wrong_way(part, "from ..train import train\n")
