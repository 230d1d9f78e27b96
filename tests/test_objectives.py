"""Masked and denoising objectives: BERT masking, T5 span corruption and its lengths, prefix LM,
UL2, the attention masks, and the trainer's --objective (one process and DDP)."""

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from trainbook import configs, launch
from trainbook.model import Transformer
from trainbook.pretrain import objectives as O
from trainbook.train import TrainConfig, layout_for, loop, model_config, train
from trainbook.train import config as train_config
from trainbook.train import objective as TO


def tiny(cache_dir, **kw):
    base = dict(model="tiny-llama", d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64,
                tokenizer="bytes", seq_len=32, batch_size=8, steps=12, warmup_steps=2, lr=3e-3,
                log_every=0, progress=False, eval_batches=2, cache_dir=cache_dir)
    base.update(kw)
    return TrainConfig(**base)


# --- T5's lengths, against values published by T5 and ByT5 -------------------------------------

@pytest.mark.parametrize("args, expected", [
    ((512, 0.15, 3.0), (568, 114)),  # T5's log line; t5x's {'inputs': 512, 'targets': 114}
    ((64, 0.20, 2.0), (70, 22)),  # t5/data/preprocessors_test.py test_random_spans_helper
    ((64, 0.20, 1.0), (63, 27)),  # the same test's second case
])
def test_span_corruption_lengths_match_t5(args, expected):
    assert O.span_corruption_lengths(*args) == expected


def test_span_corruption_lengths_byt5_and_the_half_density_hack():
    # ByT5 pretrains with mean_noise_span_length 20 and {'inputs': 1024, 'targets': 189}
    assert O.span_corruption_lengths(1024, 0.15, 20.0)[1] == 189
    raw, targets = O.span_corruption_lengths(512, 0.5, 3.0)
    assert targets == 512  # T5 trims one raw token so targets are no longer than the inputs


def test_span_corruption_lengths_fill_the_inputs_exactly():
    for n in (128, 512, 1024):
        raw, targets = O.span_corruption_lengths(n)
        noise = round(raw * 0.15)
        spans = round(noise / 3)
        assert raw - noise + spans + 1 == n and noise + spans + 1 == targets


def test_library_defaults_the_chapter_quotes():
    from transformers import DataCollatorForLanguageModeling as Collator
    p = {k: v.default for k, v in __import__("inspect").signature(Collator).parameters.items()}
    assert (p["mlm_probability"], p["mask_replace_prob"], p["random_replace_prob"]) == \
        (0.15, 0.8, 0.1)
    assert (TO.MLM_PROB, TO.NOISE_DENSITY, TO.MEAN_SPAN) == (0.15, 0.15, 3.0)


# --- T5's noise mask and sentinels --------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(st.integers(2, 300), st.floats(0.05, 0.6), st.floats(1.0, 12.0), st.integers(0, 10**6))
def test_noise_mask_has_t5s_exact_counts(length, density, mean, seed):
    mask = TO.random_spans_noise_mask(length, density, mean, torch.Generator().manual_seed(seed))
    noise, spans = TO.noise_counts(length, density, mean)
    starts = mask & ~torch.cat([torch.tensor([False]), mask[:-1]])
    assert mask.shape == (length,) and int(mask.sum()) == noise and int(starts.sum()) == spans
    assert not mask[0] and mask[-1]  # non-noise first; the last span is noise


def test_noise_mask_matches_t5s_own_test_counts_and_is_uniform():
    g = torch.Generator().manual_seed(0)
    mask = TO.random_spans_noise_mask(32, 0.25, 2.0, g)  # T5's test: 4 spans, 8 noise tokens
    starts = mask & ~torch.cat([mask[:1] & False, mask[:-1]])
    assert int(mask.sum()) == 8 and int(starts.sum()) == 4
    # all partitions equally likely: the first noise span of 8 tokens in 4 spans has length j
    # with probability C(8 - j - 1, 2) / C(7, 3)
    n, firsts = 1000, torch.zeros(6)
    for _ in range(n):
        m = TO.random_spans_noise_mask(32, 0.25, 2.0, g).long()
        start = int(m.argmax())
        firsts[int((m[start:].cumprod(0)).sum()) - 1] += 1
    expect = torch.tensor([math.comb(8 - j - 1, 2) / math.comb(7, 3) for j in range(1, 7)])
    sd = (expect * (1 - expect) / n).sqrt()
    assert ((firsts / n - expect).abs() <= 4 * sd + 1e-9).all()
    # without T5's random_roll the ends are fixed: the first token never noise, the last always
    freq = sum(TO.random_spans_noise_mask(32, 0.25, 2.0, g).float() for _ in range(300)) / 300
    assert freq[0] == 0 and freq[-1] == 1 and freq.sum() == pytest.approx(8)


