"""DPO and its relatives (book/alignment/dpo): the losses against their formulas and against
trl's on the same batch and weights (DPO, IPO, SimPO), trl's defaults, the preference pairs from
the verifier, the stored start policy and study, and bad input."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_align_foundation import tiny_model  # tests/: the foundation's tiny model

from trainbook.align import dpo, dpo_study, dpo_trl, start, task
from trainbook.align.preferences import Pair

TOK = task.chat_tokenizer()
DATA = Path(__file__).resolve().parents[1] / "book" / "alignment" / "data"
PAIRS = [Pair("17+34", "51", "100", 1.0), Pair("31+20", "51", "8", 1.0),
         Pair("81+98", "179", "1588", 1.0)]


def test_trl_defaults_the_chapter_relies_on(tmp_path):
    import trl
    from trl.experimental.cpo import CPOConfig

    args = trl.DPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[])
    assert args.beta == dpo.TRL_DPO_BETA
    assert args.loss_type == dpo.TRL_DPO_LOSS
    assert args.label_smoothing == dpo.TRL_DPO_LABEL_SMOOTHING
    assert args.learning_rate == dpo.TRL_DPO_LR
    cpo = CPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[])
    assert cpo.simpo_gamma == dpo.TRL_SIMPO_GAMMA and cpo.cpo_alpha == dpo.TRL_CPO_ALPHA


def test_dpo_loss_is_bradley_terry_on_the_log_ratios():
    pc, pr = torch.tensor([-1.0, -3.0]), torch.tensor([-2.0, -1.0])
    rc, rr = torch.tensor([-1.5, -2.0]), torch.tensor([-1.5, -2.0])
    beta = 0.5
    want = [-math.log(1 / (1 + math.exp(-beta * ((a - c) - (b - d)))))
            for a, b, c, d in zip(pc.tolist(), pr.tolist(), rc.tolist(), rr.tolist())]
    torch.testing.assert_close(dpo.dpo_loss(pc, pr, rc, rr, beta), torch.tensor(want))
    # equal log-ratios: the preference is a coin flip, loss log 2
    z = torch.zeros(3)
    torch.testing.assert_close(dpo.dpo_loss(z, z, z, z), torch.full((3,), math.log(2)))
    # the implicit rewards' difference is the margin inside the sigmoid
    margin = dpo.implicit_rewards(pc, rc, beta) - dpo.implicit_rewards(pr, rr, beta)
    torch.testing.assert_close(margin, beta * ((pc - rc) - (pr - rr)))


def test_ipo_and_simpo_against_their_formulas():
    pc, pr, rc, rr = (torch.tensor([x]) for x in (-2.0, -6.0, -3.0, -4.0))
    nc, nr = torch.tensor([2.0]), torch.tensor([4.0])
    h = (-2.0 + 3.0) / 2 - (-6.0 + 4.0) / 4
    assert dpo.ipo_loss(pc, pr, rc, rr, nc, nr, tau=0.1).item() == pytest.approx((h - 5.0) ** 2)
    s = 2.0 * (-2.0 / 2 - -6.0 / 4) - 0.5
    assert dpo.simpo_loss(pc, pr, nc, nr, beta=2.0, gamma=0.5).item() == \
        pytest.approx(-F.logsigmoid(torch.tensor(s)).item())


def test_pair_batch_lays_out_chosen_then_rejected_with_completion_masks():
    ids, mask = dpo.pair_batch(TOK, PAIRS[:2])
    assert ids.shape[0] == 4
    for row, (prompt, response) in enumerate([(p.prompt, p.chosen) for p in PAIRS[:2]] +
                                             [(p.prompt, p.rejected) for p in PAIRS[:2]]):
        want, want_mask = TOK.chat_ids(prompt, response)
        assert ids[row, :len(want)].tolist() == want
        assert mask[row, :len(want)].tolist() == want_mask and mask[row, len(want):].sum() == 0
    lp = dpo.pair_logprobs(tiny_model(), ids, mask)
    assert lp["n_chosen"].tolist() == [3.0, 3.0] and lp["n_rejected"].tolist() == [4.0, 2.0]


@pytest.mark.parametrize("loss", ["sigmoid", "ipo"])
def test_dpo_and_ipo_equal_trl_on_the_same_batch(loss):
    policy, ref = tiny_model(0), tiny_model(1)
    c = dpo_trl.compare_dpo(policy, ref, TOK, PAIRS, loss=loss, beta=0.1)
    assert c.same_ids
    assert c.loss_diff < 1e-5 * max(1.0, abs(c.trl_loss))
    assert c.reward_diff < 1e-5 and c.grad_rel < 1e-5


def test_simpo_equals_trl_cpo_simpo_on_the_same_batch():
    c = dpo_trl.compare_simpo(tiny_model(2), TOK, PAIRS, beta=2.0, gamma=0.5)
    assert c.same_ids and c.loss_diff < 1e-5 and c.reward_diff < 1e-5 and c.grad_rel < 1e-5


def test_preference_pairs_put_a_verified_answer_against_a_wrong_one():
    model = start.load_start(DATA)
    items = task.make_problems(24, 2, seed=7)
    pairs, n = dpo.preference_pairs(model, TOK, items, samples=4, seed=3)
    assert n == 96 and 0 < len(pairs) <= 24
    answer = {p.prompt: p.answer for p in items}
    for p in pairs:
        item = task.Problem(p.prompt, answer[p.prompt])
        assert task.verify(item, p.chosen) == 1.0 and task.verify(item, p.rejected) == 0.0


def test_training_follows_the_loss_and_leaves_the_reference_alone():
    model, ref = tiny_model(0), tiny_model(0)
    before = copy.deepcopy(ref.state_dict())
    hist = dpo.train(model, ref, TOK, PAIRS, dpo.DPOConfig(steps=15, batch_size=3, lr=3e-3))
    assert hist[0]["margin"] == pytest.approx(0.0, abs=1e-6)  # policy == reference at step 0
    assert hist[-1]["loss"] < hist[0]["loss"] and hist[-1]["margin"] > 0
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in before.items())
    simpo = dpo.train(tiny_model(0), None, TOK, PAIRS,
                      dpo.DPOConfig(loss="simpo", beta=2.0, steps=10, batch_size=3, lr=3e-3))
    assert simpo[-1]["loss"] < simpo[0]["loss"]


@pytest.mark.records
def test_stored_start_policy_matches_its_record():
    rec = start.start_record(DATA)
    assert rec["sft"]["steps"] == start.START_SFT.steps and rec["items"] == start.START_ITEMS
    model = start.load_start(DATA)
    assert task.VOCAB_SIZE == model.cfg.vocab_size
    # its pass@1 on the first 100 evaluation items agrees with a fresh measurement
    from trainbook.align import policy
    assert 0.1 < rec["pass1"] < 0.6
    assert policy.accuracy(model, TOK, start.eval_items(100)) == pytest.approx(rec["pass1"],
                                                                               abs=0.12)


def test_bad_input_is_rejected_with_a_clear_message(tmp_path):
    model = tiny_model()
    z = torch.zeros(2)
    with pytest.raises(ValueError, match="beta must be a positive number"):
        dpo.dpo_loss(z, z, z, z, beta=0.0)
    with pytest.raises(ValueError, match="tau must be"):
        dpo.ipo_loss(z, z, z, z, z, z, tau=-1)
    with pytest.raises(ValueError, match="gamma must be >= 0"):
        dpo.simpo_loss(z, z, z, z, gamma=-0.1)
    with pytest.raises(ValueError, match="DPOConfig.loss must be one of"):
        dpo.DPOConfig(loss="kto")
    with pytest.raises(ValueError, match="DPOConfig.lr must be a positive number"):
        dpo.DPOConfig(lr=0)
    with pytest.raises(ValueError, match="no preference pairs"):
        dpo.pair_batch(TOK, [])
    with pytest.raises(ValueError, match="no preference pairs"):
        dpo.train(model, model, TOK, [])
    with pytest.raises(ValueError, match="needs a reference model"):
        dpo.train(model, None, TOK, PAIRS)
    with pytest.raises(ValueError, match="samples must be a whole number >= 2"):
        dpo.preference_pairs(model, TOK, task.make_problems(2), samples=1)
    with pytest.raises(ValueError, match="no items"):
        dpo.preference_pairs(model, TOK, [])
    with pytest.raises(ValueError, match="an even number of rows"):
        dpo.pair_logprobs(model, torch.ones(3, 4, dtype=torch.long), torch.ones(3, 4))
    with pytest.raises(ValueError, match="one item per completion"):
        dpo.rewards(task.make_problems(2), dpo.Rollouts([[1]], [[2]], ["x"]))
    with pytest.raises(ValueError, match="needs the reference"):
        dpo.preference_loss(dpo.DPOConfig(), {}, None)
    with pytest.raises(ValueError, match="'sigmoid' or 'ipo'"):
        dpo_trl.compare_dpo(model, model, TOK, PAIRS, loss="simpo")
    with pytest.raises(ValueError, match="no preference pairs"):
        dpo_trl.compare_simpo(model, TOK, [])
    with pytest.raises(ValueError, match="write one with trainbook.align.start.write_start"):
        start.load_start(tmp_path)


@pytest.mark.records
def test_stored_study_agrees_with_a_fresh_run_of_its_main_point():
    rec = dpo_study.read_study(DATA / "dpo-study.json")
    assert rec["study"] == dpo_study.STUDY and set(rec["runs"]) == set(dpo_study.RUNS)
    tok, items = TOK, start.eval_items(dpo_study.STUDY["eval_items"])
    model = start.load_start(DATA)
    train = task.make_problems(dpo_study.STUDY["prompts"], 2, seed=dpo_study.STUDY["pair_seed"])
    pairs, generated = dpo.preference_pairs(model, tok, train, dpo_study.STUDY["samples"],
                                            seed=dpo_study.STUDY["pair_seed"])
    assert generated == rec["generated"] and abs(len(pairs) - rec["pairs"]) <= 5
    fresh = dpo_study.one_run("dpo", pairs, tok, items, DATA)
    stored = rec["runs"]["dpo"]
    assert fresh["pass1"] == pytest.approx(stored["pass1"], abs=0.03)
    for a, b in zip(fresh["tracked"], stored["tracked"]):
        assert a["step"] == b["step"]
        assert a["logp_chosen"] == pytest.approx(b["logp_chosen"], abs=0.05)
        assert a["margin"] == pytest.approx(b["margin"], abs=0.01)
    # the chapter's claims on the stored study
    assert stored["pass1"] > rec["pass1_start"] + 0.05
    hot = rec["runs"]["dpo lr 1e-4"]["tracked"]
    assert hot[-1]["logp_chosen"] < hot[0]["logp_chosen"] - 2
    assert hot[-1]["margin"] > hot[1]["margin"]
    assert rec["grpo"]["generated"] == rec["generated"]
