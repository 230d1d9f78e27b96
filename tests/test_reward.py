"""Reward models (align.reward, align.preferences, align.reward_trl, align.overoptimization):
the Bradley-Terry loss and the reward head against trl's RewardTrainer on the same weights and
batch, trl's defaults, preference data, the best-of-n curve against brute force, bad input."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from trainbook import configs
from trainbook.align import base, policy, reward, reward_trl, task
from trainbook.align import overoptimization as O
from trainbook.align import preferences as P
from trainbook.model import Transformer

TOK = task.chat_tokenizer()


def tiny_model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    cfg = configs.get("tiny-llama").with_(vocab_size=task.VOCAB_SIZE, d_model=32, n_layers=1,
                                         n_heads=2, n_kv_heads=2, d_ff=64, max_seq_len=32)
    return Transformer(cfg).eval()


# ---- preference data ------------------------------------------------------------------------

def test_graded_reward():
    item = task.Problem("07+58", "65")
    assert P.graded_reward(item, "65") == 1.0 and P.graded_reward(item, " 65 ") == 1.0
    assert P.graded_reward(item, "66") == pytest.approx(0.9)
    assert P.graded_reward(item, "60") == pytest.approx(0.5)
    assert P.graded_reward(item, "75") == 0.0 and P.graded_reward(item, "5") == 0.0
    assert P.graded_reward(item, "65!") == 0.0 and P.graded_reward(item, "") == 0.0
    assert P.graded_reward(item, "६५") == 0.0  # Devanagari digits: isdigit() but not ASCII


@pytest.mark.parametrize("kind", P.CORRUPTIONS)
def test_corrupt_never_returns_the_answer(kind):
    rng = random.Random(0)
    answers = ("0", "7", "10", "65", "100", "198")
    for answer in answers if kind not in ("swap", "drop") else answers[2:]:  # need 2 digits
        for _ in range(20):
            bad = P.corrupt(answer, rng, kind)
            assert bad != answer and bad.isdigit()


def test_constructed_pairs_prefer_the_answer_with_the_gold_gap_as_margin():
    items = task.make_problems(50, seed=3)
    pairs = P.constructed_pairs(items, seed=1)
    assert [p.chosen for p in pairs] == [i.answer for i in items]
    for p, i in zip(pairs, items):
        assert p.margin == pytest.approx(1.0 - P.graded_reward(i, p.rejected)) and p.margin > 0
    assert pairs == P.constructed_pairs(items, seed=1)


def test_preference_bad_input():
    with pytest.raises(ValueError, match="string of digits"):
        P.corrupt("6x", random.Random(0))
    with pytest.raises(ValueError, match="kind must be one of"):
        P.corrupt("65", random.Random(0), "flip")
    with pytest.raises(ValueError, match="could not corrupt"):
        P.corrupt("7", random.Random(0), "swap")
    with pytest.raises(ValueError, match="could not corrupt"):
        P.corrupt("11", random.Random(0), "swap")
    with pytest.raises(ValueError, match="no items"):
        P.constructed_pairs([])
    with pytest.raises(ValueError, match="no items"):
        P.sampled_pairs(tiny_model(), TOK, [])


def test_sampled_pairs_are_ranked_by_the_gold_reward():
    items = task.make_problems(40, seed=2)
    pairs = P.sampled_pairs(tiny_model(), TOK, items, temperature=2.0, seed=0)
    by_prompt = {i.prompt: i for i in items}
    for p in pairs:
        item = by_prompt[p.prompt]
        assert P.graded_reward(item, p.chosen) - P.graded_reward(item, p.rejected) == \
            pytest.approx(p.margin) and p.margin > 0


# ---- the reward model -----------------------------------------------------------------------

def test_reward_is_read_at_the_last_token_and_padding_changes_nothing():
    rm = reward.RewardModel(tiny_model())
    short, _ = TOK.chat_ids("1+2", "3")
    long, _ = TOK.chat_ids("10+20", "30")
    alone = rm(torch.tensor([short]))
    batch, _ = policy.pad([short, long])
    both = rm(batch)
    torch.testing.assert_close(both[0], alone[0])
    torch.testing.assert_close(rm.token_scores(torch.tensor([short]))[0, -1], alone[0])
    ids = torch.tensor([[5, 6, 7, 0, 0], [5, 0, 7, 8, 0], [0, 0, 0, 0, 0]])
    assert reward.last_index(ids).tolist() == [2, 3, 0]


def test_reward_model_keeps_the_language_model_unchanged():
    lm = tiny_model()
    before = {k: v.clone() for k, v in lm.state_dict().items()}
    rm = reward.RewardModel(lm)
    rm.body.embed.weight.data.add_(1.0)
    assert all(torch.equal(before[k], v) for k, v in lm.state_dict().items())
    assert isinstance(lm.head, torch.nn.Linear)


def test_bt_loss_is_the_bradley_terry_negative_log_likelihood():
    r_c, r_r = torch.tensor([2.0, -1.0, 0.5]), torch.tensor([1.0, 1.0, 0.5])
    p = torch.sigmoid(r_c - r_r)  # Bradley-Terry: P(chosen preferred)
    assert reward.bt_loss(r_c, r_r).item() == pytest.approx(-p.log().mean().item())
    m = torch.tensor([0.5, 0.0, 1.0])
    want = -F.logsigmoid(r_c - r_r - m).mean() + 0.01 * ((r_c + r_r) ** 2).mean()
    assert reward.bt_loss(r_c, r_r, m, 0.01).item() == pytest.approx(want.item())
    # only differences matter without centering
    assert reward.bt_loss(r_c + 7, r_r + 7).item() == pytest.approx(reward.bt_loss(r_c, r_r).item())


def test_reward_bad_input():
    with pytest.raises(ValueError, match="starts from the reference Transformer"):
        reward.RewardModel(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="two vectors of one length"):
        reward.bt_loss(torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError, match="one margin per pair"):
        reward.bt_loss(torch.zeros(3), torch.zeros(3), torch.zeros(2))
    with pytest.raises(ValueError, match="center_coef"):
        reward.bt_loss(torch.zeros(3), torch.zeros(3), None, -1.0)
    with pytest.raises(ValueError, match="no preference pairs"):
        reward.pair_batch(TOK, [])
    with pytest.raises(ValueError, match="lr must be a positive"):
        reward.RMConfig(lr=0.0)
    rm = reward.RewardModel(tiny_model())
    with pytest.raises(ValueError, match="as many responses as prompts"):
        reward.score(rm, TOK, ["1+1"], [])
    with pytest.raises(ValueError, match="trains a RewardModel"):
        reward.train_rm(tiny_model(), TOK, [P.Pair("1+1", "2", "3")])
    with pytest.raises(ValueError, match="no preference pairs"):
        reward.pair_accuracy(rm, TOK, [])
    with pytest.raises(ValueError, match="exports a RewardModel"):
        reward_trl.to_hf_reward(tiny_model())


# ---- against trl ----------------------------------------------------------------------------

def test_trl_reward_defaults():
    import transformers
    import trl

    args = trl.RewardConfig(output_dir="unused", report_to=[], use_cpu=True)  # bf16 needs it
    for name, value in reward_trl.TRL_REWARD_DEFAULTS.items():
        assert getattr(args, name) == value, name
    assert args.bf16 is reward_trl.TRL_BF16_WHEN_UNSET
    targs = transformers.TrainingArguments(output_dir="unused", report_to=[], use_cpu=True)
    for name, value in reward_trl.TRAINING_ARGS_DEFAULTS.items():
        got = getattr(targs, name)
        assert (got.value if hasattr(got, "value") else got) == value, name


def test_hf_reward_model_scores_like_ours():
    rm = reward.RewardModel(tiny_model(), seed=3)
    hf = reward_trl.to_hf_reward(rm).eval()
    assert hf.config.num_labels == 1 and hf.config.pad_token_id == task.PAD
    ids, _ = reward.pair_batch(TOK, P.constructed_pairs(task.make_problems(6, seed=1)))
    torch.testing.assert_close(hf(ids).logits.squeeze(-1), rm(ids), atol=1e-5, rtol=1e-5)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("center, margin", [(None, False), (0.01, True)])
def test_loss_and_gradients_equal_trls_reward_trainer(center, margin, capfd):
    lm = base.base_model()
    rm = reward.RewardModel(lm, seed=1)
    pairs = P.constructed_pairs(task.make_problems(12, seed=4), seed=2)
    capfd.readouterr()
    out = reward_trl.compare_trl(rm, TOK, pairs, center, margin)
    # nothing on stderr: datasets' progress bars (trl's tokenisation) became notebook widgets
    assert "examples/s" not in capfd.readouterr().err
    assert out.same_ids
    assert out.reward_diff < 1e-5 and out.loss_diff < 1e-6
    assert out.score_grad_diff < 1e-6 and out.embed_grad_diff < 1e-6
    assert out.ours_loss > 0.1  # a real loss, not a degenerate zero


# ---- training, accuracy, best-of-n ----------------------------------------------------------

@pytest.mark.timeout(300)
def test_training_separates_right_from_corrupted_answers():
    rm = reward.RewardModel(base.base_model())
    train = P.constructed_pairs(task.make_problems(2000, seed=0), seed=0)
    held_out = P.constructed_pairs(task.make_problems(200, split="test", seed=1), seed=1)
    before = reward.pair_accuracy(rm, TOK, held_out)
    losses = reward.train_rm(rm, TOK, train, reward.RMConfig(steps=60, batch_size=16))
    after = reward.pair_accuracy(rm, TOK, held_out)
    assert sum(losses[-10:]) / 10 < losses[0]
    assert after > before + 0.1 and after > 0.65


def test_kl_bon_formula():
    assert O.kl_bon_formula(1) == 0.0
    assert O.kl_bon_formula(2) == pytest.approx(math.log(2) - 0.5)
    with pytest.raises(ValueError, match="whole number >= 1"):
        O.kl_bon_formula(0)


def test_bon_distribution_equals_sampling_best_of_n():
    proxy, counts, n = [0.3, 1.2, -0.5, 1.2, 0.9], [3, 1, 4, 2, 2], 3
    probs = O.bon_distribution(proxy, counts, n)
    assert sum(probs) == pytest.approx(1.0)
    rng = random.Random(0)
    pool = [i for i, c in enumerate(counts) for _ in range(c)]
    hits = [0] * len(proxy)
    trials = 200_000
    for _ in range(trials):
        draw = [rng.choice(pool) for _ in range(n)]
        best = max(proxy[i] for i in draw)
        winners = [i for i in draw if proxy[i] == best]
        hits[rng.choice(winners)] += 1  # ties: any of the tied draws
    for p, h in zip(probs, hits):
        assert abs(p - h / trials) < 5 * math.sqrt(p * (1 - p) / trials) + 1e-9


def test_bon_kl_approaches_the_formula_without_ties_and_stays_below_it_with_ties():
    rng = random.Random(1)
    N = 4000
    distinct = [[rng.random() for _ in range(N)]]
    texts = [[str(i) for i in range(N)]]
    for n in (2, 8, 32):
        point = O.curve(distinct, distinct, texts, [n])[0]
        assert point.kl == pytest.approx(point.kl_formula, rel=0.02)
        assert point.kl <= point.kl_formula
    tied_texts = [[str(i % 7) for i in range(N)]]  # 7 distinct completions
    tied = [[float(i % 7) for i in range(N)]]
    for n in (2, 8, 32):
        point = O.curve(tied, tied, tied_texts, [n])[0]
        assert point.kl < point.kl_formula
        assert point.kl <= math.log(7)  # at most log 1/(base mass of any completion)


def test_best_of_n_never_loses_proxy_reward():
    model = tiny_model()
    rm = reward.RewardModel(tiny_model())
    items = task.make_problems(8, seed=2)
    points = O.best_of_n(model, {"proxy": rm}, TOK, items, 8, [1, 2, 8], P.graded_reward,
                         temperature=2.0)["proxy"]
    assert [p.n for p in points] == [1, 2, 8] and points[0].kl == 0.0
    assert points[0].proxy <= points[1].proxy <= points[2].proxy  # best-of-n never loses proxy
    with pytest.raises(ValueError, match="at most samples"):
        O.best_of_n(model, {"proxy": rm}, TOK, items, 4, [8], P.graded_reward)
    with pytest.raises(ValueError, match="RewardModels"):
        O.best_of_n(model, {}, TOK, items, 4, [2], P.graded_reward)
    with pytest.raises(ValueError, match="whole numbers >= 1"):
        O.curve([[1.0]], [[1.0]], [["a"]], [0])


# ---- the command ------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, words", [
    (["--steps", "0"], "must be >= 1"),
    (["--steps", "1000000"], "at most"),
    (["--lr", "-1"], "must be > 0"),
    (["--center-coef", "-0.5"], "--center-coef must be >= 0"),
    (["--start", "/nonexistent"], "holds no dpo-start.json"),
])
def test_reward_model_command_rejects_bad_input(argv, words, capsys, tmp_path):
    from trainbook.__main__ import main

    try:
        code = main(["reward-model", "--out", str(tmp_path / "out"), *argv])
    except SystemExit as e:  # argparse's own checks exit
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error:") and words in err[0]
    assert not (tmp_path / "out").exists()


def test_reward_model_command_overopt_needs_the_stored_model(capsys, tmp_path):
    from trainbook.__main__ import main

    code = main(["reward-model", "--overopt", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and f"run `python -m trainbook reward-model --out {tmp_path}` first" in err


def test_model_commands_write_into_the_books_data_only_when_told_to(capsys):
    """ppo and reward-model have no default --out: the book's stored runs are regenerated by
    `records regen`, never by a command run without arguments."""
    from trainbook.__main__ import main

    for argv in (["reward-model"], ["ppo"]):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        assert stop.value.code == 2 and "--out" in capsys.readouterr().err


# ---- the stored records (book/alignment/data) --------------------------------------------------

DATA = Path(__file__).resolve().parents[1] / "book" / "alignment" / "data"


def test_stored_overopt_record_agrees_with_the_code():
    from trainbook.align import reward_study

    rec = reward_study.overopt_record(DATA)
    want = {k: list(v) if isinstance(v, tuple) else v for k, v in
            reward_study.OVEROPT.items()}
    assert rec["settings"] == want
    names = [f"{n} pairs" for n in want["pairs"]] + ["stored reward model"]
    assert list(rec["proxies"]) == names
    assert rec["proxies"]["stored reward model"]["pairs"] == \
        reward_study.reward_record(DATA)["train_pairs"]
    first_gold = {p["curve"][0]["gold"] for p in rec["proxies"].values()}
    assert len(first_gold) == 1  # one set of samples for every proxy: the same n=1 policy
    for proxy in rec["proxies"].values():
        curve = proxy["curve"]
        assert [p["n"] for p in curve] == want["ns"]
        for a, b in zip(curve, curve[1:]):
            assert b["proxy"] >= a["proxy"] - 1e-9
        for p in curve:
            assert p["kl_formula"] == pytest.approx(O.kl_bon_formula(p["n"]))
            assert 0 <= p["kl"] <= p["kl_formula"] + 1e-9
