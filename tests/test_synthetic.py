"""Synthetic data loops and model collapse: the Gaussian refit's closed forms against simulation,
the filters of rejection sampling and self-instruct, distillation labels and the data-source
study, text collapse's sampling through transformers against the reference model, the stored
records, bad input."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from scipy import stats

from trainbook import configs
from trainbook.align import policy, sft, task
from trainbook.frontier import collapse as C
from trainbook.frontier import synthetic as S
from trainbook.frontier import synthetic_sources as D
from trainbook.model import Transformer
from trainbook.nb import seed_everything

TOK = task.chat_tokenizer()
DATA = __import__("pathlib").Path(__file__).resolve().parents[1] / "book/frontier/data"


def tiny_model(seed: int = 0, vocab: int = task.VOCAB_SIZE, seq: int = 32) -> Transformer:
    torch.manual_seed(seed)
    cfg = configs.get("tiny-llama").with_(vocab_size=vocab, d_model=32, n_layers=1, n_heads=2,
                                         n_kv_heads=2, d_ff=64, max_seq_len=seq)
    return Transformer(cfg).eval()


# ---- the Gaussian refit ------------------------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("estimator", C.ESTIMATORS)
def test_gaussian_refit_follows_its_closed_forms(estimator):
    """Simulated moments within 4 standard errors of the closed forms: the variance's mean while
    its spread is moderate (t <= 20), the log-variance's mean and the means' spread throughout."""
    n, G, R = 20, 60, 6000
    runs = C.gaussian_refit(n, G, R, estimator, seed=3)
    t = np.arange(G + 1)
    for g in (1, 5, 10, 20):
        v = runs.var[:, g]
        assert abs(v.mean() - C.expected_variance(g, n, estimator)) < 4 * v.std() / math.sqrt(R)
    logs = np.log(runs.var[:, 1:])
    err = np.abs(logs.mean(0) - C.expected_log_variance(t[1:], n, estimator))
    assert (err < 4 * logs.std(0) / math.sqrt(R)).all()
    mv = C.mean_variance(t, n, estimator)
    centred = runs.mu - runs.mu.mean(0)
    se = np.sqrt(((centred ** 4).mean(0) - runs.mu.var(0) ** 2) / R)  # of a sample variance
    assert (np.abs(runs.mu.var(0) - mv) < 4 * se + 1e-12).all()
    if estimator == "ml":  # the spread moves from within runs to between them
        np.testing.assert_allclose(C.expected_variance(t, n) + mv, 1.0)
    else:
        np.testing.assert_allclose(C.expected_variance(t, n, "unbiased"), 1.0)
        assert np.median(runs.var[:, G]) < 0.2  # the mean stays at 1, the typical run collapses


def test_tail_mass_is_the_normal_tail():
    assert C.tail_mass(1.0) == pytest.approx(2 * stats.norm.sf(2.0), rel=1e-12)
    assert C.tail_mass(0.25, k=1.0) == pytest.approx(2 * stats.norm.sf(2.0), rel=1e-12)
    assert C.tail_mass(0.0) == 0.0


@pytest.mark.timeout(60)
def test_real_data_mixed_in_or_accumulated_stops_the_collapse():
    kw = dict(n=20, generations=80, replicates=2000, seed=1)
    replace = np.median(C.gaussian_refit(**kw).var[:, -1])
    mix = np.median(C.gaussian_refit(**kw, mode="mix", real_fraction=0.5).var[:, -1])
    acc = np.median(C.gaussian_refit(**kw, mode="accumulate").var[:, -1])
    assert replace < 0.05 and mix > 0.6 and acc > 0.6
    # accumulate's running sums equal fitting all the data at once
    r = C.gaussian_refit(5, 1, 3, mode="accumulate", seed=2)
    real = np.random.default_rng(2).normal(0.0, 1.0, (3, 5))
    np.testing.assert_allclose(r.var[:, 1], real.var(1))


# ---- rejection sampling, dedup, self-instruct --------------------------------------------------

def test_exact_and_near_duplicates_are_removed():
    items = [task.Problem("07+58", "65"), task.Problem("07+58", "65"),
             task.Problem("58+07", "65"), task.Problem("07+59", "66"),
             task.Problem("07+58", "64")]
    assert S.deduplicate(items, "none") == items
    assert S.deduplicate(items, "exact") == [items[0], items[2], items[3], items[4]]
    assert S.deduplicate(items, "near") == [items[0], items[3], items[4]]  # b+a joins a+b


def test_keep_applies_the_verifier_then_dedup():
    p = task.Problem("01+02", "3")
    samples = S.Samples([p] * 5, ["3", "3", "4", "3", "3"], [True, True, True, True, False],
                        [1.0, 1.0, 0.0, 1.0, 0.0])
    assert samples.pass_at_1() == 0.6 and samples.pass_at_k() == 1.0
    items, counts = S.keep(samples, "verify", "exact")
    assert items == [p] and counts == {"sampled": 5, "ended": 4, "verified": 3,
                                       "exact_unique": 1, "kept": 1}
    items, counts = S.keep(samples, "none", "exact")
    assert items == [p, task.Problem("01+02", "4")] and counts["kept"] == 2


def test_rejection_sample_scores_what_policy_samples():
    model = tiny_model(1)
    items = task.make_problems(6, 1, seed=1)
    g = lambda: torch.Generator().manual_seed(5)  # noqa: E731
    s = S.rejection_sample(model, TOK, items, 3, 1.0, g())
    roll = policy.sample(model, TOK, task.encode_prompts(TOK, [p for p in items for _ in
                                                                range(3)]), 4, 1.0,
                         generator=g())
    assert s.texts == roll.texts and len(s.items) == 18
    assert s.rewards == [task.verify(p, t) if e else 0.0 for p, t, e in
                         zip(s.items, s.texts, s.ended)]


@pytest.mark.timeout(120)
def test_rejection_rounds_raise_a_weak_models_score():
    """A tiny model that half knows one-digit sums: verified rounds raise its greedy score."""
    seed_everything(0)
    model = tiny_model(2)
    train = task.make_problems(300, 1, seed=3)
    sft.sft(model, TOK, train[:40], sft.SFTConfig(steps=60, batch_size=16, lr=3e-3))
    test = task.all_problems(1, "test") + task.make_problems(40, 1, seed=4)
    rows = S.rejection_rounds(model, TOK, train[:80], test,
                              S.LoopConfig(rounds=2, k=4, steps=40, batch_size=16, lr=3e-3))
    assert [r["round"] for r in rows] == [0, 1, 2]
    assert rows[-1]["test_accuracy"] > rows[0]["test_accuracy"]
    assert all(r["kept"] <= r["exact_unique"] <= r["verified"] for r in rows[1:])


def test_self_instruct_filters_and_labels_by_the_verifier():
    test_item = next(p for p in task.all_problems(2, "test"))
    pool = [task.Problem("10+20", "30")]
    lines = ["10+20=30", "20+10=30", "11+22=34", "11+22=33", "1+2=3", "ab+cd=", "99+99=",
             test_item.prompt + "=" + test_item.answer, "33+44"]
    items, c = S.self_instruct(lines, 2, pool, "near")
    assert items == [task.Problem("11+22", "33"), task.Problem("99+99", "198")]
    assert c == {"generated": 9, "malformed": 3, "test_split": 1, "duplicate": 3, "kept": 2,
                 "model_right": 4}  # 10+20=30, 20+10=30, 11+22=33 and the test item
    exact, c2 = S.self_instruct(lines, 2, pool, "exact")
    assert task.Problem("20+10", "30") in exact and c2["duplicate"] == 2


def test_propose_continues_a_few_shot_context_of_raw_lines():
    model = tiny_model(3, seq=64)
    pool = task.make_problems(10, 2, seed=1)
    a = S.propose(model, TOK, 5, pool, 3, generator=torch.Generator().manual_seed(1))
    b = S.propose(model, TOK, 5, pool, 3, generator=torch.Generator().manual_seed(1))
    assert a == b and len(a) == 5 and all("\n" not in x for x in a)


def test_teacher_labels_are_the_teachers_greedy_answers():
    model = tiny_model(4)
    items = task.make_problems(8, 1, seed=2)
    got = S.answers(model, TOK, items)
    roll = policy.sample(model, TOK, task.encode_prompts(TOK, items), 3, greedy=True)
    assert got == [t.strip() if c[-1:] == [task.EOS] else None
                   for c, t in zip(roll.completions, roll.texts)]
    labels = S.teacher_labels(model, TOK, items)
    assert labels == [task.Problem(p.prompt, a) for p, a in zip(items, got) if a]


def test_fine_tune_on_trains_copies_with_one_recipe():
    model = tiny_model(7)
    before = [q.clone() for q in model.parameters()]
    items = task.make_problems(16, 1, seed=5)
    test = task.make_problems(6, 1, seed=6, split="test")
    cfg = sft.SFTConfig(steps=3, batch_size=4)
    out = S.fine_tune_on(model, TOK, {"a": items, "b": items[:4]}, test, cfg)
    assert all(torch.equal(q, b) for q, b in zip(model.parameters(), before))
    twin = tiny_model(7)
    sft.sft(twin, TOK, items, cfg)
    assert out["a"] == S.answers(twin, TOK, test) and len(out["b"]) == len(test)


@pytest.mark.timeout(120)
def test_write_teacher_round_trip(tmp_path):
    recipe = S.TeacherRecipe(d_model=32, n_layers=1, n_heads=2, d_ff=64, steps=4, sft_items=20,
                             sft_steps=2)
    path = S.write_teacher(tmp_path / "teacher.json", recipe, prompts=6, test=5)
    rec = S.read_teacher(path)
    assert rec["recipe"]["d_model"] == 32 and len(rec["labels"]) == 6 and len(rec["test"]) == 5
    assert "S.TeacherRecipe(d_model=32" in rec["command"]
    for prompt, _ in rec["labels"]:
        a, b = map(int, prompt.split("+"))
        assert task.split_of(a, b) == "train"


# ---- text collapse -----------------------------------------------------------------------------

def test_diversity_on_known_text():
    d = C.diversity("abababab", "abababab" * 10 + "z", n=2)
    assert d["distinct_2grams_per_1k"] == 1000 * 2 / 8
    assert d["entropy_bits"] == pytest.approx(1.0) and d["rare_share"] == 0.0
    assert C.diversity("zzzz qq", "ab" * 1000 + "zq", 1)["unknown_words"] == 1.0


@pytest.mark.timeout(60)
def test_synthesize_with_transformers_equals_the_reference_models_argmax():
    """At a tiny temperature sampling is the argmax: transformers' generate (KV cache) on the
    same weights continues each newline exactly as the reference model without a cache."""
    model = tiny_model(5, vocab=256, seq=16)
    recipe = C.TextRecipe(seq_len=16, chars=160, temperature=1e-6)
    alphabet = "\n abcdefghij"
    text = C.synthesize(model, 64, recipe, alphabet)
    assert set(text) <= set(alphabet) and len(text) == 64
    ids = torch.tensor([[10]])
    allowed = torch.tensor([ord(c) for c in alphabet])
    for _ in range(15):
        logits = model(ids)[0][0, -1]
        ids = torch.cat([ids, allowed[logits[allowed].argmax()].view(1, 1)], 1)
    assert text[:16] == bytes(ids[0].tolist()).decode()
    assert text[16:32] == text[:16]  # every document starts from a newline


def test_transformers_samples_from_the_top_50_by_default():
    """transformers' generate truncates to the 50 likeliest tokens unless told otherwise (its
    fallback when neither the model's generation_config.json nor the call sets top_k): a tail
    cut of its own. `synthesize` passes top_k=0 and top_p=1."""
    from transformers import GenerationConfig

    defaults = GenerationConfig._get_default_generation_params()
    assert {k: defaults[k] for k in C.HF_SAMPLING_DEFAULTS} == C.HF_SAMPLING_DEFAULTS


def test_stored_text_collapse_record():
    rec = C.read_text_collapse(DATA / "synthetic-collapse.json")
    recipe = C.TextRecipe(**rec["recipe"])
    rows = rec["rows"]
    assert {r["mode"] for r in rows} == set(rec["modes"])
    for mode in rec["modes"]:
        part = [r for r in rows if r["mode"] == mode]
        assert [r["generation"] for r in part] == list(range(recipe.generations + 1))
    firsts = {r["heldout_loss"] for r in rows if r["generation"] == 0}
    assert len(firsts) == 1  # generation 0 is one model, shared by the modes
    assert rec["command"].startswith("python -m trainbook collapse")


@pytest.mark.timeout(300)
def test_stored_text_collapse_reproduces_generation_zero():
    rec = C.read_text_collapse(DATA / "synthetic-collapse.json")
    recipe = C.TextRecipe(**rec["recipe"])
    real, held = C.real_text(recipe)
    model = C.train_generation(real, recipe)
    want = next(r for r in rec["rows"] if r["generation"] == 0)
    assert C.heldout_loss(model, held, recipe.seq_len) == pytest.approx(want["heldout_loss"],
                                                                        abs=0.02)


def test_stored_rounds_record():
    rec = S.read_rounds(DATA / "synthetic-rounds.json")
    cfg = S.LoopConfig(**rec["config"])
    variants = {tuple(v) for v in rec["variants"]}
    assert variants == set(S.ROUND_VARIANTS) and len(rec["seeds"]) >= 2
    for seed in rec["seeds"]:
        for f, d in variants:
            part = [r for r in rec["rows"] if (r["filter"], r["dedup"], r["seed"]) == (f, d, seed)]
            assert [r["round"] for r in part] == list(range(cfg.rounds + 1))
            assert part[0]["test_accuracy"] == rec["rows"][0]["test_accuracy"]  # one start
            for r in part[1:]:
                if f != "truth":
                    assert r["sampled"] == cfg.k * rec["pool"]
                    chosen = r["verified"] if f == "verify" else r["ended"]
                    assert r["exact_unique"] <= chosen
                    assert r["kept"] == chosen if d == "none" else r["kept"] <= r["exact_unique"]


@pytest.mark.timeout(300)
def test_stored_rounds_reproduce_their_first_round():
    """Round 1 of the main variant, seed 0, from the same start policy: the same samples and
    the same fine-tuning, so the same counts and (to rounding across CPUs) the same score."""
    from trainbook.align import start

    rec = S.read_rounds(DATA / "synthetic-rounds.json")
    cfg = dataclasses.replace(S.LoopConfig(**rec["config"]), rounds=1)
    want = next(r for r in rec["rows"] if (r["filter"], r["dedup"], r["seed"], r["round"]) ==
                (cfg.filter, cfg.dedup, 0, 1))
    model = start.load_start(DATA.parent.parent / "alignment/data")
    pool = task.make_problems(rec["pool"], 2, seed=12)
    test = task.make_problems(rec["test"], 2, seed=0, split="test")
    got = S.rejection_rounds(model, TOK, pool, test, cfg)[1]
    assert abs(got["kept"] - want["kept"]) <= 0.02 * want["kept"]
    assert got["test_accuracy"] == pytest.approx(want["test_accuracy"], abs=0.03)


def test_stored_teacher_record():
    rec = S.read_teacher(DATA / "synthetic-teacher.json")
    recipe = S.TeacherRecipe(**rec["recipe"])
    assert recipe == S.TeacherRecipe() and "S.TeacherRecipe()" in rec["command"]
    test = task.make_problems(len(rec["test"]), recipe.base_recipe().digits, 0, "test")
    assert [p for p, _ in rec["test"]] == [p.prompt for p in test]
    seen = {p.prompt for p in task.make_problems(recipe.sft_items, 2, seed=recipe.seed + 1000)}
    assert not seen & {p for p, _ in rec["labels"]}


def test_score_sources_counts_copies_of_the_teachers_mistakes():
    test = [task.Problem("1+2", "3"), task.Problem("2+2", "4"), task.Problem("3+3", "6")]
    teacher = {"1+2": "3", "2+2": "5", "3+3": None}  # right, wrong, unfinished
    got = D.score_sources({"a": ["3", "5", "6"], "b": ["4", "4", None]}, test, teacher)
    assert got["a"] == {"test_accuracy": 2 / 3, "copies_teacher": 1.0}  # only 2+2 counts
    assert got["b"] == {"test_accuracy": 1 / 3, "copies_teacher": 0.0}


def test_stored_sources_record():
    rec = D.read_sources(DATA / "synthetic-sources.json")
    cfg = D.SourcesConfig(**rec["config"])
    assert list(rec["sizes"]) == list(D.SOURCES) and len(rec["seeds"]) >= 3
    n = rec["sizes"]["seeds only"]
    assert n == cfg.n_seeds and rec["self_instruct"]["kept"] == rec["sizes"][D.SOURCES[1]] - n
    assert len({rec["sizes"][s] for s in D.SOURCES[1:]}) == 1  # equal sizes but the seeds'
    assert [(r["seed"], r["source"]) for r in rec["rows"]] == [
        (s, name) for s in rec["seeds"] for name in D.SOURCES]


@pytest.mark.records
@pytest.mark.timeout(300)
def test_stored_sources_reproduce_a_fine_tuning():
    """The seeds-only fine-tuning of seed 0 again: the same data, steps and seed, so (to
    rounding across CPUs) the same score."""
    from trainbook.align import start

    rec = D.read_sources(DATA / "synthetic-sources.json")
    cfg = D.SourcesConfig(**rec["config"])
    want = next(r for r in rec["rows"] if (r["seed"], r["source"]) == (0, "seeds only"))
    teacher = S.read_teacher(DATA / "synthetic-teacher.json")
    test = task.make_problems(cfg.test, 2, seed=0, split="test")
    seeds = task.make_problems(cfg.n_seeds, 2, seed=21)
    sc = sft.SFTConfig(steps=cfg.steps, batch_size=cfg.batch_size, lr=cfg.lr, warmup_steps=0)
    out = S.fine_tune_on(start.load_start(DATA.parent.parent / "alignment/data"), TOK,
                         {"seeds only": seeds}, test, sc)
    got = D.score_sources(out, test, dict(teacher["test"]))["seeds only"]
    assert got["test_accuracy"] == pytest.approx(want["test_accuracy"], abs=0.03)


# ---- bad input ---------------------------------------------------------------------------------

def test_bad_input_is_rejected_with_a_clear_message(tmp_path):
    model = tiny_model()
    p = [task.Problem("1+2", "3")]
    cases = [
        (lambda: C.gaussian_refit(1, 3), "n must be a whole number >= 2"),
        (lambda: C.gaussian_refit(5, 0), "generations must be"),
        (lambda: C.gaussian_refit(5, 3, estimator="mom"), "estimator must be one of"),
        (lambda: C.gaussian_refit(5, 3, mode="swap"), "mode must be one of"),
        (lambda: C.gaussian_refit(5, 3, mode="mix"), "real_fraction"),
        (lambda: C.gaussian_refit(5, 3, real_fraction=0.5), "real_fraction"),
        (lambda: C.expected_variance(3, 5, sigma0=-1.0), "sigma0 must be a positive"),
        (lambda: C.expected_log_variance(3, 1), "n must be"),
        (lambda: C.mean_variance(3, 5, "bayes"), "estimator"),
        (lambda: C.TextRecipe(chars=100), "too few for seq_len"),
        (lambda: C.TextRecipe(steps=0), "TextRecipe.steps must be a positive"),
        (lambda: C.real_text(C.TextRecipe(chars=2_000_000)), "exceeds the corpus"),
        (lambda: C.text_collapse(C.TextRecipe(), "swap"), "mode must be one of"),
        (lambda: C.text_collapse(C.TextRecipe(), "mix", 0.0), "real_fraction"),
        (lambda: C.synthesize(model, 10, C.TextRecipe(), "abc"), "includes a newline"),
        (lambda: C.synthesize(model, 0, C.TextRecipe(), "a\n"), "chars must be"),
        (lambda: C.diversity("ab", "abc", 4), "at least n=4"),
        (lambda: C.tail_mass(-1.0), "non-negative variances"),
        (lambda: C.expected_variance(-1, 5), "t must hold generations >= 0"),
        (lambda: C.mean_variance([1, float("nan")], 5), "t must hold generations"),
        (lambda: C.tail_mass(1.0, k=0), "k must be a positive"),
        (lambda: C.train_generation("abc", C.TextRecipe()), "give more than seq_len"),
        (lambda: C.train_generation("a" * 1000, {"steps": 3}), "recipe must be a TextRecipe"),
        (lambda: C.heldout_loss(model, "abc", 16), "give more than"),
        (lambda: C.write_text_collapse(tmp_path / "x.json", modes=("swap",)), "modes must be"),
        (lambda: C.write_text_collapse(tmp_path / "x.txt"), "to a .json file"),
        (lambda: S.rejection_sample(model, TOK, p, 0), "k must be"),
        (lambda: S.rejection_sample(model, TOK, [], 2), "no items"),
        (lambda: S.deduplicate(p, "fuzzy"), "dedup must be one of"),
        (lambda: S.keep(S.Samples(p, ["3"], [True], [1.0]), "judge"), "filter must be one of"),
        (lambda: S.LoopConfig(k=0), "LoopConfig.k must be a positive"),
        (lambda: S.LoopConfig(temperature=-1.0), "LoopConfig.temperature must be a positive"),
        (lambda: S.LoopConfig(filter="judge"), "LoopConfig.filter"),
        (lambda: S.LoopConfig(dedup="fuzzy"), "LoopConfig.dedup"),
        (lambda: S.rejection_rounds(model, TOK, [], p), "non-empty prompt pool"),
        (lambda: S.answers(model, TOK, []), "no items"),
        (lambda: S.propose(model, TOK, 0, p), "n must be"),
        (lambda: S.propose(model, TOK, 2, p, shots=3), "fewer than shots"),
        (lambda: S.propose(model, TOK, 2, [task.problem(10, 20, 2)] * 4, shots=4),
         "use fewer shots"),
        (lambda: S.fine_tune_on(model, TOK, {}, p, sft.SFTConfig()), "at least one data"),
        (lambda: S.fine_tune_on(model, TOK, {"a": []}, p, sft.SFTConfig()), "no empty one"),
        (lambda: S.write_rounds(tmp_path / "r.json", tmp_path, seeds=()), "seeds must be"),
        (lambda: S.write_rounds(tmp_path / "r.json", tmp_path, pool=0), "pool must be"),
        (lambda: S.write_rounds(tmp_path / "r.json", tmp_path, variants=[("judge", "exact")]),
         "LoopConfig.filter"),
        (lambda: S.self_instruct(["1+2=3"], 0), "digits must be"),
        (lambda: S.self_instruct(["1+2=3"], 1, dedup_mode="fuzzy"), "dedup must be one of"),
        (lambda: S.TeacherRecipe(sft_steps=0), "TeacherRecipe.sft_steps must be a positive"),
        (lambda: S.train_teacher({"steps": 3}), "recipe must be a TeacherRecipe"),
        (lambda: S.write_teacher(tmp_path / "t.json", prompts=0), "prompts must be"),
        (lambda: S.read_teacher(tmp_path / "none.json"), "write one with"),
        (lambda: C.read_text_collapse(tmp_path / "none.json"), "write one with"),
        (lambda: D.SourcesConfig(steps=0), "SourcesConfig.steps must be a positive"),
        (lambda: D.data_sources(model, TOK, {}, D.SourcesConfig()), "stored teacher record"),
        (lambda: D.data_sources(model, TOK, {"labels": []}, {"n_seeds": 4}),
         "cfg must be a SourcesConfig"),
        (lambda: D.score_sources({"a": ["3"]}, p + p, {}), "the same, non-empty test"),
        (lambda: D.score_sources({"a": ["3"]}, p, {}), "lack 1 test items"),
        (lambda: D.write_sources(tmp_path / "s.json", tmp_path, tmp_path, seeds=[-1]),
         "seeds must be"),
        (lambda: D.write_sources(tmp_path / "s.txt", tmp_path, tmp_path), "to a .json file"),
        (lambda: D.write_sources(tmp_path / "s.json", tmp_path, tmp_path / "t.json"),
         "write one with"),
        (lambda: D.read_sources(tmp_path / "none.json"), "write one with"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()


def test_command_writes_a_record(tmp_path, monkeypatch, capsys):
    """The command's options become the recipe and the record's command line (the training is
    replaced by a stub that returns a tiny model, so nothing trains)."""
    from trainbook.__main__ import main

    monkeypatch.setattr(C, "train_generation", lambda text, recipe: tiny_model(6, 256, 16))
    out = tmp_path / "c.json"
    argv = ["collapse", "--chars", "320", "--heldout", "320", "--seq-len", "16",
            "--generations", "1", "--modes", "replace,accumulate", "--out", str(out)]
    assert main(argv) == 0
    rec = json.loads(out.read_text())
    assert rec["recipe"]["chars"] == 320 and rec["modes"] == ["replace", "accumulate"]
    assert "--chars 320" in rec["command"] and "--modes replace,accumulate" in rec["command"]
    assert [r["train_chars"] for r in rec["rows"]] == [320, 320, 320, 640]
    assert main(["collapse", "--out", str(tmp_path / "c.txt")]) == 2
    assert "ending in .json" in capsys.readouterr().err
