"""`plan --margin`: the estimator's error as a filter on the ranked layouts, ESTIMATE_MARGIN by
default (as the parallelism chapter ranks), validated before any work."""

import json

import pytest

from trainbook.__main__ import main
from trainbook.compute.memory import ESTIMATE_MARGIN

ARGS = ["plan", "--model", "llama-3-8b", "--gpus", "16", "--global-batch-tokens", "4194304",
        "--seq-len", "8192", "--all-variants", "--top", "1000", "--json"]


def plan(capsys, *extra):
    assert main([*ARGS, *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_default_margin_is_the_estimators_error(capsys):
    out = plan(capsys)
    assert out["margin"] == ESTIMATE_MARGIN
    assert out["layouts"] and all(r["memory margin"] >= ESTIMATE_MARGIN for r in out["layouts"])


def test_margin_zero_keeps_the_close_layouts(capsys):
    bare, kept = plan(capsys, "--margin", "0"), plan(capsys, "--margin", str(ESTIMATE_MARGIN))
    close = [r for r in bare["layouts"] if r["memory margin"] < ESTIMATE_MARGIN]
    assert close, "the case must have layouts within the margin of the capacity"
    assert bare["feasible_layouts"] == kept["feasible_layouts"] + len(close)
    wide = plan(capsys, "--margin", "0.3")
    assert wide["feasible_layouts"] < kept["feasible_layouts"]
    assert all(r["memory margin"] >= 0.3 for r in wide["layouts"])


@pytest.mark.parametrize("bad", ["1", "1.5", "-0.1"])
def test_margin_out_of_range_is_a_clear_error(bad, capsys):
    assert main([*ARGS, "--margin", bad]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --margin is a fraction of the estimated peak in [0, 1)")
    assert "--margin 0 " in err  # says how to fix it


@pytest.mark.parametrize("bad", ["nan", "inf", "ten"])
def test_margin_must_be_a_number(bad, capsys):
    with pytest.raises(SystemExit) as e:  # argparse rejects it before the command runs
        main([*ARGS, "--margin", bad])
    assert e.value.code == 2 and "--margin" in capsys.readouterr().err
