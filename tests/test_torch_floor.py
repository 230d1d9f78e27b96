"""The torch floor in code/pyproject.toml is a tested one: tools/torch_floor.sh ran the suite on
that version and its record (data/torch-floor/torch-X.json) shows no failure. Raising the floor
needs a new record; an old torch that no longer passes shows up there before users find it."""

import json
import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def declared_floor() -> str:
    text = (ROOT / "code" / "pyproject.toml").read_text()
    m = re.search(r'"torch>=([0-9.]+)"', text)
    assert m, "code/pyproject.toml must depend on torch with a floor: \"torch>=X.Y\""
    return m.group(1)


def version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v.split("+")[0])[:3])


def test_the_declared_floor_has_a_passing_record():
    floor = declared_floor()
    records = [json.loads(p.read_text()) for p in (ROOT / "data" / "torch-floor").glob("*.json")]
    at_floor = [r for r in records
                if version_tuple(r["torch"])[:len(version_tuple(floor))] == version_tuple(floor)]
    assert at_floor, (f"no record for torch {floor}: run bash tools/torch_floor.sh {floor}.0 "
                      "and commit data/torch-floor/")
    best = max(at_floor, key=lambda r: r["date"])
    assert best["failed"] == 0 and best["errors"] == 0 and best["passed"] > 500, best["summary"]


def test_records_below_the_floor_show_why_it_is_the_floor():
    floor = version_tuple(declared_floor())
    for p in (ROOT / "data" / "torch-floor").glob("*.json"):
        r = json.loads(p.read_text())
        for key in ("torch", "date", "command", "commit", "passed", "failed", "errors"):
            assert key in r, (p.name, key)
        if version_tuple(r["torch"]) < floor:
            assert r["failed"] + r["errors"] > 0 and r["failing"], p.name


def test_the_pinned_torch_is_at_or_above_the_floor():
    assert version_tuple(torch.__version__) >= version_tuple(declared_floor())