@settings(max_examples=40, deadline=None)
@given(st.integers(4, 200), st.integers(0, 10**6))
def test_span_corrupt_round_trips_and_counts_sentinels_down(length, seed):
    V = 1000
    tokens = torch.randint(0, 500, (length,), generator=torch.Generator().manual_seed(seed))
    mask = TO.random_spans_noise_mask(length, 0.15, 3.0, torch.Generator().manual_seed(seed))
    inputs, targets = TO.span_corrupt(tokens, mask, V)
    noise, spans = TO.noise_counts(length, 0.15, 3.0)
    assert len(inputs) == length - noise + spans and len(targets) == noise + spans
    sentinels = [V - 1 - i for i in range(spans)]
    assert inputs[inputs >= 500].tolist() == sentinels == targets[targets >= 500].tolist()
    # put the targets' spans back where the inputs' sentinels are: the original sequence
    pieces = {}
    for s in sentinels:
        k = (targets == s).nonzero().item()
        end = [i for i in range(k + 1, len(targets)) if targets[i] >= 500]
        pieces[s] = targets[k + 1:end[0] if end else len(targets)]
    rebuilt = torch.cat([pieces[int(t)] if t >= 500 else t[None] for t in inputs])
    assert torch.equal(rebuilt, tokens)


def test_batched_masks_and_corruption_match_row_by_row():
    g = torch.Generator().manual_seed(3)
    masks = TO.random_spans_noise_mask(100, 0.15, 3.0, g, batch=8)
    noise, spans = TO.noise_counts(100, 0.15, 3.0)
    assert masks.shape == (8, 100) and (masks.sum(1) == noise).all()
    assert len({tuple(m.tolist()) for m in masks}) == 8  # independent rows
    tokens = torch.randint(0, 200, (8, 100))
    inputs, targets = TO.span_corrupt(tokens, masks, 300)
    for r in range(8):
        i, t = TO.span_corrupt(tokens[r], masks[r], 300)
        assert torch.equal(inputs[r], i) and torch.equal(targets[r], t)
    uneven = masks[:2].clone()
    uneven[1] = False
    uneven[1, -1] = True
    with pytest.raises(ValueError, match="differ in their noise counts"):
        TO.span_corrupt(tokens[:2], uneven, 300)
    with pytest.raises(ValueError, match="batch must be >= 1"):
        TO.random_spans_noise_mask(10, batch=0)


def test_span_inputs_and_targets_for_the_trainer_fill_the_row():
    raw, n_in, n_tgt = TO.decoder_span_length(129)
    assert n_in + n_tgt <= 129 and TO.decoder_span_length(130)[0] >= raw
    assert TO.special_tokens("span", 128) == TO.noise_counts(raw, 0.15, 3.0)[1]
    assert (TO.special_tokens("clm", 128), TO.special_tokens("mlm", 128),
            TO.special_tokens("prefix", 128)) == (0, 1, 0)


# --- BERT masking -------------------------------------------------------------------------------

