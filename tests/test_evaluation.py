"""The evaluation chapter's scores (trainbook.align.evaluation, eval_noise, contamination,
chat_pitfalls, lm_eval_check; the eval command) against the libraries that define them:
lm-evaluation-harness run on the exported model with a local task (acc, acc_norm, acc_bytes,
their stderr, bits per byte), lm-eval's own scoring rule and stderr on planted inputs, pass@k
against enumeration and lm-eval's implementation, Wilson against scipy, the sample size against
simulation, and the n-gram check against planted contamination and lm-eval's decontamination
n-grams."""

from __future__ import annotations

import itertools
import json
import math
import os
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainbook.__main__ import main
from trainbook.align import base, chat_pitfalls, contamination, hf_io, policy, task
from trainbook.align import eval_noise as N
from trainbook.align import evaluation as E
from trainbook.align import lm_eval_check as C
from trainbook.pretrain.loss import bits_per_byte

TOK = task.chat_tokenizer()
TEST = task.make_problems(60, 2, seed=1, split="test")


@pytest.fixture(scope="module")
def model():
    return base.base_model()


# ---------------------------------------------------------------------------------------------
# lm-evaluation-harness itself
# ---------------------------------------------------------------------------------------------

@pytest.mark.timeout(300)
def test_scores_equal_lm_eval_run_on_the_exported_model():
    """lm_eval.simple_evaluate (hf model, local tasks, CPU, fp32, offline) on the exported base
    model and our scorer on the reference model: every accuracy equal, every log-likelihood and
    held-out metric within the tolerance `compare` derives (two implementations of the same
    fp32 forward)."""
    result = C.check(C.CheckItems(n=40))
    rows = C.compare(result["ours"], result["lm_eval"])
    assert C.disagreements(rows) == []
    assert all(r["tolerance"] == 0 for r in rows if r["metric"] in C.MC_METRICS)
    names = {(r["task"], r["metric"]) for r in rows}
    for t in (C.MC_TASK, C.EOL_TASK):
        assert {(t, m) for m in C.MC_METRICS} | {(t, m + "_stderr") for m in C.MC_METRICS} <= names
    assert {(C.TEXT_TASK, m) for m in C.TEXT_METRICS} <= names


@pytest.mark.records
def test_the_stored_lm_eval_run_matches_the_scorer_now(model):
    """book/alignment/data/lm-eval-check.json (what the chapter shows) was run on the shipped
    weights and still equals our scores on them."""
    from pathlib import Path

    rec = C.read_check(Path(__file__).parents[1] / "book" / "alignment" / "data")
    assert rec["base_sha256"] == base.shipped_record()["sha256"]
    mc, texts = C.CheckItems(**rec["items"]).tasks()
    assert C.disagreements(C.compare(C.ours(model, TOK, mc, texts), rec["lm_eval"])) == []


def _rows(ours_ll, theirs_ll, metrics=None):
    mine = {C.TEXT_TASK: {"metrics": dict(metrics or {}), "lls": [[x] for x in ours_ll]}}
    theirs = {C.TEXT_TASK: {"metrics": dict(metrics or {}), "lls": [[x] for x in theirs_ll]}}
    return mine, theirs


