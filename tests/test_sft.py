"""Part 7, supervised fine-tuning: chat templates and loss masks through transformers, packing
against trl's packer and the unpacked loss, the from-scratch loop against trl's SFTTrainer step
by step, the study's variants, the command, and the library defaults the chapter relies on."""

from __future__ import annotations

import inspect
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainbook import configs
from trainbook.align import lora_check, sft, sft_data, sft_packing, sft_study, sft_trl, task
from trainbook.model import Transformer

TOK = task.chat_tokenizer()
DATA = sft.examples(TOK, task.make_problems(24, 2, seed=3) + task.make_problems(8, 1, seed=3))


def tiny(flavour: str = "tiny-llama", seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    cfg = configs.get(flavour).with_(vocab_size=task.VOCAB_SIZE, d_model=32, n_layers=2,
                                     n_heads=2, n_kv_heads=2, d_ff=64, max_seq_len=64)
    return Transformer(cfg).eval()


# ---- library defaults ---------------------------------------------------------------------------

def test_trl_and_transformers_defaults_are_the_ones_the_chapter_states():
    import datasets
    import transformers
    import trl

    fields = trl.SFTConfig.__dataclass_fields__
    for name, value in sft_trl.TRL_SFT_DEFAULTS.items():
        assert fields[name].default == value, name
    assert fields["bf16"].default is None
    source = inspect.getsource(trl.trainer.base_config._BaseConfig.__post_init__)
    assert "self.bf16 = not (self.fp16) if self.bf16 is None" in source
    assert sft_trl.TRL_BF16_WHEN_UNSET is True
    targs = transformers.TrainingArguments.__dataclass_fields__
    for name, value in sft_trl.TRAINER_DEFAULTS.items():
        assert targs[name].default == value, name
    assert inspect.signature(datasets.Dataset.map).parameters["batch_size"].default == \
        sft_trl.DATASETS_MAP_BATCH
    # torch's AdamW defaults are transformers' adam_* defaults: the book's loop passes only lr
    adamw = inspect.signature(torch.optim.AdamW).parameters
    assert adamw["betas"].default == (targs["adam_beta1"].default, targs["adam_beta2"].default)
    assert adamw["eps"].default == targs["adam_epsilon"].default


# ---- the loop -----------------------------------------------------------------------------------

def test_draws_are_seeded_and_clipping_changes_the_run_only_when_it_bites():
    cfg = sft.SFTConfig(steps=3, batch_size=5, seed=4)
    assert sft.draws(10, cfg) == sft.draws(10, cfg) != sft.draws(10, sft.SFTConfig(seed=5))
    assert all(len(b) == 5 and max(b) < 10 for b in sft.draws(10, cfg))
    items = task.make_problems(16, 1, seed=1)
    run = lambda norm: sft.sft(tiny(), TOK, items, sft.SFTConfig(  # noqa: E731
        steps=4, batch_size=8, lr=1e-2, warmup_steps=0, max_grad_norm=norm))
    free = run(0.0)
    assert run(1e9) == free  # a bound never reached changes nothing
    assert run(1e-3)[0] == free[0] and run(1e-3)[1:] != free[1:]


# ---- templates and masks ------------------------------------------------------------------------

def test_the_books_template_renders_chat_ids_and_both_masks_agree():
    lay = sft_data.layout(TOK, "trainbook", "07+58", "65")
    ids, mask = TOK.chat_ids("07+58", "65")
    assert lay.ids == ids and lay.completion_mask == mask == lay.assistant_mask
    assert lay.generation_prompt == "<|assistant|>" and lay.completion_text == "65<|eos|>"
    assert lay.overhead == 4


def test_llama3_and_qwen25_layouts():
    llama = sft_data.layout(TOK, "llama-3", "07+58", "65")
    assert llama.text == ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n07+58"
                          "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n65<|eot_id|>")
    assert llama.completion_text == llama.assistant_text == "65<|eot_id|>"
    qwen = sft_data.layout(TOK, "qwen2.5", "07+58", "65")
    assert qwen.text.startswith("<|im_start|>system\nYou are Qwen")
    assert qwen.generation_prompt == "<|im_start|>assistant\n"
    # trl's completion mask trains the newline after <|im_end|>; its training template's
    # generation markers also take the newline after the role, which is in the prompt
    assert qwen.completion_text == "65<|im_end|>\n"
    assert qwen.assistant_text == "\n65<|im_end|>\n"
    for lay in (llama, qwen):
        assert sum(lay.completion_mask) < len(lay.ids) and lay.overhead > 20


