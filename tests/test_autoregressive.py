"""Autoregressive modelling measurements (trainbook.pretrain.autoregressive): the reference model is
exactly causal and the check catches leaky cores; the explicit attention core equals SDPA; n-gram
entropies and distances on known distributions; induction heads form on periodic data and look
tokens up by content, while a fixed period trains a positional copy instead; free-running
generation is worse than teacher forcing on the trained model."""

import math

import pandas as pd
import pytest
import torch
from torch import nn

from trainbook import configs, data
from trainbook.launch import threads
from trainbook.model import Transformer, lm_loss
from trainbook.pretrain import autoregressive as ar
from trainbook.train import TrainConfig, train


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: one thread is as fast, and does not fight other processes for the cores."""
    with threads(1):
        yield


def _model(name: str = "tiny-llama", seq: int = 16) -> Transformer:
    torch.manual_seed(0)
    return Transformer(configs.get(name).with_(max_seq_len=seq)).eval()


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_reference_model_is_exactly_causal_and_leaky_cores_are_caught(name):
    model = _model(name)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, model.cfg.vocab_size, (2, 16), generator=g)
    before, after = ar.future_leak(model, idx)
    assert before.max().item() == 0.0 and (after > 0).all()
    for lookahead in (None, 1, 3):
        with ar.patched_cores(model, lookahead):
            before, _ = ar.future_leak(model, idx)
        assert (before[1:] > 0).all(), lookahead  # every position leaks into earlier ones
    with ar.patched_cores(model, 0):
        assert ar.future_leak(model, idx)[0].max().item() == 0.0


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_explicit_core_equals_sdpa_and_records_weights(name):
    model = _model(name)  # tiny-llama has grouped-query attention (4 q heads, 2 kv heads)
    idx = torch.randint(0, model.cfg.vocab_size, (3, 16))
    store: list[torch.Tensor] = []
    with torch.no_grad():
        want = model(idx)[0]
        with ar.patched_cores(model, 0, store):
            got = model(idx)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert len(store) == model.cfg.n_layers
    for w in store:
        assert w.shape == (3, model.cfg.n_heads, 16, 16)
        torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[:-1]))
        assert (w.triu(1) == 0).all()  # no weight on the future


def test_patched_cores_restore_the_model_core_even_on_error():
    model = _model()
    with pytest.raises(RuntimeError), ar.patched_cores(model, None):
        raise RuntimeError("boom")
    assert all("core" not in b.attn.__dict__ for b in model.blocks)


def test_conditional_entropies_of_known_streams():
    cycle = torch.tensor([0, 1, 2] * 400)
    h = ar.conditional_entropies(cycle, 3, max_n=3)
    assert h[0] == pytest.approx(math.log(3), rel=1e-6)
    # 0 but for the stream's ends (1200 tokens: one pair and one triple fewer)
    assert h[1] == pytest.approx(0.0, abs=1e-5) and h[2] == pytest.approx(0.0, abs=1e-5)
    iid = torch.randint(0, 4, (200_000,), generator=torch.Generator().manual_seed(0))
    h = ar.conditional_entropies(iid, 4, max_n=2)
    assert h[0] == pytest.approx(math.log(4), abs=1e-3)
    assert h[1] == pytest.approx(math.log(4), abs=1e-3)


def test_ngram_tables_and_distance():
    tokens = torch.randint(0, 8, (5000,), generator=torch.Generator().manual_seed(0))
    uni, big = ar.ngram_tables(tokens, 10)  # tokens 8 and 9 never occur
    assert uni.sum().item() == pytest.approx(1.0) and uni[8:].sum() == 0
    assert torch.allclose(big[:8].sum(1), torch.ones(8, dtype=big.dtype))
    assert (big[8:] == 0).all()

    class Unigram(nn.Module):  # predicts the unigram distribution whatever the context
        def forward(self, x):
            return (uni.clamp_min(1e-12).log().float().expand(*x.shape, 10), None)

    x, y = tokens[:-1].view(1, -1), tokens[1:].view(1, -1)
    d = ar.ngram_distance(Unigram(), x, y, uni, big)
    assert d["kl_unigram"] == pytest.approx(0.0, abs=1e-5)
    assert d["kl_bigram"] > 0 and d["loss"] == pytest.approx(
        ar.conditional_entropies(tokens, 10, 1)[0], rel=1e-3)


def test_checkpoint_trajectory_reads_the_trainers_checkpoints(tmp_path):
    cfg = TrainConfig(tokenizer="bytes", d_model=32, n_layers=1, n_heads=2, n_kv_heads=2,
                      d_ff=64, seq_len=32, batch_size=4, steps=4, warmup_steps=1, device="cpu",
                      progress=False, log_every=0, ckpt_dir=str(tmp_path), ckpt_every=2)
    res = train(cfg)
    ds = data.build_dataset(data.ByteTokenizer(), 32)
    stream = ds.train[:, 1:].flatten()
    uni, big = ar.ngram_tables(stream, 256)
    traj = ar.checkpoint_trajectory(tmp_path, ds.val[:4, :-1], ds.val[:4, 1:], uni, big)
    assert traj.step.tolist() == [2, 4]
    final = lm_loss(res.model(ds.val[:4, :-1])[0], ds.val[:4, 1:]).item()
    assert traj.loss.iloc[-1] == pytest.approx(final, rel=1e-5)
    with pytest.raises(ValueError, match="no checkpoints"):
        ar.checkpoint_trajectory(tmp_path / "empty", ds.val[:1, :-1], ds.val[:1, 1:], uni, big)


def test_loss_by_position_averages_to_the_loss():
    model = _model(seq=32)
    blocks = torch.randint(0, model.cfg.vocab_size, (10, 33))
    by_pos = ar.loss_by_position(model, blocks, batch_size=3)
    assert by_pos.shape == (32,)
    whole = lm_loss(model(blocks[:, :-1])[0], blocks[:, 1:]).item()
    assert by_pos.mean().item() == pytest.approx(whole, rel=1e-5)


def test_train_steps_learns_and_a_leak_learns_too_fast():
    ds = data.build_dataset(data.ByteTokenizer(), 32)
    losses = {}
    for lookahead in (0, 1):
        torch.manual_seed(0)
        m = Transformer(configs.get("tiny-llama").with_(vocab_size=256, d_model=32, n_heads=2,
                                                        n_kv_heads=2, d_ff=64, n_layers=2,
                                                        max_seq_len=32))
        with ar.patched_cores(m, lookahead):
            losses[lookahead] = ar.train_steps(m, ds.train, 60, 16, 3e-3,
                                               torch.Generator().manual_seed(0))
    assert len(losses[0]) == 60 and losses[0][-1] < losses[0][0] - 1.5
    assert sum(losses[1][-5:]) < sum(losses[0][-5:]) - 2.5  # the leak reads the answer


def test_synthetic_sequences():
    g = torch.Generator().manual_seed(0)
    x = ar.repeated_tokens(5, 7, 20, g)
    assert x.shape == (5, 14) and (x[:, :7] == x[:, 7:]).all()
    p = ar.periodic_tokens(50, 40, 30, 3, 9, g)
    assert p.shape == (50, 40)
    for row in p:  # each row repeats with some period in [3, 9]
        assert any((row[L:] == row[:-L]).all() for L in range(3, 10))


def test_head_scores_on_hand_made_patterns():
    half, T = 6, 11  # inputs of 2 * half - 1 tokens
    prev = torch.zeros(1, 1, T, T)
    prev[0, 0, 0, 0] = 1
    prev[0, 0, torch.arange(1, T), torch.arange(0, T - 1)] = 1
    prefix = torch.zeros(1, 1, T, T)
    prefix[0, 0, torch.arange(T), torch.arange(T)] = 1
    j = torch.arange(half, T)
    prefix[0, 0, j] = 0
    prefix[0, 0, j, j - half + 1] = 1
    s = ar.head_scores([prev, prefix], half)
    assert s["previous"][0, 0] == 1 and s["prefix"][1, 0] == 1
    assert s["prefix"][0, 0] == 0 and s["previous"][1, 0] < 1


@pytest.fixture(scope="module")
def induction():
    return ar.train_induction(ar.InductionConfig())


def test_induction_heads_form_with_a_phase_change(induction):
    phase = induction.phase_change()
    assert phase is not None and phase["start"] < phase["mid"] < phase["end"]
    assert phase["end"] - phase["start"] < phase["start"]
    h = induction.history
    assert h.prefix.iloc[0] < 0.1 and h.prefix.iloc[-1] > 0.5
    assert h.previous.iloc[-1] > 2 * h.previous.iloc[0]
    g = torch.Generator().manual_seed(0)
    for length, offset in [(20, 5), (16, 30)]:  # the repeat elsewhere: still predicted
        assert ar.shifted_repeat_loss(induction.model, length, offset, 64, 128, g) < 2.0


def test_a_fixed_period_trains_a_positional_copy_not_an_induction_head():
    run = ar.train_induction(ar.InductionConfig(min_period=32))  # every sequence period 32
    g = torch.Generator().manual_seed(0)
    assert run.history.loss_repeat.iloc[-1] < 1.0  # the fixed probe is solved ...
    lnv = math.log(run.config.vocab)
    assert ar.shifted_repeat_loss(run.model, 20, 5, 64, 128, g) > 0.8 * lnv  # ... by position


def test_free_running_is_worse_than_teacher_forcing(induction):
    g = torch.Generator().manual_seed(1)
    x = ar.repeated_tokens(128, 32, 64, g)
    for greedy in (False, True):
        df = ar.teacher_forced_vs_free(induction.model, x, 32, 8, g, greedy)
        assert df.position.tolist() == list(range(8, 32))
        assert df.free_loss.mean() > 3 * df.tf_loss.mean()
        assert df.free_correct.iloc[-4:].mean() < df.tf_correct.iloc[-4:].mean()
        assert df.free_correct.iloc[0] == pytest.approx(df.tf_correct.iloc[0], abs=0.15)


def test_no_phase_change_is_reported_as_none():
    cfg = ar.InductionConfig()
    flat = pd.DataFrame({"step": [0, 10, 20], "loss_first": [4.1] * 3,
                         "loss_repeat": [4.16, 4.1, 4.0], "previous": [0.06] * 3,
                         "prefix": [0.02] * 3})
    assert ar.InductionRun(cfg, None, flat, None, []).phase_change() is None


@pytest.mark.parametrize("call,match", [
    (lambda: ar.attention_core(1.0, lookahead=-1), "lookahead must be >= 0"),
    (lambda: ar.future_leak(_model(), torch.zeros(2, 1, dtype=torch.long)), "time >= 2"),
    (lambda: ar.conditional_entropies(torch.zeros(3, dtype=torch.long), 2, 3), "longer than"),
    (lambda: ar.conditional_entropies(torch.zeros(99, dtype=torch.long), 2**20, 4), "2\\*\\*62"),
    (lambda: ar.ngram_tables(torch.zeros(1, dtype=torch.long), 2), "at least 2"),
    (lambda: ar.loss_by_position(_model(), torch.zeros(2, 1, dtype=torch.long)), "blocks"),
    (lambda: ar.train_steps(_model(), torch.zeros(4, 9, dtype=torch.long), 0), "steps"),
    (lambda: ar.InductionConfig(steps=0), "steps must be >= 1"),
    (lambda: ar.InductionConfig(min_period=40), "min_period <= half"),
    (lambda: ar.repeated_tokens(2, 4, 1), "vocab >= 2"),
    (lambda: ar.periodic_tokens(2, 8, 4, 5, 3), "min_period <= max_period"),
    (lambda: ar.shifted_repeat_loss(_model(), 10, 0, 16, 2), "must fit"),
    (lambda: ar.teacher_forced_vs_free(_model(), torch.zeros(2, 8, dtype=torch.long), 4, 4),
     "prompt < half"),
])
def test_bad_input_is_rejected(call, match):
    with pytest.raises(ValueError, match=match):
        call()