def test_bert_mask_statistics_and_huggingface_agree():
    B, T, V = 64, 200, 300
    tokens = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))
    chosen, kinds = 0, torch.zeros(3)
    for seed in range(10):
        inputs, labels = TO.bert_mask(tokens, V, V, generator=torch.Generator().manual_seed(seed))
        sel = labels != -100
        assert (sel.sum(1) == round(T * 0.15)).all()  # BERT: a fixed count per sequence
        assert torch.equal(labels[sel], tokens[sel]) and torch.equal(inputs[~sel], tokens[~sel])
        kinds += torch.tensor([(inputs[sel] == V).sum(), (inputs[sel] == tokens[sel]).sum(),
                               ((inputs[sel] != V) & (inputs[sel] != tokens[sel])).sum()])
        chosen += int(sel.sum())
    # [MASK] 0.8; unchanged 0.1 plus random draws that hit the same id (1 / V of 0.1)
    expect = torch.tensor([0.8, 0.1 + 0.1 / V, 0.1 - 0.1 / V])
    sd = (expect * (1 - expect) / chosen).sqrt()
    assert ((kinds / chosen - expect).abs() < 4 * sd).all()
    # Hugging Face's collator: Bernoulli(0.15) per token, the same 80/10/10 split
    from tokenizers import Tokenizer, models
    from transformers import DataCollatorForLanguageModeling, PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(V)} | {"[MASK]": V, "[PAD]": V + 1}
    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, "t0")),
                                 mask_token="[MASK]", pad_token="[PAD]")
    collator = DataCollatorForLanguageModeling(hf, seed=0)
    inputs, labels = collator.torch_mask_tokens(tokens.clone())
    sel = labels != -100
    assert float(sel.float().mean()) == pytest.approx(0.15, abs=4 * math.sqrt(.15 * .85 / B / T))
    assert float((inputs[sel] == V).float().mean()) == pytest.approx(0.8, abs=0.03)
    assert sel.sum(1).float().std() > 1  # its per-sequence count varies; BERT's does not


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="at least 2 tokens"):
        TO.random_spans_noise_mask(1)
    with pytest.raises(ValueError, match="0 < noise_density < 1"):
        TO.noise_counts(10, 1.5, 3)
    with pytest.raises(ValueError, match="same 1-d or 2-d shape"):
        TO.span_corrupt(torch.arange(4), torch.zeros(5, dtype=torch.bool), 10)
    with pytest.raises(ValueError, match="batch, time"):
        TO.bert_mask(torch.arange(4), 9, 10)
    with pytest.raises(ValueError, match="0 < noise_density <= 0.5"):
        TO.prefix_lengths(4, 10, 0.7)
    with pytest.raises(ValueError, match="objective must be one of"):
        TO.prepare_model(torch.nn.Linear(2, 2), "electra")
    with pytest.raises(ValueError, match="inputs_length >= 2"):
        O.span_corruption_lengths(1)
    with pytest.raises(ValueError, match="mode in"):
        O.ul2_example(torch.arange(10), O.Denoiser("Q", 3, 0.15), 300)
    with pytest.raises(ValueError, match="kind must be causal"):
        O.attention_pattern("sideways", 4)