def test_the_likelihood_tolerance_follows_the_measured_differences_and_still_fails():
    """Held-out metrics may differ by what the per-document log-likelihood differences imply,
    and no more: a perplexity off by 10x that would fail; an accuracy off by one item fails."""
    import math

    theirs_ll = [-10.0, -20.0, -30.0]
    ours_ll = [-10.0 + 1e-5, -20.0, -30.0 - 2e-5]
    words = 6
    ppl = lambda ll: math.exp(-sum(ll) / words)  # noqa: E731
    mine, theirs = _rows(ours_ll, theirs_ll)
    mine[C.TEXT_TASK]["metrics"]["word_perplexity"] = ppl(ours_ll)
    theirs[C.TEXT_TASK]["metrics"]["word_perplexity"] = ppl(theirs_ll)
    assert C.disagreements(C.compare(mine, theirs)) == []
    mine[C.TEXT_TASK]["metrics"]["word_perplexity"] = ppl(theirs_ll) * (1 + 1e-4)
    assert [r["metric"] for r in C.disagreements(C.compare(mine, theirs))] == ["word_perplexity"]
    mc_mine = {C.MC_TASK: {"metrics": {"acc": 0.51}, "lls": [[-1.0, -2.0]]}}
    mc_theirs = {C.MC_TASK: {"metrics": {"acc": 0.50}, "lls": [[-1.0, -2.0]]}}
    assert [r["metric"] for r in C.disagreements(C.compare(mc_mine, mc_theirs))] == ["acc"]
    far = _rows([-10.0 + 1e-2], [-10.0])
    assert len(C.disagreements(C.compare(*far))) == 1  # one log-likelihood off by 1e-3 of itself


def lm_eval_task(tmp_path):
    os.environ.update(C.OFFLINE)
    from lm_eval.tasks import TaskManager

    C.write_tasks(tmp_path, {C.MC_TASK: [E.MCItem("\n1+1=", ("2", "3"), 0)]}, ["1+1=2\n"])
    manager = TaskManager(include_path=str(tmp_path), include_defaults=False)
    return manager.load([C.MC_TASK])["tasks"][C.MC_TASK]


CHOICE = st.text(st.sampled_from("ab é€"), min_size=1, max_size=4)


def test_the_choice_rule_is_lm_evals_on_any_log_likelihoods(tmp_path):
    """lm-eval's ConfigurableTask.process_results on planted log-likelihoods, choices with
    multi-byte characters (so per character and per byte differ): the same acc, acc_norm,
    acc_bytes as `evaluation.predictions`."""
    t = lm_eval_task(tmp_path)

    @given(st.lists(st.tuples(CHOICE, st.floats(-20, 0)), min_size=2, max_size=5),
           st.data())
    @settings(max_examples=60, deadline=None)
    def check(pairs, data):
        choices, lls = [c for c, _ in pairs], [ll for _, ll in pairs]
        gold = data.draw(st.integers(0, len(choices) - 1))
        if len(set(choices)) < len(choices):  # lm-eval finds a string gold by index
            return
        theirs = t.process_results({"context": "x", "choices": choices, "gold": gold},
                                   [(ll, False) for ll in lls])
        ours = {m: float(p == gold) for m, p in E.predictions(lls, choices).items()}
        assert ours == theirs

    check()
    lls, choices = [-2.0, -1.5, -2.9], ["ab", "é", "abc"]  # per char and per byte disagree
    assert E.predictions(lls, choices) == {"acc": 1, "acc_norm": 2, "acc_bytes": 1}


def test_lm_eval_conventions_the_module_mirrors():
    """The defaults and formulas the chapter's scores depend on, from the installed lm-eval."""
    from lm_eval.api import metrics
    from lm_eval.config.task import TaskConfig

    assert TaskConfig(task="t").target_delimiter == E.LM_EVAL_TARGET_DELIMITER
    rng = random.Random(0)
    for _ in range(20):
        xs = [float(rng.random() < 0.3) for _ in range(rng.randrange(2, 50))]
        assert N.mean_stderr(xs) == pytest.approx(metrics.mean_stderr(xs), rel=1e-12)
    assert metrics.stderr_for_metric(metrics.mean, 1) is metrics.mean_stderr
    pairs = [(-3.0, 4), (-5.5, 7)]
    assert metrics.bits_per_byte(pairs) == pytest.approx(8.5 / 11 / math.log(2))
    assert bits_per_byte(8.5 / 3, 3 / 11) == pytest.approx(metrics.bits_per_byte(pairs))


# ---------------------------------------------------------------------------------------------
# Log-likelihood scoring
# ---------------------------------------------------------------------------------------------

