"""Exact resume (book/failures/exact-resume): real SIGKILLs of the trainer, in the middle of
gradient accumulation and during a checkpoint write, in one process and on 2 ranks under
torchrun, and the stitched run equals the uninterrupted one bit for bit (loss, gradient norm
and a fingerprint of the weights, every step); the fingerprint and first_divergence find a
difference; what breaks exactness is refused or named on resume; the stored campaign holds
what the chapter says and its run agrees with a fresh one."""

import dataclasses
from pathlib import Path

import pytest
import torch

from trainbook import launch
from trainbook.failures import checkpointing as C
from trainbook.failures import resume as R
from trainbook.train import TrainConfig, train
from trainbook.train.monitor import Fingerprint

DATA = Path(__file__).resolve().parents[1] / "book" / "failures" / "data"
TIMEOUT_S = 240


def fingerprinted(cfg: TrainConfig) -> list[dict]:
    """The uninterrupted run in this process (one thread, as the subprocesses run)."""
    with launch.threads(1):
        return train(dataclasses.replace(cfg, monitor="fingerprint", ckpt_dir=None,
                                         ckpt_every=0)).history


def test_sigkill_mid_accumulation_and_mid_write_resumes_bit_for_bit(tmp_path):
    cfg = C.tiny_config(steps=8, grad_accum=2, ckpt_every=2, ckpt_dir=str(tmp_path / "ckpt"))
    kills = [R.Kill("accum", 4, micro=1), R.Kill("write"), R.Kill("write")]
    run = R.run_with_kills(cfg, kills, workdir=tmp_path, timeout_s=TIMEOUT_S)
    a = run.attempts
    assert [x.fired for x in a] == [True, True, True, False] and a[-1].returncode == 0
    assert a[0].returncode == -9 and a[0].last_logged == 3  # died inside step 4
    assert a[1].resumed_from == 2 and a[1].left_tmp == ["step-000004.pt.tmp"]  # mid-write
    # the half-written step 4 was not taken for a checkpoint, and the file it left behind did
    # not fire the next 'write' kill at launch: that one waited for this attempt's own write
    assert a[2].resumed_from == 2 and a[2].last_logged == a[1].last_logged > 2
    assert a[3].resumed_from == 2
    assert R.first_divergence(run.history, fingerprinted(cfg)) is None
    assert {"fp_sum", "fp_sumsq", "fp_hash"} <= set(run.history[-1])


def test_sigkill_of_one_rank_under_torchrun_resumes_bit_for_bit(tmp_path):
    cfg = C.tiny_config(steps=6, grad_accum=2, ckpt_every=2, ckpt_dir=str(tmp_path / "whole"))
    whole = R.reference(cfg, nprocs=2, workdir=tmp_path, timeout_s=TIMEOUT_S)
    run = R.run_with_kills(dataclasses.replace(cfg, ckpt_dir=str(tmp_path / "killed")),
                           [R.Kill("accum", 4, micro=1, rank=1)], nprocs=2, workdir=tmp_path,
                           timeout_s=TIMEOUT_S)
    assert [x.fired for x in run.attempts] == [True, False]
    assert run.attempts[0].returncode != 0 and run.attempts[1].resumed_from == 2
    assert R.first_divergence(run.history, whole) is None
    # the same global batch in one process sums in another order: not the same bits
    assert R.first_divergence(whole, fingerprinted(dataclasses.replace(
        cfg, batch_size=2 * cfg.batch_size))) is not None


def test_fingerprint_sees_one_bit_and_first_divergence_names_the_step():
    model = torch.nn.Linear(64, 64)
    fp = Fingerprint()
    before = fp.digest(model)
    assert fp.digest(model) == before
    with torch.no_grad():
        w = model.weight.view(-1)
        w[0] = torch.nextafter(w[0], torch.tensor(1.0))  # one ulp of one element
    after = fp.digest(model)
    assert after["fp_hash"] != before["fp_hash"] and after["fp_sum"] != before["fp_sum"]
    a = [{"step": 1, "loss": 1.0, "fp_hash": "x"}, {"step": 2, "loss": 0.5, "fp_hash": "y"}]
    b = [{"step": 1, "loss": 1.0, "fp_hash": "x"}, {"step": 2, "loss": 0.5, "fp_hash": "z"}]
    assert R.first_divergence(a, b) == {"step": 2, "key": "fp_hash", "a": "y", "b": "z"}
    assert R.first_divergence(a, a[:1])["key"] == "length"
    assert R.first_divergence(a, a) is None
    with pytest.raises(ValueError, match="sample must be >= 1"):
        Fingerprint(0)