# --- prefix LM and the attention masks ----------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(st.integers(1, 33), st.integers(2, 200), st.integers(0, 10**6))
def test_prefix_splits_are_t5s_range_and_fix_the_loss_count(batch, length, seed):
    P = TO.prefix_lengths(batch, length, generator=torch.Generator().manual_seed(seed))
    assert ((P >= 1) & (P <= length - 1)).all()
    assert int((length - P).sum()) == (batch // 2) * length + (batch % 2) * (length - length // 2)


def test_prefix_split_is_uniform_per_row():
    P = TO.prefix_lengths(20000, 11, generator=torch.Generator().manual_seed(0))
    for half in (P[0::2], P[1::2]):  # the drawn rows and the mirrored rows
        counts = torch.bincount(half, minlength=11)[1:].float()
        assert (counts / len(half) - 0.1).abs().max() < 0.015


def test_attention_masks_from_targets():
    y = torch.tensor([[-100, -100, 5, 6], [1, 2, 3, 4], [7, -100, -100, 8]])
    m = TO.attention_mask(y, "prefix")[:, 0]
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    assert torch.equal(m[0], causal | (torch.arange(4) < 3))  # prefix of 3 positions
    assert torch.equal(m[1], causal) and torch.equal(m[2], causal)  # first target has loss
    b = TO.attention_mask(y, "bidirectional")[:, 0]
    assert b[0].all() and torch.equal(b[1], causal) and b[2].all()
    assert TO.attention_mask(torch.ones(2, 4, dtype=torch.long), "prefix") is None
    assert torch.equal(O.attention_pattern("prefix", 4, 3), m[0])
    assert torch.equal(O.attention_pattern("prefix", 4, 1), causal)
    assert O.attention_pattern("bidirectional", 4).all()


def test_masked_core_matches_explicit_attention_and_respects_softmax_scale():
    cfg = configs.resolve("tiny-llama").with_(d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                                              d_ff=64, vocab_size=50, max_seq_len=8)
    torch.manual_seed(0)
    model = Transformer(cfg)
    plain = Transformer(cfg)
    plain.load_state_dict(model.state_dict())
    TO.prepare_model(model, "prefix")
    x = torch.randint(0, 50, (2, 8))
    y_plain = torch.randint(0, 50, (2, 8))
    assert torch.equal(model(x, y_plain)[0], plain(x, y_plain)[0])  # no -100: causal, exactly
    y = y_plain.clone()
    y[:, :4] = -100  # prefix of 5 positions
    attn = model.blocks[0].attn
    attn.softmax_scale = 0.3
    q, k, v = (torch.randn(2, 4, 8, 8) for _ in range(3))
    k, v = k[:, :2], v[:, :2]
    model(x, y)  # sets the mask for the batch
    allowed = torch.ones(8, 8, dtype=torch.bool).tril() | (torch.arange(8) < 5)
    scores = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * 0.3
    ref = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v.repeat_interleave(2, 1)
    torch.testing.assert_close(attn.core(q, k, v), ref)
    with pytest.raises(ValueError, match="already prepared"):
        TO.prepare_model(model, "mlm")


def test_bidirectional_model_sees_the_future_and_causal_does_not():
    cfg = configs.resolve("tiny-llama").with_(d_model=32, n_layers=2, n_heads=2, n_kv_heads=2,
                                              d_ff=64, vocab_size=50, max_seq_len=8)
    model = Transformer(cfg)
    TO.prepare_model(model, "mlm")
    x = torch.randint(0, 49, (1, 8))
    x2 = x.clone()
    x2[0, -1] = (x[0, -1] + 1) % 49
    y = torch.full_like(x, -100)
    y[0, 2] = 3
    assert not torch.allclose(model(x, y)[0][0, 0], model(x2, y)[0][0, 0])  # sees position 7
    assert torch.equal(model(x)[0][0, 0], model(x2)[0][0, 0])  # no targets: causal


# --- the trainer's batches ----------------------------------------------------------------------

@pytest.mark.parametrize("objective, per_row", [("mlm", 19), ("span", 24), ("prefix", 64.5)])
def test_objective_batches_have_a_fixed_loss_count(objective, per_row):
    T, V = 128, 256 + TO.special_tokens(objective, 128)
    block = torch.randint(0, 256, (3, 16, T + 1))
    batches = [(b[:, :-1], b[:, 1:]) for b in block]
    out = TO.objective_batches(objective, batches, V, (0, 0, 7))
    for x, y in out:
        assert x.shape == y.shape == (16, T)
        assert (y != -100).sum() / 16 == per_row  # same in every micro-batch: means are exact
        assert x.max() < V and y.max() < V
    again = TO.objective_batches(objective, batches, V, (0, 0, 7))
    other_rank = TO.objective_batches(objective, batches, V, (0, 1, 7))
    assert all(torch.equal(a[1], b[1]) for a, b in zip(out, again))  # resumable: seeded
    assert not all(torch.equal(a[1], b[1]) for a, b in zip(out, other_rank))


def test_clm_batches_are_passed_through_untouched():
    batches = [(torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.long))]
    assert TO.objective_batches("clm", batches, 256) is batches
    assert set(TO.ATTENTION) == set(train_config.OBJECTIVES)


# --- the trainer ----------------------------------------------------------------------------------

def test_clm_is_bit_identical_with_the_objective_machinery_bypassed(cache_dir, monkeypatch):
    cfg = TrainConfig(steps=3, warmup_steps=1, log_every=0, progress=False, eval_batches=1,
                      cache_dir=cache_dir, batch_size=2)  # the default model, data and lr
    with_hooks = train(cfg)
    monkeypatch.setattr(loop, "objective_batches", lambda objective, batches, *a: batches)
    monkeypatch.setattr(loop, "prepare_model", lambda model, objective: None)
    without = train(cfg)
    assert with_hooks.losses() == without.losses() and with_hooks.val_loss == without.val_loss
    assert model_config(cfg, 1024).vocab_size == 1024


