"""PPO from scratch (align.ppo) and the KL estimators (align.kl): each piece against a brute-force
or library computation, bad input, and short runs on the book's base model."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from trainbook import configs
from trainbook.align import base, kl, ppo, reward, task
from trainbook.model import Transformer

TOK = task.chat_tokenizer()


def tiny_model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    cfg = configs.get("tiny-llama").with_(vocab_size=task.VOCAB_SIZE, d_model=32, n_layers=1,
                                         n_heads=2, n_kv_heads=2, d_ff=64, max_seq_len=32)
    return Transformer(cfg).eval()


# ---- KL estimators --------------------------------------------------------------------------

def _two_distributions(seed: int, vocab: int = 12, spread: float = 0.5):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, generator=g)
    ref_logits = logits + spread * torch.randn(vocab, generator=g)
    return logits, ref_logits


def test_exact_kl_equals_torch_kl_div():
    logits, ref = torch.randn(3, 5, 17), torch.randn(3, 5, 17)
    theirs = F.kl_div(F.log_softmax(ref, -1), F.log_softmax(logits, -1), log_target=True,
                      reduction="none").sum(-1)
    torch.testing.assert_close(kl.exact(logits, ref), theirs)


@pytest.mark.parametrize("spread", [0.3, 1.0])
def test_k1_and_k3_are_unbiased_k2_is_not_and_k3_has_less_variance(spread):
    logits, ref_logits = _two_distributions(0, spread=spread)
    true = kl.exact(logits, ref_logits).item()
    g = torch.Generator().manual_seed(1)
    x = torch.multinomial(logits.softmax(-1), 400_000, replacement=True, generator=g)
    logp, ref_logp = F.log_softmax(logits, -1)[x], F.log_softmax(ref_logits, -1)[x]
    est = {k: kl.estimate(logp, ref_logp, k) for k in kl.ESTIMATORS}
    for k in ("k1", "k3"):  # unbiased: within 5 standard errors
        assert abs(est[k].mean().item() - true) < 5 * est[k].std().item() / math.sqrt(len(x))
    assert est["k3"].std() < est["k1"].std()
    assert (est["k3"] >= 0).all() and (est["k2"] >= 0).all() and (est["k1"] < 0).any()
    if spread == 1.0:  # far apart: k2's bias shows
        assert abs(est["k2"].mean().item() - true) > 10 * est["k2"].std().item() / len(x) ** .5


def test_k3_is_trls_grpo_form():
    """trl's GRPOTrainer writes the k3 estimator inline; ours must be the same number."""
    logp, ref = torch.randn(4, 7), torch.randn(4, 7)
    theirs = torch.exp(ref - logp) - (ref - logp) - 1
    torch.testing.assert_close(kl.estimate(logp, ref, "k3"), theirs)
    source = importlib.util.find_spec("trl.trainer.grpo_trainer").origin
    text = open(source).read()
    assert "torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - " \
        "per_token_logps) - 1" in text


def test_kl_bad_input():
    a = torch.zeros(3)
    with pytest.raises(ValueError, match="kind must be one of"):
        kl.estimate(a, a, "k4")
    with pytest.raises(ValueError, match="differs from ref_logp"):
        kl.estimate(a, torch.zeros(4))
    with pytest.raises(ValueError, match="must be tensors"):
        kl.estimate([0.0], a)
    with pytest.raises(ValueError, match="differs from ref_logits"):
        kl.exact(torch.zeros(2, 5), torch.zeros(2, 6))


# ---- GAE, whitening, losses -----------------------------------------------------------------

def brute_force_gae(rewards, values, mask, gamma, lam):
    """A_t = sum_l (gamma lam)^l delta_{t+l} over each row's actions, V = 0 after the last."""
    adv = torch.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        steps = [t for t in range(rewards.shape[1]) if mask[b, t]]
        v = [values[b, t].item() for t in steps] + [0.0]
        r = [rewards[b, t].item() for t in steps]
        delta = [r[i] + gamma * v[i + 1] - v[i] for i in range(len(steps))]
        for i, t in enumerate(steps):
            adv[b, t] = sum((gamma * lam) ** k * delta[i + k] for k in range(len(steps) - i))
    return adv


@given(st.integers(1, 4), st.integers(2, 9), st.floats(0, 1), st.floats(0, 1), st.integers(0, 999))
@settings(max_examples=60, deadline=None)
def test_gae_equals_brute_force(batch, T, gamma, lam, seed):
    g = torch.Generator().manual_seed(seed)
    rewards, values = torch.randn(batch, T, generator=g), torch.randn(batch, T, generator=g)
    mask = torch.zeros(batch, T)
    for b in range(batch):  # one contiguous run of actions per row, as a prompt + completion
        start = int(torch.randint(T, (1,), generator=g))
        end = start + 1 + int(torch.randint(T - start, (1,), generator=g))
        mask[b, start:end] = 1
    adv, ret = ppo.gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv, brute_force_gae(rewards, values, mask, gamma, lam),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret, (adv + values) * mask)