def test_continuation_logprobs_agree_with_the_policy(model):
    ctx = [TOK.encode(E.raw_context(p)) for p in TEST[:8]]
    cont = [TOK.encode(p.answer + "\n") for p in TEST[:8]]
    lls, greedy = E.continuation_logprobs(model, ctx, cont, batch_size=3)
    ids, mask = policy.pad([a + b for a, b in zip(ctx, cont)],
                           [[0] * len(a) + [1] * len(b) for a, b in zip(ctx, cont)])
    want = policy.sequence_logprobs(model, ids, mask)
    assert torch.allclose(torch.tensor(lls), want, atol=1e-5)
    roll = policy.sample(model, TOK, ctx, 4, greedy=True, stop_id=TOK.encode("\n")[0])
    assert greedy == [c == b for c, b in zip(roll.completions, cont)]


def test_a_prefix_distractor_beats_the_answer_under_acc_but_not_with_an_end(model):
    items = E.arithmetic_mc(TEST, seed=3)
    bare = E.multiple_choice(model, TOK, items)
    prefix = [(i, it) for i, it in enumerate(items)
              if any(c != it.choices[it.gold] and it.choices[it.gold].startswith(c)
                     for c in it.choices)]
    assert prefix
    for i, it in prefix:
        short = next(j for j, c in enumerate(it.choices)
                     if c != it.choices[it.gold] and it.choices[it.gold].startswith(c))
        assert bare.lls[i][short] >= bare.lls[i][it.gold] and bare.scores["acc"][i] == 0.0
    eol = E.multiple_choice(model, TOK, E.arithmetic_mc(TEST, seed=3, end="\n"))
    assert eol.mean("acc") > bare.mean("acc") + 0.2


def test_heldout_is_the_token_mean_cross_entropy(model):
    texts = [task.raw_line(p) + "\n" for p in TEST[:10]]
    h = E.heldout(model, TOK, texts, task.BOS)
    ids = [[task.BOS] + TOK.encode(t) for t in texts]
    x, mask = policy.pad(ids)
    nats = -(policy.token_logprobs(model, x) * mask[:, 1:]).sum().item()
    n = sum(len(i) - 1 for i in ids)
    assert h["tokens"] == n and h["bytes"] == sum(len(t) for t in texts)
    assert h["nats_per_token"] == pytest.approx(nats / n, rel=1e-5)
    assert h["bits_per_byte"] == pytest.approx(nats / h["bytes"] / math.log(2), rel=1e-5)
    assert h["perplexity"] == pytest.approx(math.exp(nats / n), rel=1e-5)


# ---------------------------------------------------------------------------------------------
# pass@k
# ---------------------------------------------------------------------------------------------

@given(st.integers(1, 12).flatmap(lambda n: st.tuples(
    st.just(n), st.integers(0, n), st.integers(1, n))))
@settings(max_examples=200, deadline=None)
def test_pass_at_k_is_the_share_of_k_subsets_with_a_right_sample(nck):
    n, c, k = nck
    right = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    brute = sum(any(right[i] for i in s) for s in subsets) / len(subsets)
    assert E.pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12)


def test_pass_at_k_matches_lm_evals_and_is_unbiased():
    import numpy as np
    from lm_eval.tasks.cruxeval.utils import _pass_at_k

    for n, c, k in [(200, 13, 1), (200, 13, 10), (200, 13, 100), (1000, 3, 500), (10, 10, 5)]:
        assert E.pass_at_k(n, c, k) == pytest.approx(float(_pass_at_k(n, c, k)), rel=1e-12)
    # E over c ~ Binomial(n, p) of the estimate is the true 1 - (1 - p)^k; the plug-in is low
    n, k, p = 20, 5, 0.1
    weights = [math.comb(n, c) * p ** c * (1 - p) ** (n - c) for c in range(n + 1)]
    unbiased = sum(w * E.pass_at_k(n, c, k) for c, w in enumerate(weights))
    plug_in = sum(w * E.pass_at_k_naive(n, c, k) for c, w in enumerate(weights))
    assert unbiased == pytest.approx(1 - (1 - p) ** k, abs=1e-12)
    assert plug_in < unbiased - 0.01
    assert np.isfinite(E.pass_at_k(10**6, 10, 1000))