def test_what_breaks_exactness_is_refused_or_named_on_resume(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("To be, or not to be, that is the question. " * 400)
    cfg = C.tiny_config(steps=6, ckpt_dir=str(tmp_path / "ckpt"), corpus=str(corpus),
                        stop_after=3)
    with launch.threads(1):
        train(cfg)
        go = dataclasses.replace(cfg, resume=True, stop_after=4)
        with pytest.raises(ValueError, match="loader state was saved with batch_size=4"):
            train(dataclasses.replace(go, batch_size=2))
        with pytest.raises(ValueError, match="trained with seed=0, this run has seed=1"):
            train(dataclasses.replace(go, seed=1))
        res = train(dataclasses.replace(go, grad_accum=2, log_every=1))
        assert res.history[-1]["step"] == 4
        corpus.write_text("To be, or not to be, that is the question! " * 400)  # same size
        with pytest.raises(ValueError, match="the training data differs"):
            train(dataclasses.replace(go, stop_after=5))


def test_changed_settings_are_logged_on_resume(tmp_path, capsys):
    cfg = C.tiny_config(steps=6, ckpt_dir=str(tmp_path), stop_after=2, log_every=1)
    with launch.threads(1):
        train(cfg)
        capsys.readouterr()
        train(dataclasses.replace(cfg, resume=True, stop_after=3, grad_accum=2, lr=1e-3))
    out = capsys.readouterr().out
    assert "resumed with changed settings (grad_accum 1 -> 2; lr 0.003 -> 0.001)" in out


def test_kills_are_checked_before_any_work(tmp_path):
    with pytest.raises(ValueError, match="kill kind must be one of"):
        R.Kill("power-cut")
    cfg = C.tiny_config(ckpt_dir=str(tmp_path), ckpt_every=2)
    with pytest.raises(ValueError, match="needs grad_accum > micro"):
        R.run_with_kills(cfg, [R.Kill("accum", 2, micro=1)])
    with pytest.raises(ValueError, match="kill rank 2 does not exist in 2 ranks"):
        R.run_with_kills(dataclasses.replace(cfg, grad_accum=2), [R.Kill("accum", 2, 1, 2)], 2)
    with pytest.raises(ValueError, match="needs a config with ckpt_dir and ckpt_every"):
        R.run_with_kills(C.tiny_config(), [])
    kills = R.random_kills(6, 30, grad_accum=4, nprocs=2, seed=3)
    steps = [k.at - (k.kind == "accum") for k in kills if k.kind in ("step", "accum")]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)
    assert all(k.rank < 2 and 1 <= k.micro < 4 for k in kills)


@pytest.mark.records
def test_the_stored_campaign_is_bit_exact_and_its_run_is_this_trainers():
    record = R.read_campaign(DATA / "exact-resume-campaign.json")
    assert [r["nprocs"] for r in record["runs"]] == [1, 2]
    for run in record["runs"]:
        assert run["divergence"] is None and len(run["history"]) == record["config"]["steps"]
        assert [a["fired"] for a in run["attempts"]] == [True] * len(record["runs"][0]["kills"]) \
            + [False] and run["attempts"][-1]["returncode"] == 0
        kinds = {a["kill"]["kind"] for a in run["attempts"] if a["fired"]}
        assert kinds == set(R.KINDS)
        for a in run["attempts"]:  # a 'write' kill hit this attempt's own write, after a step
            if a["fired"] and a["kill"]["kind"] == "write":
                assert a["last_logged"] > a["resumed_from"] and a["left_tmp"], a
    fresh = fingerprinted(TrainConfig(**{**record["config"], "ckpt_every": 0, "keep_last": 0,
                                         "stop_after": 5, "progress": False, "log_every": 0}))
    stored = record["runs"][0]["reference"][:5]
    for a, b in zip(fresh, stored, strict=True):  # another CPU may round differently
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