@pytest.mark.parametrize("objective", ["mlm", "span", "prefix"])
def test_trainer_trains_each_objective(cache_dir, objective):
    r = train(tiny(cache_dir, objective=objective, steps=30, grad_accum=2, batch_size=4))
    losses = r.losses()
    assert r.model_config.vocab_size == 256 + TO.special_tokens(objective, 32)
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5
    assert math.isfinite(r.val_loss)  # next-token loss under causal attention, for every objective


def test_objective_run_resumes_bit_for_bit(cache_dir, tmp_path):
    full = train(tiny(cache_dir, objective="mlm", ckpt_dir=str(tmp_path / "full")))
    part = tiny(cache_dir, objective="mlm", ckpt_dir=str(tmp_path / "part"), stop_after=5)
    train(part)
    resumed = train(dataclasses.replace(part, stop_after=None, resume=True))
    assert resumed.losses() == full.losses()


def test_composed_layouts_refuse_other_objectives(cache_dir):
    cfg = tiny(cache_dir, objective="span", dp_shard=2)
    with pytest.raises(ValueError, match="one process and DDP only"):
        layout_for(cfg, 2, model_config(cfg, 256))
    layout_for(dataclasses.replace(cfg, objective="clm"), 2, model_config(cfg, 256))


def test_ddp_trains_a_masked_objective(cache_dir, tmp_path):
    out = tmp_path / "ddp.json"
    args = ["train", "--objective", "mlm", "--model", "tiny-llama", "--d-model", "32",
            "--n-layers", "2", "--n-heads", "2", "--n-kv-heads", "1", "--d-ff", "64",
            "--tokenizer", "bytes", "--seq-len", "32", "--batch-size", "4", "--steps", "6",
            "--warmup-steps", "1", "--eval-batches", "2", "--timeout-s", "60",
            "--cache-dir", cache_dir, "--no-progress", "--log-every", "0",
            "--json-out", str(out)]
    launch.torchrun(args, 2, timeout_s=180)
    record = json.loads(out.read_text())
    assert record["world_size"] == 2 and record["model_config"]["vocab_size"] == 257
    assert all(math.isfinite(r["loss"]) for r in record["history"])


# --- UL2 and the chapter's measures -------------------------------------------------------------

def test_ul2_examples():
    V = 300
    ids = O.ul2_ids(V)
    assert set(ids) == {"[R]", "[S]", "[X]"} and min(ids.values()) == V - 3
    tokens = torch.randint(0, 200, (120,))
    g = torch.Generator().manual_seed(0)
    for d in O.UL2_DENOISERS:
        inputs, targets = O.ul2_example(tokens, d, V, g)
        assert inputs[0] == ids[f"[{d.mode}]"]
        if d.mode == "S":
            assert torch.equal(torch.cat([inputs[1:], targets]), tokens)
            assert 1 <= len(targets) <= 60  # density 0.25: the split is in the second half
        else:
            noise, spans = TO.noise_counts(120, d.rate, d.mean_span)
            assert len(targets) == noise + spans and targets.max() == V - 4
    assert [d.mode for d in O.UL2_DENOISERS].count("X") == 4


def test_scores_on_common_ground(cache_dir):
    r = train(tiny(cache_dir, steps=2))
    val = torch.randint(0, 256, (4, 33))
    both = O.score_bits(r.model, "clm", val, 10, 3, 19)
    assert both == O.score_bits(r.model, "clm", val, 10, 3, 0)  # a causal model cannot look right
    assert 6 < both < 10  # an untrained byte model: about log2(256) = 8 bits
    with torch.no_grad():
        logits, _ = r.model(val[:, :12])
    manual = F.cross_entropy(logits[:, 9:12].transpose(1, 2), val[:, 10:13]) / math.log(2)
    assert both == pytest.approx(float(manual), rel=1e-5)
    with pytest.raises(ValueError, match="must fit"):
        O.score_bits(r.model, "span", val, 20, 10, 5)
    m = train(tiny(cache_dir, steps=2, objective="mlm"))
    assert math.isfinite(O.score_bits(m.model, "mlm", val, 10, 3, 19))
    assert O.loss_tokens("prefix", torch.randint(0, 256, (6, 33)), 256) == 16.5