def test_sampled_counts_agree_with_the_foundations_accuracy(model):
    raw = E.sample_counts(model, TOK, TEST[:30], 1, form="raw", greedy=True)
    assert sum(raw) / 30 == base.raw_accuracy(model, TOK, TEST[:30])
    chat = E.sample_counts(model, TOK, TEST[:30], 1, form="chat", greedy=True)
    assert sum(chat) / 30 == policy.accuracy(model, TOK, TEST[:30])
    g = torch.Generator().manual_seed(0)
    counts = E.sample_counts(model, TOK, TEST[:10], 4, 1.0, "raw", g)
    assert all(0 <= c <= 4 for c in counts)
    assert E.mean_pass_at_k(counts, 4, 4) >= E.mean_pass_at_k(counts, 4, 1)


# ---------------------------------------------------------------------------------------------
# Noise
# ---------------------------------------------------------------------------------------------

@given(st.integers(1, 500).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n))),
       st.sampled_from([0.9, 0.95, 0.99]))
@settings(max_examples=100, deadline=None)
def test_wilson_equals_scipy(ns, conf):
    from scipy.stats import binomtest

    n, s = ns
    ci = binomtest(s, n).proportion_ci(confidence_level=conf, method="wilson")
    lo, hi = N.wilson(s, n, conf)
    assert lo == pytest.approx(ci.low, abs=1e-9) and hi == pytest.approx(ci.high, abs=1e-9)


def test_the_normal_interval_collapses_where_wilson_does_not():
    from scipy.stats import norm

    assert N.z_value(0.95) == pytest.approx(norm.ppf(0.975), rel=1e-12)
    assert N.normal_ci(50, 50) == (1.0, 1.0)
    lo, hi = N.wilson(50, 50)
    assert hi == 1.0 and 0.9 < lo < 0.95