def test_rendering_to_text_then_tokenizing_doubles_the_bos():
    for name in ("llama-3", "trainbook"):
        got = sft_data.double_bos(TOK, name)
        assert got == {"apply_chat_template": 1, "render, then tokenize": 2,
                       "render, then tokenize without special tokens": 1}


def test_loss_masks():
    all_tokens = sft_data.loss_mask(DATA[:3], "all")
    assert [m for _, m in all_tokens] == [[1] * len(ids) for ids, _ in DATA[:3]]
    assert sft_data.loss_mask(DATA[:3], "assistant") == [(list(i), list(m)) for i, m in DATA[:3]]
    assert sft_data.completion_mask([1, 2, 3], [1, 2, 3, 4, 5]) == [0, 0, 0, 1, 1]


# ---- packing ------------------------------------------------------------------------------------

@given(st.lists(st.integers(1, 30), min_size=1, max_size=60), st.integers(30, 64))
@settings(max_examples=15, deadline=None)
def test_best_fit_decreasing_is_trls_bfd(lengths, capacity):
    from datasets import Dataset
    from trl import pack_dataset

    with lora_check.quiet():
        ds = Dataset.from_dict({"input_ids": [[i] * n for i, n in enumerate(lengths)]})
        rows = pack_dataset(ds, capacity, "bfd")["input_ids"]
    theirs = [sorted(set(r), key=r.index) for r in rows]
    ours = sft_packing.best_fit_decreasing(lengths, capacity)
    assert ours == theirs
    assert sorted(i for r in ours for i in r) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in r) <= capacity for r in ours)


def test_packed_rows_restart_positions_and_never_target_an_examples_first_token():
    rows = sft_packing.pack(DATA, 40)
    assert sorted(i for r in rows.rows for i in r) == list(range(len(DATA)))
    starts = rows.positions == 0
    assert (rows.mask[starts] == 0).all()
    assert rows.fill > sft_packing.padded_fill(DATA) > 0.5
    r0 = rows.rows[0]
    n0 = len(DATA[r0[0]][0])
    assert rows.positions[0, n0].item() == 0 and rows.doc_ids[0, n0].item() == 1


@pytest.mark.parametrize("flavour", ["tiny-llama", "tiny-gpt2"])
def test_packing_with_boundaries_is_padding_and_naive_packing_is_not(flavour):
    got = sft_packing.contamination(tiny(flavour), DATA, 40)
    assert got["packed loss, boundaries"] == pytest.approx(got["padded loss"], rel=1e-6)
    assert got["max logit gap, boundaries"] < 1e-5
    assert got["max logit gap, naive"] > 1e-2
    assert abs(got["packed loss, naive"] - got["padded loss"]) > 1e-4


def test_packed_training_with_boundaries_follows_padded_training():
    items = task.make_problems(40, 2, seed=5)
    cfg = sft.SFTConfig(steps=8, batch_size=8, lr=3e-3, warmup_steps=2)
    padded = sft.sft(tiny(), TOK, items, cfg)
    packed = sft_packing.sft_packed(tiny(), TOK, items, cfg, capacity=40)
    naive = sft_packing.sft_packed(tiny(), TOK, items, cfg, capacity=40, boundaries=False)
    assert packed == pytest.approx(padded, rel=1e-4)
    assert naive != pytest.approx(padded, rel=1e-4)


# ---- trl ----------------------------------------------------------------------------------------

@pytest.mark.timeout(240)
def test_trl_prepares_the_books_tokens_and_masks_in_both_dataset_forms():
    items = task.make_problems(5, 2, seed=2) + task.make_problems(2, 3, seed=2)
    want = sft.examples(TOK, items)
    assert sft_trl.trl_examples(tiny(), TOK, items) == want
    assert sft_trl.trl_examples(tiny(), TOK, items, "messages") == want


@pytest.mark.timeout(180)
def test_the_loop_matches_trls_sft_trainer_step_by_step():
    items = task.make_problems(200, 2, seed=1)
    cfg = sft.SFTConfig(steps=12, batch_size=8, lr=3e-3, warmup_steps=0, max_grad_norm=1.0)
    curves = sft_trl.compare_trl(tiny(), TOK, items, cfg)
    assert curves.same_examples and len(curves.trl) == len(curves.ours) == 12
    assert max(curves.rel_diff()[:5]) < 1e-5 and max(curves.rel_diff()) < 1e-4
    assert curves.ours[-1] < 0.8 * curves.ours[0]


