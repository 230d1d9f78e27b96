"""The lifecycle chapter's tools: the stage map, compute per stage, success criteria and the
data stage of the tiny run (calibrated filters, planted junk and copies, deduplication)."""

import math
from pathlib import Path

import pytest

from trainbook import configs, data
from trainbook.compute import cost, flops
from trainbook.pretrain import lifecycle, quality

ROOT = Path(__file__).resolve().parents[1]


def test_every_stage_links_a_chapter_that_exists_or_names_its_part():
    table = lifecycle.stage_table()
    assert list(table.index) == [s.name for s in lifecycle.STAGES] and len(table) == 7
    for stage in lifecycle.STAGES:
        if stage.chapter is None:
            assert stage.part.startswith("Part")
        else:
            assert any((ROOT / "book" / f"{stage.chapter}{ext}").exists()
                       for ext in (".ipynb", ".md")), stage.chapter


def test_plan_compute_prices_each_stage_by_its_kind():
    plan = {"pre": lifecycle.StageWork(1e12), "dpo": lifecycle.StageWork(1e9, "preference"),
            "eval": lifecycle.StageWork(1e9, "forward")}
    table = lifecycle.plan_compute("llama-3-8b", plan, seq_len=4096, gpus=64, mfu=0.4)
    per = flops.training_flops_per_token(configs.resolve("llama-3-8b"), 4096)
    assert table.loc["pre", "FLOPs"] == pytest.approx(1e12 * per)
    assert table.loc["dpo", "FLOPs"] == pytest.approx(1e9 * per * 4 / 3)
    assert table.loc["eval", "FLOPs"] == pytest.approx(1e9 * per / 3)
    assert table["share of FLOPs"].sum() == pytest.approx(1.0)
    ref = cost.estimate("llama-3-8b", 1e12, gpus=64, mfu=0.4, seq_len=4096)
    assert table.loc["pre", "GPU-hours"] == pytest.approx(ref.gpu_hours)
    assert table.loc["pre", "days"] == pytest.approx(ref.days)


def test_plan_compute_bad_input():
    with pytest.raises(ValueError, match="at least one stage"):
        lifecycle.plan_compute("llama-3-8b", {}, seq_len=4096)
    with pytest.raises(ValueError, match="kind must be train, preference or forward"):
        lifecycle.StageWork(1e9, "rl")
    with pytest.raises(ValueError, match="tokens must be a finite number"):
        lifecycle.StageWork(-1.0)
    with pytest.raises(ValueError, match="tokens must be a finite number"):
        lifecycle.StageWork(math.nan)


def test_criteria_are_checked_both_ways_and_missing_measurements_fail():
    c = lifecycle.Criteria(max_bits_per_byte=2.0, min_anneal_gain=0.01, min_mfu=0.3,
                           gates={"leak": 0.0})
    good = {"bits_per_byte": 1.9, "anneal_gain": 0.02, "epochs": 1.0, "mfu": 0.4,
            "tokens_per_s": 10.0, "wall_s": 5.0, "leak": 0.0}
    assert lifecycle.check_criteria(c, good).met.all()
    bad = lifecycle.check_criteria(c, {**good, "bits_per_byte": 2.1, "mfu": 0.2})
    assert set(bad.index[~bad.met]) == {"held-out bits per byte", "MFU"}
    assert bad.loc["MFU", "target"] == ">= 0.3"
    with pytest.raises(ValueError, match="no measurement 'leak'"):
        lifecycle.check_criteria(c, {k: v for k, v in good.items() if k != "leak"})
    with pytest.raises(ValueError, match="max_bits_per_byte must be > 0"):
        lifecycle.Criteria(max_bits_per_byte=0)
    with pytest.raises(ValueError, match="min_mfu is a fraction"):
        lifecycle.Criteria(max_bits_per_byte=1, min_mfu=40)


def test_calibration_drops_the_rules_a_source_fails():
    speeches = quality.speeches(data.load_corpus()[:200_000])
    rules = lifecycle.calibrate_rules(speeches, 0.01)
    fp = lifecycle.rule_false_positives(speeches)
    assert set(rules) == set(fp.index[fp <= 0.01])
    assert "gopher: word count" not in rules and "c4: lorem ipsum" in rules
    assert set(lifecycle.calibrate_rules(speeches, 0.999)) <= set(fp.index)
    with pytest.raises(ValueError, match="need trusted documents"):
        lifecycle.calibrate_rules([])
    with pytest.raises(ValueError, match="max_false_positive must be in"):
        lifecycle.calibrate_rules(speeches, 1.0)


def test_clean_corpus_filters_junk_removes_copies_and_writes_the_trainers_input(tmp_path):
    text = data.load_corpus()[:150_000]
    out = tmp_path / "clean.txt"
    fate, rules = lifecycle.clean_corpus(text, out, junk_per_kind=3, copies=8, seed=1)
    assert list(fate.columns) == ["kept", "filtered", "deduplicated"]
    assert fate.loc["exact copy", "deduplicated"] == 8 and fate.loc["near copy", "kept"] <= 1
    for kind in ("hashtags", "code", "lorem ipsum", "boilerplate"):
        assert fate.loc[kind, "filtered"] == 3, kind
    kept = out.read_text(encoding="utf-8")
    assert data.load_corpus(str(out)) == kept  # readable as --corpus
    assert kept.count("\n\n") + 1 == fate["kept"].sum()
    assert "lorem ipsum" not in kept.lower()
    again, _ = lifecycle.clean_corpus(text, tmp_path / "again.txt", junk_per_kind=3, copies=8,
                                      seed=1)
    assert again.equals(fate) and (tmp_path / "again.txt").read_text() == kept  # deterministic
    with pytest.raises(ValueError, match="0 < replace < 1"):
        lifecycle.clean_corpus(text, out, replace=0.0)
