"""The `dpo` and `grpo` commands (book/alignment/dpo, book/alignment/grpo): from the stored start
policy, a tiny budget runs and reports pass@1 before and after (the before is the stored
policy's), --out writes a transformers folder, the defaults are the chapters' main runs, and
bad input is one clear error line before any work."""

from __future__ import annotations

import json

import pytest

from trainbook.__main__ import main
from trainbook.align import dpo, dpo_study, grpo, grpo_study, policy, start, task
from trainbook.commands import dpo as dpo_cmd
from trainbook.commands import grpo as grpo_cmd


def parse(command: str, argv: list[str]):
    import argparse

    p = argparse.ArgumentParser()
    (dpo_cmd if command == "dpo" else grpo_cmd).add_arguments(p)
    return p.parse_args(argv)


def test_defaults_are_the_chapters_main_runs():
    assert dpo_cmd.check(parse("dpo", [])) == dpo_study.config("dpo")
    args = parse("dpo", [])
    assert (args.prompts, args.samples, args.eval_items, args.pair_seed) == (
        dpo_study.STUDY["prompts"], dpo_study.STUDY["samples"], dpo_study.STUDY["eval_items"],
        dpo_study.STUDY["pair_seed"])
    args = parse("grpo", [])
    assert (args.train_items, args.eval_items) == (grpo_study.STUDY["train_items"],
                                                   grpo_study.STUDY["eval_items"])
    assert grpo_cmd.check(parse("grpo", [])) == grpo.GRPOConfig(**grpo_study.BASE)
    assert (dpo_cmd.DATA / "dpo-start.json").is_file()
    assert set(dpo_cmd.NAMES) == set(dpo.LOSSES)


@pytest.mark.timeout(120)
def test_dpo_command_trains_from_the_start_policy(tmp_path, capsys):
    out = tmp_path / "dpo"
    code = main(["dpo", "--steps", "2", "--prompts", "24", "--eval-items", "20",
                 "--out", str(out), "--json"])
    assert code == 0
    r = json.loads(capsys.readouterr().out)
    tok = task.chat_tokenizer()
    assert r["pass1_before"] == policy.accuracy(start.load_start(dpo_cmd.DATA), tok,
                                                start.eval_items(20))
    assert r["pairs"] > 0 and r["generated"] == 24 * 4 and r["config"]["steps"] == 2
    assert r["first_loss"] == pytest.approx(0.6931, abs=1e-3)  # the policy is its reference
    assert 0 <= r["pass1_after"] <= 1 and (out / "model.safetensors").is_file()
    code = main(["dpo", "--loss", "simpo", "--beta", "2", "--steps", "1", "--prompts", "16",
                 "--eval-items", "5"])
    assert code == 0 and "SimPO:" in capsys.readouterr().out


@pytest.mark.timeout(120)
def test_grpo_command_trains_from_the_start_policy(capsys):
    code = main(["grpo", "--steps", "2", "--prompts", "4", "--group", "4", "--eval-items", "20",
                 "--beta", "0.04", "--json"])
    assert code == 0
    r = json.loads(capsys.readouterr().out)
    tok = task.chat_tokenizer()
    assert r["pass1_before"] == policy.accuracy(start.load_start(dpo_cmd.DATA), tok,
                                                start.eval_items(20), max_new_tokens=6)
    assert r["generated"] == 2 * 4 * 4 and r["config"]["beta"] == 0.04 and "kl_last" in r
    assert 0 <= r["reward_first"] <= 1 and 0 <= r["pass1_after"] <= 1
    code = main(["grpo", "--steps", "1", "--prompts", "2", "--group", "2", "--eval-items", "5",
                 "--loss", "dr_grpo", "--scale", "none"])
    assert code == 0 and "GRPO (dr_grpo)" in capsys.readouterr().out


@pytest.mark.parametrize("argv, words", [
    (["dpo", "--loss", "kto"], "--loss"),
    (["dpo", "--samples", "1"], "--samples"),
    (["dpo", "--steps", "1000000"], "at most"),
    (["dpo", "--lr", "5"], "--lr"),
    (["dpo", "--gamma", "-1"], "--gamma"),
    (["dpo", "--beta", "0"], "--beta"),
    (["dpo", "--start", "nowhere"], "--start"),
    (["grpo", "--loss", "ppo"], "--loss"),
    (["grpo", "--scale", "batch"], "--scale"),
    (["grpo", "--group", "1"], "--group"),
    (["grpo", "--eps-low", "1"], "--eps-low"),
    (["grpo", "--beta", "-0.1"], "--beta"),
    (["grpo", "--max-new-tokens", "1000"], "at most"),
    (["grpo", "--temperature", "1000"], "--temperature"),
    (["grpo", "--start", "nowhere"], "--start"),
])
def test_bad_input_is_one_clear_error_line(argv, words, capsys):
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own checks
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error:"), err
    assert words in err[0]


def test_out_must_be_a_new_folder(tmp_path, capsys):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    (tmp_path / "afile").write_text("x")
    for command in ("dpo", "grpo"):
        for out, words in ((tmp_path / "full", "not an empty folder"),
                           (tmp_path / "afile", "is a file")):
            assert main([command, "--out", str(out)]) == 2
            assert words in capsys.readouterr().err