@pytest.mark.timeout(120)
def test_one_batch_of_trls_packing_is_the_books_packed_loss():
    items = task.make_problems(30, 2, seed=4) + task.make_problems(6, 1, seed=4)
    got = sft_trl.compare_packed_batch(tiny(seed=2), TOK, items, capacity=40)
    assert got.same_rows
    assert got.trl_loss == pytest.approx(got.ours_loss, rel=1e-5)
    assert got.ours_loss == pytest.approx(got.padded_loss, rel=1e-5)
    assert abs(got.naive_loss - got.padded_loss) > 1e-4


# ---- the study and the command ------------------------------------------------------------------

def test_finetune_variants_and_scores_run_on_a_tiny_model():
    items = task.make_problems(20, 2, seed=6)
    test = task.make_problems(6, 2, seed=0, split="test")
    cfg = sft.SFTConfig(steps=2, batch_size=4)
    for loss_on in sft_data.LOSS_ON:
        for packing in sft_study.PACKING:
            losses = sft_study.finetune(tiny(), TOK, items, cfg, loss_on, packing, 40)
            assert len(losses) == 2
    got = sft_study.score(tiny(), TOK, test)
    assert set(got) == {"raw accuracy", "chat accuracy", "held-out loss"}
    rows = sft_study.lr_sweep(tiny, TOK, items, test, [1e-3, 1e-2], cfg, every=1)
    assert [r["lr"] for r in rows] == [1e-3, 1e-2]
    assert [p["step"] for p in rows[0]["points"]] == [0, 1, 2] and len(rows[0]["loss"]) == 2
    parts = sft_study.loss_by_part(tiny(), TOK, test)
    assert set(parts) == {"prompt", "answer", "<|eos|>"} and all(v > 0 for v in parts.values())
    assert sft_study.epochs(sft.SFTConfig(steps=10, batch_size=20), 100) == 2.0


def test_stored_study_has_its_provenance_and_every_variant():
    from pathlib import Path

    data = Path(__file__).resolve().parents[1] / "book/alignment/data"
    paths = sorted(data.glob("sft-study-seed*.json"))
    assert len(paths) >= 2
    for path in paths:
        rec = sft_study.read_study(path)
        assert rec["command"].startswith("python -c") and rec["versions"]["torch"]
        kinds = {(r["loss_on"], r["packing"]) for r in rec["rows"]}
        assert kinds == {("assistant", "padded"), *sft_study.VARIANTS}
        assert len({r["lr"] for r in rec["rows"]}) >= 4
        assert all(r["points"][-1]["step"] == rec["config"]["steps"] for r in rec["rows"])
    with pytest.raises(ValueError, match="write one with sft_study.write_study"):
        sft_study.read_study(data / "nowhere.json")


@pytest.mark.records
@pytest.mark.timeout(120)
def test_stored_study_seeds_are_consistent_and_agree_with_the_code():
    """One file per seed 0, 1, ... with one configuration (the recommended recipe); its step-0
    score is the shipped base model's, and its first 100 steps' mean loss is a fresh run's."""
    import dataclasses
    from pathlib import Path

    from trainbook.align import base

    data = Path(__file__).resolve().parents[1] / "book/alignment/data"
    paths = sorted(data.glob("sft-study-seed*.json"))
    recs = [sft_study.read_study(p) for p in paths]
    assert [p.name for p in paths] == [f"sft-study-seed{i}.json" for i in range(len(paths))]
    assert [r["seeds"] for r in recs] == [[i] for i in range(len(recs))]
    rec = recs[0]
    for r in recs:
        assert (r["config"], r["lrs"], r["n_train"], r["n_test"], r["every"], r["recipe"]) == \
            (rec["config"], rec["lrs"], rec["n_train"], rec["n_test"], rec["every"], rec["recipe"])
        assert all(row["seed"] == r["seeds"][0] for row in r["rows"])
    cfg = sft.SFTConfig(**rec["config"])
    assert cfg == sft.RECIPE and rec["n_train"] == sft.RECIPE_ITEMS
    assert rec["epochs"] == sft_study.epochs(cfg, rec["n_train"])
    assert rec["recipe"] == dataclasses.asdict(base.BaseRecipe())
    steps, every = cfg.steps, rec["every"]
    assert all(len(row["loss"]) == steps // every and len(row["points"]) == steps // every + 1
               for r in recs for row in r["rows"])
    recipe = base.BaseRecipe()
    test = task.make_problems(rec["n_test"], recipe.digits, seed=0, split="test")
    start = rec["rows"][0]["points"][0]
    assert start["step"] == 0 and start["chat accuracy"] == 0.0
    assert sft_study.held_out_loss(base.base_model(recipe), TOK, test) == \
        pytest.approx(start["held-out loss"], rel=1e-5)
    row = next(r for r in rec["rows"] if (r["loss_on"], r["packing"], r["lr"]) ==
               ("assistant", "padded", cfg.lr))
    train = task.make_problems(rec["n_train"], recipe.digits, seed=1, split="train")
    losses = sft.sft(base.base_model(recipe), TOK, train, dataclasses.replace(cfg, steps=every))
    assert sum(losses) / every == pytest.approx(row["loss"][0], rel=1e-3)