def test_gae_with_lambda_one_is_reward_to_go_minus_value():
    rewards, values = torch.tensor([[0.0, 1.0, 2.0, 3.0]]), torch.tensor([[0.5, 0.1, 0.2, 0.3]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    adv, ret = ppo.gae(rewards, values, mask, 1.0, 1.0)
    torch.testing.assert_close(ret, torch.tensor([[0.0, 6.0, 5.0, 3.0]]))
    torch.testing.assert_close(adv, torch.tensor([[0.0, 5.9, 4.8, 2.7]]))


def test_masked_whiten_matches_the_formula_and_ignores_masked_values():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, -50.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    kept = torch.tensor([1.0, 2.0, 3.0, 4.0])
    want = (kept - kept.mean()) / (kept.var() + ppo.WHITEN_EPS).sqrt()  # unbiased var, as trl
    out = ppo.masked_whiten(x, mask)
    torch.testing.assert_close(out[mask.bool()], want)
    assert (out[~mask.bool()] == 0).all()
    torch.testing.assert_close(ppo.masked_whiten(x, mask, shift_mean=False)[mask.bool()],
                               want + kept.mean())
    with pytest.raises(ValueError, match="at least two"):
        ppo.masked_whiten(x, torch.tensor([[1.0, 0, 0], [0, 0, 0]]))


def test_clipped_objective():
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    old = torch.zeros(1, 4)
    mask = torch.ones(1, 4)
    loss, stats = ppo.policy_loss(old, old, adv, mask, 0.2)  # ratio 1: -mean(A)
    assert loss.item() == pytest.approx(0.0) and stats["clipfrac"] == 0.0
    logp = torch.log(torch.tensor([[1.5, 1.5, 0.5, 0.5]]))  # ratios 1.5, 1.5, 0.5, 0.5
    loss, stats = ppo.policy_loss(logp, old, adv, mask, 0.2)
    # A>0, r=1.5: clipped to 1.2; A<0, r=1.5: 1.5 (pessimistic); A>0, r=0.5: 0.5; A<0, r=0.5: 0.8
    assert loss.item() == pytest.approx(-(1.2 - 1.5 + 0.5 - 0.8) / 4)
    assert stats["clipfrac"] == 0.5
    no_clip, _ = ppo.policy_loss(logp, old, adv, mask, math.inf)
    assert no_clip.item() == pytest.approx(-(1.5 - 1.5 + 0.5 - 0.5) / 4)


def test_clipped_value_loss():
    v, old, ret = torch.tensor([[2.0, 0.0]]), torch.tensor([[0.0, 0.0]]), torch.tensor([[1.0, 1.0]])
    loss, stats = ppo.value_loss(v, old, ret, torch.ones(1, 2), 0.5)
    # v=2 clipped to 0.5: max((2-1)^2, (0.5-1)^2) = 1; v=0: 1
    assert loss.item() == pytest.approx(0.5 * (1 + 1) / 2) and stats["vf_clipfrac"] == 0.0
    loss, stats = ppo.value_loss(torch.tensor([[1.2, 0.0]]), old, ret, torch.ones(1, 2), 0.5)
    assert loss.item() == pytest.approx(0.5 * (0.25 + 1) / 2) and stats["vf_clipfrac"] == 0.5


def test_logprobs_and_entropy_equal_trls():
    from trl.trainer.utils import entropy_from_logits, selective_log_softmax

    model = tiny_model()
    ids = torch.randint(5, task.VOCAB_SIZE, (3, 9))
    logp, entropy, logits = ppo.logprobs_and_entropy(model, ids)
    torch.testing.assert_close(logp, selective_log_softmax(logits, ids[:, 1:]))
    torch.testing.assert_close(entropy, entropy_from_logits(logits))


def test_trl_ships_no_ppo_trainer():
    """trl 1.x removed PPOTrainer: nothing to compare GAE or the PPO losses against. If a later
    trl brings one back, this fails and the chapter should compare with it."""
    import trl

    assert not hasattr(trl, "PPOTrainer")
    assert importlib.util.find_spec("trl.trainer.ppo_trainer") is None
    assert importlib.util.find_spec("trl.experimental.ppo") is None


def test_explained_variance():
    y = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    m = torch.ones(1, 4)
    assert ppo.explained_variance(y, y, m) == 1.0
    assert ppo.explained_variance(torch.full_like(y, 2.5), y, m) == pytest.approx(0.0)


def test_bad_inputs():
    with pytest.raises(ValueError, match="one \\(batch, time\\) shape"):
        ppo.gae(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), 1.0, 1.0)
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        ppo.gae(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), 1.5, 1.0)
    with pytest.raises(ValueError, match="kl_estimator"):
        ppo.PPOConfig(kl_estimator="k5")
    with pytest.raises(ValueError, match="minibatch_size"):
        ppo.PPOConfig(batch_size=8, minibatch_size=16)
    with pytest.raises(ValueError, match="lr must be a positive"):
        ppo.PPOConfig(lr=0)
    with pytest.raises(ValueError, match="no field"):
        ppo.PPOConfig().with_(learning_rate=1)
    model = tiny_model()
    with pytest.raises(ValueError, match="must be a RewardModel or a function"):
        ppo.run(model, model, TOK, task.make_problems(8))
    rm = reward.RewardModel(model)
    with pytest.raises(ValueError, match="fewer than batch_size"):
        ppo.run(model, rm, TOK, task.make_problems(8), ppo.PPOConfig(batch_size=16,
                                                                     minibatch_size=8))


