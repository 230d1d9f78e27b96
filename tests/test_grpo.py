"""GRPO and reasoning (book/alignment/grpo): group advantages, the clipped loss and its three
aggregations against their formulas and against trl's GRPOTrainer on the same generated batch
(on- and off-policy, with and without the KL term), the length bias measured by autograd,
dynamic sampling, trl's defaults, the stored runs, and bad input."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from test_align_foundation import tiny_model  # tests/: the foundation's tiny model

from trainbook.align import grpo, grpo_study, grpo_trl, kl, start, task

TOK = task.chat_tokenizer()
DATA = Path(__file__).resolve().parents[1] / "book" / "alignment" / "data"


def test_trl_defaults_the_chapter_relies_on(tmp_path):
    import trl

    args = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[])
    assert args.beta == grpo.TRL_GRPO_BETA
    assert args.epsilon == grpo.TRL_GRPO_EPSILON and args.epsilon_high is None
    assert args.num_generations == grpo.TRL_GRPO_NUM_GENERATIONS
    assert args.loss_type == grpo.TRL_GRPO_LOSS_TYPE
    assert args.scale_rewards == grpo.TRL_GRPO_SCALE_REWARDS
    assert args.num_iterations == grpo.TRL_GRPO_NUM_ITERATIONS
    assert args.use_bias_correction_kl == grpo.TRL_GRPO_KL_RATIO
    assert args.max_grad_norm == grpo.GRPOConfig().max_grad_norm


def test_group_advantages_standardise_within_each_group():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    a = grpo.group_advantages(r, 4)
    g = r[:4]
    torch.testing.assert_close(a[:4], (g - g.mean()) / (g.std() + grpo.ADV_EPS))
    assert a[4:].abs().max() == 0  # all right: no signal
    torch.testing.assert_close(grpo.group_advantages(r, 4, "none")[:4], g - g.mean())
    assert grpo.group_advantages(r, 4).view(2, 4).sum(1).abs().max() < 1e-6


def test_clipped_loss_and_kl_term_against_the_formulas():
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(3, 5, generator=g) * 0.3 - 1
    old = logp + torch.randn(3, 5, generator=g) * 0.3
    ref = logp + torch.randn(3, 5, generator=g) * 0.3
    adv = torch.tensor([1.0, -0.5, 2.0])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    ratio = (logp - old).exp()
    per = -torch.min(ratio * adv[:, None], ratio.clamp(0.8, 1.28) * adv[:, None]) + \
        0.04 * (torch.exp(ref - logp) - (ref - logp) - 1)
    m = mask.float()
    want = {"grpo": ((per * m).sum(1) / m.sum(1)).mean(), "dapo": (per * m).sum() / m.sum(),
            "dr_grpo": (per * m).sum() / (3 * 6)}
    for loss, w in want.items():
        got = grpo.grpo_loss(logp, old, ref, adv, mask, loss, beta=0.04, eps_low=0.2,
                             eps_high=0.28, max_len=6)
        torch.testing.assert_close(got, w)
    torch.testing.assert_close(kl.estimate(logp, ref, "k3"),
                               torch.exp(ref - logp) - (ref - logp) - 1)


def test_token_weights_show_each_aggregations_length_bias():
    lengths = [2, 4, 8, 16]
    seq = grpo.token_weights(lengths, "grpo")
    assert seq == pytest.approx([1 / (4 * n) for n in lengths])  # 1 / (B |o_i|)
    tok = grpo.token_weights(lengths, "dapo")
    assert tok == pytest.approx([1 / sum(lengths)] * 4)
    dr = grpo.token_weights(lengths, "dr_grpo", max_len=32)
    assert dr == pytest.approx([1 / (4 * 32)] * 4)
    # a whole sequence's weight: constant under grpo, proportional to length otherwise
    assert [w * n for w, n in zip(seq, lengths)] == pytest.approx([0.25] * 4)


@pytest.mark.parametrize("loss", ["grpo", "bnpo", "dapo", "dr_grpo"])
def test_grpo_loss_equals_trl_on_the_same_generated_batch(loss):
    policy, ref = start.load_start(DATA), start.load_start(DATA)
    with torch.no_grad():  # a reference that differs from the policy, so the KL is not 0
        for p in ref.parameters():
            p.add_(0.01 * torch.randn_like(p))
    items = task.make_problems(4, 2, seed=5)
    c = grpo_trl.compare_grpo(policy, ref, TOK, items, loss=loss, beta=0.04, group=4)
    assert c.same_rewards and c.advantage_diff < 1e-6
    assert c.loss_diff < 1e-5 * max(1.0, abs(c.trl_loss)) and c.grad_rel < 1e-5


def test_grpo_loss_equals_trl_off_policy_with_clip_higher_and_dr_grpo_scaling():
    policy, old = start.load_start(DATA), start.load_start(DATA)
    with torch.no_grad():
        for p in old.parameters():
            p.add_(0.05 * torch.randn_like(p))
    items = task.make_problems(4, 2, seed=6)
    c = grpo_trl.compare_grpo(policy, policy, TOK, items, loss="grpo", group=4, eps_high=0.28,
                              old=old)
    assert c.loss_diff < 1e-5 * max(1.0, abs(c.trl_loss)) and c.grad_rel < 1e-5
    c = grpo_trl.compare_grpo(policy, policy, TOK, items, loss="dr_grpo", group=4,
                              scale="none", old=old)
    assert c.advantage_diff < 1e-6 and c.loss_diff < 1e-5 and c.grad_rel < 1e-5
    # trl's default multiplies the KL term by the ratio: off-policy the values differ
    c = grpo_trl.compare_grpo(policy, old, TOK, items, beta=0.04, group=4, old=old,
                              kl_ratio=True)
    assert c.loss_diff > 1e-4


def test_dynamic_sampling_keeps_only_groups_whose_rewards_differ():
    model = start.load_start(DATA)
    items = task.make_problems(200, 2, seed=8)
    cfg = grpo.GRPOConfig(prompts=6, group=4, dynamic_sampling=True, max_draws=6)
    batch = grpo.collect(model, TOK, items, cfg, random.Random(0), torch.Generator().manual_seed(0))
    r = torch.tensor(batch.rewards).view(-1, 4)
    assert len(batch.rewards) == 24 and batch.generated >= 24
    assert bool(((r.max(1).values - r.min(1).values) > 0).all())
    plain = grpo.collect(model, TOK, items, grpo.GRPOConfig(prompts=6, group=4),
                         random.Random(0), torch.Generator().manual_seed(0))
    assert plain.generated == 24


def test_a_short_grpo_run_trains_and_records():
    model = start.load_start(DATA)
    ref = start.load_start(DATA)
    items = task.make_problems(200, 2, seed=3)
    hist = grpo.train(model, TOK, items, grpo.GRPOConfig(steps=3, prompts=4, group=4, beta=0.04,
                                                         updates=2), ref=ref,
                      eval_items=start.eval_items(20), eval_every=2)
    assert len(hist) == 3 and "pass1" in hist[0] and "pass1" in hist[2]
    assert "pass1_after" in hist[-1] and hist[0]["kl"] == pytest.approx(0.0, abs=1e-6)
    assert all(h["generated"] == 16 for h in hist)


def test_bad_input_is_rejected_with_a_clear_message():
    r = torch.zeros(8)
    with pytest.raises(ValueError, match="scale must be one of"):
        grpo.group_advantages(r, 4, "batch")
    with pytest.raises(ValueError, match="group must be a whole number >= 2"):
        grpo.group_advantages(r, 1)
    with pytest.raises(ValueError, match="whole groups of 3"):
        grpo.group_advantages(r, 3)
    with pytest.raises(ValueError, match="loss must be one of"):
        grpo.aggregate(torch.zeros(2, 3), torch.ones(2, 3), "sum")
    with pytest.raises(ValueError, match="differ in shape"):
        grpo.aggregate(torch.zeros(2, 3), torch.ones(2, 4), "grpo")
    with pytest.raises(ValueError, match="dr_grpo needs max_len"):
        grpo.aggregate(torch.zeros(2, 4), torch.tensor([[0, 1, 1, 1], [0, 1, 0, 0]]), "dr_grpo",
                       max_len=2)
    with pytest.raises(ValueError, match="one per row"):
        grpo.clipped_token_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3))
    with pytest.raises(ValueError, match="needs the reference"):
        grpo.grpo_loss(torch.zeros(2, 3), torch.zeros(2, 3), None, torch.zeros(2),
                       torch.ones(2, 3), beta=0.1)
    with pytest.raises(ValueError, match="lengths must be whole numbers"):
        grpo.token_weights([3, 0], "grpo")
    with pytest.raises(ValueError, match="advantage 0"):
        grpo.token_weights([3], "grpo", advantage=0)
    with pytest.raises(ValueError, match="GRPOConfig.loss must be one of"):
        grpo.GRPOConfig(loss="ppo")
    with pytest.raises(ValueError, match="GRPOConfig.group must be"):
        grpo.GRPOConfig(group=1)
    with pytest.raises(ValueError, match="GRPOConfig.eps_low must be below 1"):
        grpo.GRPOConfig(eps_low=1.0)
    with pytest.raises(ValueError, match="GRPOConfig.steps must be a positive"):
        grpo.GRPOConfig(steps=0)
    model = tiny_model()
    with pytest.raises(ValueError, match="needs a reference model"):
        grpo.train(model, TOK, task.make_problems(4), grpo.GRPOConfig(beta=0.1))
    with pytest.raises(ValueError, match="eval_every needs eval_items"):
        grpo.train(model, TOK, task.make_problems(4), eval_every=2)
    with pytest.raises(ValueError, match="no items"):
        grpo.train(model, TOK, [])
    with pytest.raises(ValueError, match="loss must be one of"):
        grpo_trl.compare_grpo(model, model, TOK, task.make_problems(2), loss="cispo")


@pytest.mark.records
def test_stored_kl_run_agrees_with_a_fresh_run_of_its_first_steps():
    rec = grpo_study.read_part(DATA, "kl")
    stored = rec["runs"]["grpo"]
    cfg = grpo.GRPOConfig(**{**stored["config"], "steps": 10})
    train = task.make_problems(grpo_study.STUDY["train_items"], 2,
                               seed=grpo_study.STUDY["train_seed"])
    items = start.eval_items(grpo_study.STUDY["eval_items"])
    hist = grpo.train(start.load_start(DATA), TOK, train, cfg, eval_items=items, eval_every=10)
    assert hist[0]["pass1"] == pytest.approx(rec["pass1_start"], abs=1e-9)
    assert hist[0]["reward"] == pytest.approx(stored["history"][0]["reward"], abs=1e-9)
    assert hist[-1]["pass1_after"] == pytest.approx(stored["history"][10]["pass1"], abs=0.05)


def test_stored_parts_back_the_chapters_claims():
    kl_part, dapo, r1 = (grpo_study.read_part(DATA, p) for p in ("kl", "dapo", "r1"))
    for run in kl_part["runs"].values():
        assert run["pass1"] > kl_part["pass1_start"] + 0.1  # GRPO raises pass@1 measurably
    runs = dapo["runs"]
    assert runs["clip-higher + dynamic sampling"]["generated"] > runs["clip 0.2"]["generated"]
    assert r1["r1"]["pass1_rs_sft"] > r1["pass1_start"] + 0.1


def test_stored_length_runs_back_the_chapters_claims():
    rec = grpo_study.read_part(DATA, "length")
    assert rec["max_pad"] == grpo_study.MAX_PAD and set(rec["runs"]) == set(grpo.LOSSES)
    last = {}
    for name, run in rec["runs"].items():
        h = run["history"]
        first = sum(x["length"] for x in h[:5]) / 5
        last[name] = sum(x["length"] for x in h[-5:]) / 5
        assert first - last[name] > 0.5  # every aggregation shortens the completions
        assert run["config"]["max_new_tokens"] == grpo_study.LENGTH_TOKENS
    assert max(last.values()) - min(last.values()) < 0.1
    assert abs(last["dapo"] - last["dr_grpo"]) < 0.05


def test_padded_items_keep_the_answer_verifiable():
    items = task.make_problems(50, 2, seed=1)
    padded = grpo_study.padded_items(items, seed=2)
    pads = {len(p.answer) - len(q.answer) for p, q in zip(padded, items)}
    assert pads <= set(range(grpo_study.MAX_PAD + 1)) and len(pads) > 1
    for p, q in zip(padded, items):
        assert p.answer.startswith(q.answer) and task.verify(q, p.answer) == 1.0
    with pytest.raises(ValueError, match="part must be one of"):
        grpo_study.write_part(DATA, "ppo")
    with pytest.raises(ValueError, match="samples must be a whole number"):
        grpo_study.rejection_sample(tiny_model(), TOK, items, 0)