@pytest.mark.timeout(120)
def test_the_command_fine_tunes_and_writes_a_transformers_folder(tmp_path, capsys):
    from trainbook.__main__ import main

    out = tmp_path / "sft"
    code = main(["sft", "--steps", "3", "--train-items", "20", "--test-items", "5",
                 "--out", str(out), "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["before"]["chat accuracy"] == 0.0 and len(result["files"]) >= 4
    assert (out / "model.safetensors").is_file() and (out / "tokenizer_config.json").is_file()


# ---- bad input ----------------------------------------------------------------------------------

def test_bad_input_is_rejected_with_a_clear_message(tmp_path, capsys):
    from trainbook.__main__ import main

    model = tiny()
    cases = [
        (lambda: sft_data.template("llama-2"), "unknown chat template"),
        (lambda: sft_data.hf_tokenizer(TOK, "qwen2.5", add_bos=True), "no BOS token"),
        (lambda: sft_data.conversation(""), "prompt must be"),
        (lambda: sft_data.conversation("1+2", 3), "response must be"),
        (lambda: sft_data.loss_mask(DATA, "prompt"), "on must be one of"),
        (lambda: sft_data.loss_mask([], "all"), "no examples"),
        (lambda: sft_packing.best_fit_decreasing([3, 4], 0), "capacity must be"),
        (lambda: sft_packing.best_fit_decreasing([], 8), "non-empty"),
        (lambda: sft_packing.best_fit_decreasing([9], 8), "raise the capacity"),
        (lambda: sft_packing.pack([], 8), "no examples"),
        (lambda: sft_packing.padded_fill([]), "no examples"),
        (lambda: sft_packing.sft_packed(model, TOK, task.make_problems(3), capacity=8),
         "raise it"),
        (lambda: sft.draws(0, sft.SFTConfig()), "n must be"),
        (lambda: sft.SFTConfig(max_grad_norm=-1.0), "max_grad_norm must be a non-negative"),
        (lambda: sft_trl.dataset([]), "no items"),
        (lambda: sft_trl.dataset(task.make_problems(2), "text"), "form must be"),
        (lambda: sft_trl.trl_config(sft.SFTConfig(), str(tmp_path)), "warmup_steps=0"),
        (lambda: sft_trl.trl_config(sft.SFTConfig(warmup_steps=0, weight_decay=0.1),
                                    str(tmp_path)), "weight_decay=0"),
        (lambda: sft_trl.compare_trl(model, TOK, []), "no items"),
        (lambda: sft_trl.compare_packed_batch(model, TOK, task.make_problems(1001)), "1 to 1000"),
        (lambda: sft_trl.trl_examples(model, TOK, task.make_problems(2), "chat"), "form must"),
        (lambda: sft_study.finetune(model, TOK, DATA, sft.SFTConfig(), "prompt"), "loss_on"),
        (lambda: sft_study.finetune(model, TOK, DATA, sft.SFTConfig(), "all", "tight"),
         "packing must be"),
        (lambda: sft_study.lr_sweep(tiny, TOK, [], [], [0.0], sft.SFTConfig()), "positive"),
        (lambda: sft_study.study([1e-3], [], sft.SFTConfig()), "at least one seed"),
        (lambda: sft_study.curve(model, TOK, DATA, DATA, sft.SFTConfig(), 0), "every must be"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    for argv, words in ((["--loss-on", "prompt"], "--loss-on"),
                        (["--packing", "tight"], "--packing"),
                        (["--steps", "1000000"], "at most"),
                        (["--max-grad-norm", "-1"], "--max-grad-norm"),
                        (["--packing", "naive", "--capacity", "4"], "--capacity"),
                        (["--out", str(tmp_path / "full")], "not an empty folder")):
        try:
            code = main(["sft", *argv])
        except SystemExit as e:  # argparse's own checks
            code = e.code
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith("error:")
        assert words in err[0]