# ---- short runs ---------------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_a_short_run_starts_at_the_reference_and_records_every_metric():
    policy = base.base_model()
    rm = reward.RewardModel(base.base_model())
    cfg = ppo.PPOConfig(rounds=2, batch_size=16, minibatch_size=8, ppo_epochs=2, lr=1e-4)
    out = ppo.run(policy, rm, TOK, task.make_problems(64), cfg)
    first, second = out.history
    assert first["kl_exact"] == 0.0 and first["kl_k1"] == 0.0 and first["kl_k3"] == 0.0
    assert first["approx_kl"] > 0 and second["kl_exact"] > 0  # the policy moved
    for key in ("score", "gold", "accuracy", "entropy", "clipfrac", "approx_kl", "pg_loss",
                "vf_loss", "explained_variance", "eos_rate"):
        assert math.isfinite(second[key]), key
    assert out.series("round") == [0, 1]


# ---- the command ------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, words", [
    (["--variants", "baseline,fastest"], "unknown variant 'fastest'"),
    (["--variants", ","], "unknown variant '(none)'"),
    (["--rounds", "0"], "must be >= 1"),
    (["--kl-coef", "-1"], "--kl-coef must be >= 0"),
    (["--batch-size", "8", "--minibatch-size", "16"], "must not be larger than --batch-size"),
    (["--reward", "/nonexistent"], "holds no rm-reward.json"),
    (["--workers", "100"], "at most 64"),
])
def test_ppo_command_rejects_bad_input(argv, words, capsys, tmp_path):
    from trainbook.__main__ import main

    try:
        code = main(["ppo", "--out", str(tmp_path / "out"), *argv])
    except SystemExit as e:  # argparse's own checks exit
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error:") and words in err[0]
    assert not (tmp_path / "out").exists()


# ---- the stored runs (book/alignment/data/ppo-runs.json) ---------------------------------------

DATA = Path(__file__).resolve().parents[1] / "book" / "alignment" / "data"


def test_stored_runs_are_the_codes_variants_on_the_dpo_budget():
    from trainbook.align import dpo_study, ppo_study, reward_study, start

    rec = ppo_study.read_runs(DATA)
    assert set(rec["runs"]) == set(ppo_study.VARIANTS)
    assert rec["start_sha256"] == start.start_record(DATA)["sha256"]
    assert rec["reward_model_sha256"] == reward_study.reward_record(DATA)["sha256"]
    study = dpo_study.read_study(DATA / "dpo-study.json")
    for name, run in rec["runs"].items():
        cfg = ppo_study.config(name)
        assert run["config"] == ppo_study._plain(dataclasses.asdict(cfg)), name
        assert cfg.rounds * cfg.batch_size == ppo_study.BUDGET == study["generated"]
        assert run["pass1"][0] == {"round": 0, "pass1": study["pass1_start"]}
        h = run["history"]
        assert [x["round"] for x in h] == list(range(len(h)))
        assert len(h) == cfg.rounds or h[-1]["diverged"], name
        assert h[0]["kl_exact"] == h[0]["kl_k1"] == h[0]["kl_k3"] == 0.0  # before any update


@pytest.mark.records
@pytest.mark.timeout(300)
def test_stored_baseline_first_round_is_reproduced():
    """Re-run the stored baseline's first round (its rollouts and its update) and compare."""
    from trainbook.align import ppo_study, reward_study, start

    stored = ppo_study.read_runs(DATA)["runs"]["baseline"]["history"][0]
    torch.set_num_threads(1)
    model = start.load_start(DATA)
    rm = reward_study.load_reward_model(DATA, DATA)
    items = task.make_problems(ppo_study.TRAIN["items"], seed=ppo_study.TRAIN["seed"])
    got = ppo.run(model, rm, TOK, items, ppo_study.BASE.with_(rounds=1)).history[0]
    for key in ("score", "gold", "accuracy", "entropy", "length", "eos_rate", "pg_loss",
                "vf_loss", "clipfrac"):
        assert got[key] == pytest.approx(stored[key], rel=1e-4, abs=1e-5), key