@pytest.mark.parametrize("p1, p2", [(0.5, 0.55), (0.7, 0.75), (0.9, 0.95)])
def test_items_needed_gives_the_power_by_simulation(p1, p2):
    n = N.items_needed(p1, p2)
    assert N.detection_rate(p1, p2, n, trials=6000) == pytest.approx(0.8, abs=0.03)
    assert N.detection_rate(p1, p2, n // 4, trials=6000) < 0.4
    assert N.items_needed(p1, p1 + 0.01) > 15 * n


# ---------------------------------------------------------------------------------------------
# Contamination
# ---------------------------------------------------------------------------------------------

def test_the_split_is_clean_and_planted_items_are_found():
    train = task.pretraining_text(5000, 2, 0).splitlines()
    test = [task.raw_line(p) for p in TEST]
    assert contamination.flagged_share(contamination.overlap(train, test, 13)) == 0.0
    assert contamination.flagged_share(contamination.overlap(train, test, 2)) > 0.1
    planted, chosen = contamination.plant("\n".join(train), test, 7, seed=1)
    rows = contamination.overlap(planted.splitlines(), test, 13)
    copies = {test[i] for i in chosen}  # items repeat (drawn with replacement)
    assert [i for i, r in enumerate(rows) if r.flagged] == \
        [i for i, line in enumerate(test) if line in copies]
    assert all(r.n == 3 and r.fraction == 1.0 for r in (rows[i] for i in chosen))


def test_word_ngrams_agree_with_lm_evals_decontamination_ngrams(capsys):
    """On prose, where punctuation is attached to words (so both normalisations agree):
    flagged exactly when lm-eval's janitor n-grams overlap."""
    from lm_eval.decontamination.janitor import Janitor, word_ngrams

    from trainbook.data import load_corpus

    capsys.readouterr()  # the janitor warns on import that its C++ module is absent
    text = load_corpus("tinyshakespeare")
    paras = [p for p in text.split("\n\n") if len(p.split()) >= 30]
    rng = random.Random(0)
    train, test = paras[:400], rng.sample(paras[400:900], 20)
    test += [rng.choice(train)[:200] for _ in range(5)] + \
        [" ".join(rng.choice(train).split()[5:25]) for _ in range(5)]
    rows = contamination.overlap(train, test, 13)
    j = Janitor()
    assert j.ngram_n == contamination.GPT3_MAX_N == 13  # lm-eval's default n-gram size
    grams = {g for t in train for g in word_ngrams(j.normalize_string(t), 13)}
    theirs = [any(g in grams for g in word_ngrams(j.normalize_string(t), 13)) for t in test]
    assert [r.flagged for r in rows] == theirs and sum(theirs) >= 10


# ---------------------------------------------------------------------------------------------
# Chat-template pitfalls
# ---------------------------------------------------------------------------------------------

def test_rendering_then_tokenizing_adds_a_second_bos(tmp_path, model):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(chat_pitfalls.save_bos_adding(TOK, tmp_path))
    r = chat_pitfalls.renderings(hf, "07+58")
    assert r[chat_pitfalls.RIGHT] == r[chat_pitfalls.RIGHT_TEXT] == TOK.prompt_ids("07+58")
    assert r[chat_pitfalls.DOUBLE] == [task.BOS] + TOK.prompt_ids("07+58")
    assert r[chat_pitfalls.NO_PROMPT] == TOK.prompt_ids("07+58")[:-1]
    rows = {x["rendering"]: x for x in chat_pitfalls.bos_effect(model, TOK, hf, TEST[:10])}
    assert rows[chat_pitfalls.DOUBLE]["leading BOS"] == 2
    assert rows[chat_pitfalls.RIGHT]["same ids as training"]


@pytest.mark.timeout(120)
def test_lm_evals_hf_model_does_not_add_a_second_bos(tmp_path, model):
    """The chapter's claim about lm-eval's guard: HFLM.tok_encode of a rendered chat prompt
    (which starts with BOS) gives one BOS, where the tokenizer's own call gives two."""
    os.environ.update(C.OFFLINE)
    from lm_eval.models.huggingface import HFLM

    hf_io.export(model, tmp_path / "m", TOK)
    chat_pitfalls.save_bos_adding(TOK, tmp_path / "m")
    lm = HFLM(pretrained=str(tmp_path / "m"), device="cpu", dtype="float32")
    text = lm.tokenizer.apply_chat_template([{"role": "user", "content": "07+58"}],
                                            tokenize=False, add_generation_prompt=True)
    assert lm.tokenizer(text)["input_ids"] == [task.BOS] + TOK.prompt_ids("07+58")
    assert lm.tok_encode(text) == TOK.prompt_ids("07+58")


# ---------------------------------------------------------------------------------------------
# The command, and bad input
# ---------------------------------------------------------------------------------------------

@pytest.mark.timeout(240)
def test_the_eval_command_prints_the_scorecard(tmp_path, model, capsys):
    hf_io.export(model, tmp_path / "m", TOK)
    argv = ["eval", str(tmp_path / "m"), "--items", "30", "--form", "raw", "--samples", "3",
            "--k", "1", "3", "--json"]
    assert main(argv) == 0
    card = json.loads(capsys.readouterr().out)
    assert main(["eval", "base", "--items", "30", "--form", "raw", "--samples", "3", "--k", "1",
                 "3", "--json"]) == 0  # the shipped base model by name: the same model
    assert json.loads(capsys.readouterr().out) == card
    want = E.scorecard(model, TOK, task.make_problems(30, 2, 1, "test"), 4, 1, "raw", 3, 1.0,
                       [1, 3], torch.Generator().manual_seed(1))
    assert card["greedy"]["accuracy"] == want["greedy"]["accuracy"] > 0.9
    assert card["multiple_choice"]["newline"]["acc"] == want["multiple_choice"]["newline"]["acc"]
    assert card["sampled"]["pass_at_k"]["3"] == pytest.approx(want["sampled"]["pass_at_k"][3])


def test_the_command_offers_the_modules_forms():
    from trainbook.commands import eval as command

    assert set(command.FORMS) == set(E.FORMS)


def exit_status(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse's own errors
        return e.code


@pytest.mark.parametrize("argv, names", [
    (["eval"], "MODEL"),
    (["eval", "missing"], "missing"),
    (["eval", "m", "--samples", "2", "--k", "5"], "--k 5"),
    (["eval", "m", "--k", "5"], "--samples"),
    (["eval", "m", "--choices", "12"], "--choices"),
    (["eval", "m", "--form", "xml"], "xml"),
])
def test_the_eval_command_rejects_bad_input_in_one_line(argv, names, tmp_path, monkeypatch,
                                                        capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m").mkdir()
    assert exit_status(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and names in err[0]


@pytest.mark.parametrize("call, match", [
    (lambda: E.pass_at_k(5, 6, 1), "c <= n"),
    (lambda: E.pass_at_k(5, 1, 0), "k must be"),
    (lambda: E.pass_at_k(3, 1, 4), "k <= n"),
    (lambda: E.predictions([-1.0], ["a", "b"]), "one log-likelihood per choice"),
    (lambda: E.MCItem("x", ("a",), 0), "two or more"),
    (lambda: E.MCItem("x", ("a", "b"), 2), "gold 2"),
    (lambda: E.MCItem("", ("a", "b"), 0), "context"),
    (lambda: E.arithmetic_mc(TEST, n_choices=1), "n_choices"),
    (lambda: E.arithmetic_mc([], 4), "no problems"),
    (lambda: E.continuation_logprobs(None, [[1]], []), "as many contexts"),
    (lambda: E.continuation_logprobs(None, [[]], [[1]]), "must not be empty"),
    (lambda: E.continuation_logprobs(None, [[1]], [[1]], batch_size=0), "batch_size"),
    (lambda: E.heldout(None, TOK, [], 1), "non-empty list"),
    (lambda: E.heldout(None, TOK, ["a"], -1), "prefix_id"),
    (lambda: E.sample_counts(None, TOK, TEST, 0), "n \\(samples per item\\)"),
    (lambda: E.sample_counts(None, TOK, TEST, 1, form="json"), "form must be"),
    (lambda: E.sample_counts(None, TOK, TEST, 1, prompts=[[1]]), "one prompt per item"),
    (lambda: E.mean_pass_at_k([], 3, 1), "no item counts"),
    (lambda: E.scorecard(None, object(), TEST), "chat tokenizer"),
    (lambda: N.wilson(5, 3), "exceeds n"),
    (lambda: N.normal_ci(1, 0), "n must be"),
    (lambda: N.z_value(1.5), "confidence"),
    (lambda: N.mean_stderr([1.0]), "at least two"),
    (lambda: N.items_needed(0.5, 0.5), "no difference"),
    (lambda: N.items_needed(0.5, 1.2), "p2 must be"),
    (lambda: N.items_needed(0.5, 0.6, power=1.0), "power"),
    (lambda: N.detection_rate(0.5, 0.6, 1), "n must be"),
    (lambda: contamination.overlap("train text", ["a"]), "train_texts"),
    (lambda: contamination.overlap(["a b"], ["a"], 0), "n must be"),
    (lambda: contamination.overlap(["a b"], ["+="]), "no words"),
    (lambda: contamination.plant("a\n", ["x"], 2), "k must be"),
    (lambda: contamination.flagged_share([]), "no overlap rows"),
    (lambda: chat_pitfalls.bos_adding("tok"), "ChatTokenizer"),
    (lambda: chat_pitfalls.renderings(object(), "1+1"), "chat template"),
    (lambda: C.write_tasks("x", {}, ["a"]), "mc must map"),
    (lambda: C.write_tasks("x", {"t": [E.MCItem("c", ("a", "b"), 0)]}, []), "texts must"),
    (lambda: C.run("nowhere", "x", [C.MC_TASK]), "no config.json"),
    (lambda: C.check(items=3), "CheckItems"),
    (lambda: C.CheckItems(n=0), "CheckItems.n"),
])
def test_bad_input_is_refused_with_the_fix(call, match):
    with pytest.raises(ValueError, match=match):
        call()
