"""The MoE chapter's runs over the trainer (trainbook.frontier.moe_runs, moe_studies): the proxy's
config files, FLOPs with shared experts, what is read off a history, the studies' bad input, and
the stored studies (book/frontier/data) against fresh runs of their points: the trainer is
deterministic on a CPU, so a stored number that a fresh run does not reproduce is stale."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from trainbook import configs
from trainbook.frontier import moe_runs as M
from trainbook.frontier import moe_studies as S
from trainbook.frontier.moe_layer import MoEOptions
from trainbook.train import TrainConfig

DATA = Path(__file__).resolve().parents[1] / "book" / "frontier" / "data"
SHORT = dict(steps=6, warmup_steps=1, eval_batches=1)


def test_model_file_builds_the_proxy(tmp_path):
    moe = configs.resolve(str(M.model_file(8, 2, 64, tmp_path)))
    assert (moe.n_experts, moe.top_k, moe.d_ff, moe.d_model, moe.n_layers) == (8, 2, 64, 64, 2)
    dense = configs.resolve(str(M.model_file(1, 1, 128, tmp_path)))
    assert not dense.is_moe and dense.d_ff == 128
    assert json.loads(M.model_file(4, 1, 32, tmp_path).read_text())["model_type"] == "mixtral"


def test_flops_per_token_counts_shared_experts_as_active():
    cfg = configs.resolve(str(M.model_file(16, 3, 32)))
    four = configs.resolve(str(M.model_file(15, 4, 32)))  # 4 active of 15 routed, same FLOPs
    assert M.flops_per_token(cfg, 64, n_shared=1) == M.flops_per_token(four, 64)
    assert M.flops_per_token(cfg, 64) < M.flops_per_token(cfg, 64, n_shared=1)


def test_run_records_loads_and_a_loss_curve():
    res = M.run(M.proxy_config(4, 2, 32, **SHORT, eval_every=3), MoEOptions())
    loads = M.load_table(res.history, last=3)
    assert list(loads.layer) == [0, 1] and (loads.max_over_mean >= 1).all()
    counts = M.window_counts(res.history, last=2)
    assert counts.shape == (2, 4) and int(counts.sum()) == 2 * 2 * 8 * 64 * 2
    curve = M.loss_curve(res)
    assert curve.tokens.iloc[-1] == 6 * 8 * 64
    assert curve.flops.iloc[0] == 8 * 64 * M.flops_per_token(res.model_config, 64)
    assert curve.val_loss.notna().sum() == 2 and curve.val_loss.iloc[-1] == res.val_loss
    steps = S.step_loads(res.history)
    assert len(steps) == 6 and (steps.entropy <= 1 + 1e-9).all()


def test_upcycled_run_starts_where_the_dense_run_ended():
    dense = M.run(M.proxy_config(1, 1, 64, **SHORT))
    up = M.upcycled_run(dense, M.proxy_config(4, 2, 64, **SHORT, seed=7))
    scratch = M.run(M.proxy_config(4, 2, 64, **SHORT, seed=7))
    on = M.run(M.proxy_config(1, 1, 64, **SHORT, seed=7), hooks=[M.StartFrom(dense)])
    # the same batches, the same weights at step 1: the upcycled model is the dense one
    assert up.history[0]["loss"] == pytest.approx(on.history[0]["loss"], abs=1e-5)
    assert up.history[0]["loss"] < scratch.history[0]["loss"] - 0.5


@pytest.mark.parametrize("call, match", [
    (lambda: M.model_file(2, 3, 8), "top_k 3"),
    (lambda: M.model_file(0, 1, 8), "n_experts"),
    (lambda: M.model_file(2, 1, 8.5), "d_ff"),
    (lambda: M.proxy_config(no_such_option=1), "not trainer options"),
    (lambda: M.proxy_config(model="tiny-mixtral"), "n_experts, top_k and d_ff"),
    (lambda: M.proxy_config(dtype="fp16"), "fp32 or bf16"),
    (lambda: M.run("tiny-mixtral"), "TrainConfig"),
    (lambda: M.run(M.proxy_config(1, 1, 32, **SHORT), MoEOptions()), "dense"),
    (lambda: M.window_counts([{"step": 1, "loss": 1.0}]), "no expert_counts"),
    (lambda: M.window_counts([], last=0), "last"),
    (lambda: M.flops_per_token(configs.get("tiny-llama"), 64, n_shared=1), "n_shared"),
    (lambda: M.flops_per_token(configs.get("tiny-mixtral"), 64, n_shared=-1), "n_shared"),
    (lambda: M.StartFrom({}), "TrainResult"),
    (lambda: S.collapse_study(["no such"]), "unknown or no names"),
    (lambda: S.collapse_study(seeds=[]), "seeds"),
    (lambda: S.capacity_study(seeds=[-1]), "seeds"),
    (lambda: S.compare_study(["dense, d_ff 4096"]), "unknown or no names"),
    (lambda: S.upcycle_study(1, 10), "dense_steps"),
    (lambda: S.write_study("x.json", "everything"), "study must be one of"),
    (lambda: S.read_study("x.json", "everything"), "study must be one of"),
    (lambda: S.thin(pd.DataFrame({"step": [1]}), 0), "every"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_upcycled_run_needs_a_dense_run():
    moe = M.run(M.proxy_config(4, 2, 32, **SHORT))
    with pytest.raises(ValueError, match="dense run"):
        M.upcycled_run(moe, M.proxy_config(4, 2, 32, **SHORT))


def test_read_study_rejects_another_record(tmp_path):
    p = tmp_path / "r.json"
    p.write_text(json.dumps({"measurement": "moe-capacity"}))
    with pytest.raises(ValueError, match="write_study"):
        S.read_study(p, "collapse")
    with pytest.raises(ValueError, match="cannot read"):
        S.read_study(tmp_path / "missing.json", "collapse")


def test_write_and_read_a_study(tmp_path):
    path = S.write_study(tmp_path / "c.json", "collapse", variants=["no balancing"], seeds=[0],
                         **SHORT)
    record, table = S.read_study(path, "collapse")
    assert "write_study" in record["command"] and list(table.variant) == ["no balancing"]
    assert record["arguments"]["seeds"] == [0] and record["proxy"] == M.PROXY


# ---------------------------------------------------------------------------------------------
# The stored studies against fresh runs
# ---------------------------------------------------------------------------------------------

def _args(record: dict) -> dict:
    return dict(record["arguments"])


@pytest.mark.records
@pytest.mark.timeout(120)
def test_stored_collapse_study_reproduces():
    record, table = S.read_study(DATA / "moe-collapse.json", "collapse")
    assert record["proxy"] == M.PROXY
    args = _args(record)
    args.pop("seeds", None)
    fresh, _ = S.collapse_study(["no balancing", "Switch loss 0.01"], seeds=[0], **args)
    stored = table[(table.seed == 0)].set_index("variant")
    for _, row in fresh.iterrows():  # another CPU's kernels may round differently: loosely
        old = stored.loc[row.variant]
        assert abs(row.dead - old.dead) <= 1
        assert row.max_over_mean == pytest.approx(old.max_over_mean, rel=0.1)
        assert row.val_loss == pytest.approx(old.val_loss, abs=0.02)


@pytest.mark.records
@pytest.mark.timeout(120)
def test_stored_capacity_study_reproduces():
    record, table = S.read_study(DATA / "moe-capacity.json", "capacity")
    args = _args(record)
    args.pop("seeds", None)
    args.pop("factors", None)
    args.pop("balances", None)
    fresh = S.capacity_study([1.0], ["Switch loss 0.01"], seeds=[0], **args)
    old = table[(table.seed == 0) & (table.capacity_factor == 1.0)
                & (table.balance == "Switch loss 0.01")].iloc[0]
    assert fresh.dropped.iloc[0] == pytest.approx(old.dropped, abs=0.02)
    assert fresh.val_loss.iloc[0] == pytest.approx(old.val_loss, abs=0.02)


@pytest.mark.records
@pytest.mark.timeout(120)
@pytest.mark.parametrize("file, seed", [("moe-compare.json", 0), ("moe-compare-seeds.json", 1)])
def test_stored_comparison_reproduces_its_start(file, seed):
    record, table = S.read_study(DATA / file, "compare")
    args = _args(record)
    args.pop("seeds", None)
    args.pop("names", None)
    name = "MoE 8 x 64, top-2"
    fresh = S.thin(S.compare_study([name], seeds=[seed], stop_after=50, **args))
    old = table[(table.run == name) & (table.seed == seed) & (table.step <= 50)]
    assert fresh.step.tolist() == old.step.tolist()
    assert fresh.loss.tolist() == pytest.approx(old.loss.tolist(), rel=1e-4)


@pytest.mark.records
@pytest.mark.timeout(120)
def test_stored_upcycling_reproduces_its_dense_phase():
    record, table = S.read_study(DATA / "moe-upcycle.json", "upcycle")
    args = _args(record)
    dense_steps = args.pop("dense_steps")
    for key in ("moe_steps", "seeds", "n_experts", "top_k", "options"):
        args.pop(key, None)
    d_ff = args.pop("d_ff", 128)
    first = args["eval_every"]
    cfg = M.proxy_config(1, 1, d_ff, seed=0, steps=dense_steps, stop_after=first, **args)
    fresh = S.thin(M.loss_curve(M.run(cfg)).assign(run="dense", seed=0))
    old = table[(table.run == "dense") & (table.seed == 0) & (table.step <= first)]
    assert fresh.step.tolist() == old.step.tolist()
    assert fresh.loss.tolist() == pytest.approx(old.loss.tolist(), rel=1e-4)
    assert fresh.val_loss.iloc[-1] == pytest.approx(old.val_loss.iloc[-1], abs=0.02)


def test_stored_records_say_how_they_were_made():
    for file, name in (("collapse", "collapse"), ("capacity", "capacity"),
                       ("compare", "compare"), ("compare-seeds", "compare"),
                       ("upcycle", "upcycle")):
        record, table = S.read_study(DATA / f"moe-{file}.json", name)
        assert record["command"].startswith("python -c") and record["versions"]["torch"]
        assert isinstance(table, pd.DataFrame) and len(table)
        assert f"moe-{file}.json" in record["command"]


def test_the_seeds_record_continues_the_comparison():
    """moe-compare-seeds.json holds more seeds of runs of moe-compare.json, trained alike."""
    one, first = S.read_study(DATA / "moe-compare.json", "compare")
    more, table = S.read_study(DATA / "moe-compare-seeds.json", "compare")
    same = {k: v for k, v in more["arguments"].items() if k not in ("names", "seeds")}
    assert same == {k: v for k, v in one["arguments"].items() if k != "seeds"}
    assert not set(more["arguments"]["seeds"]) & set(one["arguments"]["seeds"])
    assert set(table.run) <= set(first.run) and set(table.run) == set(more["arguments"]["names"])
    assert sorted(table.seed.unique()) == more["arguments"]["seeds"]


def test_proxy_config_is_a_train_config():
    cfg = M.proxy_config(4, 1, 16, steps=10)
    assert isinstance(cfg, TrainConfig) and cfg.steps == 10 and cfg.tokenizer == "bytes"
