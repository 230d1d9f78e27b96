"""The loss from scratch (trainbook.pretrain.loss) against F.cross_entropy and autograd: equal
over shapes, scales, ignored positions and label smoothing (hypothesis), stable where the
textbook softmax overflows; bits per byte and perplexity conversions; and gradient accumulation:
the mean of per-micro-batch means is wrong for variable-length micro-batches, the token-count
normalisation is exact, and the trainer's Plain.step is exact on packed blocks."""

import inspect
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from trainbook import configs, data
from trainbook.model import Transformer, lm_loss
from trainbook.pretrain import loss as L

SETTINGS = settings(max_examples=40, deadline=None)


@st.composite
def logits_and_targets(draw, max_rows=24, max_classes=300):
    n = draw(st.integers(1, max_rows))
    c = draw(st.integers(2, max_classes))
    scale = draw(st.sampled_from([1e-3, 0.1, 1.0, 10.0, 100.0, 1e3, 1e4]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, c, generator=g) * scale
    y = torch.randint(0, c, (n,), generator=g)
    ignored = torch.rand(n, generator=g) < draw(st.sampled_from([0.0, 0.3, 0.9]))
    ignored[0] = False  # at least one counted token ('mean' of none is nan in both)
    return z, y.masked_fill(ignored, L.IGNORE_INDEX), scale


def test_library_defaults_the_chapter_relies_on():
    params = inspect.signature(F.cross_entropy).parameters
    assert params["ignore_index"].default == L.IGNORE_INDEX == -100
    assert params["label_smoothing"].default == 0.0
    assert params["reduction"].default == "mean"
    z, y = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
    y[0, :3] = -100  # the reference model's loss ignores -100 too
    assert torch.allclose(lm_loss(z, y), L.cross_entropy(z, y))


@SETTINGS
@given(logits_and_targets(), st.sampled_from([0.0, 0.1, 0.5, 1.0]),
       st.sampled_from(L.REDUCTIONS))
def test_cross_entropy_equals_torch(case, eps, reduction):
    z, y, scale = case
    ours = L.cross_entropy(z, y, label_smoothing=eps, reduction=reduction)
    theirs = F.cross_entropy(z, y, label_smoothing=eps, reduction=reduction)
    torch.testing.assert_close(ours, theirs, rtol=2e-5, atol=1e-5 * max(1.0, scale))


@SETTINGS
@given(logits_and_targets())
def test_logsumexp_and_log_softmax_equal_torch(case):
    z, _, scale = case
    torch.testing.assert_close(L.logsumexp(z), torch.logsumexp(z, -1), rtol=1e-6,
                               atol=1e-6 * max(1.0, scale))
    torch.testing.assert_close(L.log_softmax(z), F.log_softmax(z, -1), rtol=1e-5,
                               atol=1e-5 * max(1.0, scale))


def test_naive_softmax_overflows_where_the_stable_one_does_not():
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 50, (16,), generator=g)
    base = torch.randn(16, 50, generator=g)
    base = base / base.abs().max()  # largest |logit| exactly 1 before scaling
    limit = math.log(torch.finfo(torch.float32).max)
    for top in (10.0, 80.0, 95.0, 1e4):
        z = base * top
        naive = L.naive_cross_entropy(z, y)
        assert torch.isfinite(naive).item() == (z.max().item() <= limit)  # nan or inf past it
        assert torch.isfinite(L.cross_entropy(z, y))
        torch.testing.assert_close(L.cross_entropy(z, y), F.cross_entropy(z, y), rtol=1e-6,
                                   atol=1e-6 * top)


@SETTINGS
@given(logits_and_targets(16, 64), st.sampled_from([0.0, 0.1, 0.7]),
       st.sampled_from([0.0, 1e-4, 1e-2]))
def test_closed_form_gradient_equals_autograd(case, eps, z_coef):
    z, y, scale = case
    if scale > 100:  # softmax saturates: fine, but keep z-loss terms small enough to compare
        z = z / scale * 100
    zz = z.clone().requires_grad_()
    loss = L.cross_entropy(zz, y, label_smoothing=eps) + L.z_loss(zz, y, coef=z_coef)
    loss.backward()
    closed = L.cross_entropy_grad(z, y, label_smoothing=eps, z_coef=z_coef)
    torch.testing.assert_close(closed, zz.grad, rtol=1e-4, atol=1e-6)
    ignored = y == L.IGNORE_INDEX
    assert (closed[ignored] == 0).all()
    n = int((~ignored).sum())
    if z_coef == 0:  # cross-entropy alone: rows sum to 0 and entries lie in [-1/n, 1/n]
        assert closed.sum(-1).abs().max() < 1e-5
        assert closed.abs().max() <= 1 / n + 1e-7


def test_z_loss_sees_a_shift_cross_entropy_does_not():
    z, y = torch.randn(6, 40), torch.randint(0, 40, (6,))
    y[0] = L.IGNORE_INDEX
    for c in (0.0, 7.0, -30.0):
        torch.testing.assert_close(L.cross_entropy(z + c, y), L.cross_entropy(z, y))
        lse = torch.logsumexp(z + c, -1)[1:]
        assert L.z_loss(z + c, y).item() == pytest.approx(1e-4 * lse.pow(2).mean().item(),
                                                          rel=1e-5)
    assert L.PALM_Z_LOSS == 1e-4


@pytest.mark.parametrize("eps,V", [(0.1, 256), (0.1, 128_256), (0.01, 1024), (1.0, 64)])
def test_smoothing_floor_is_the_loss_at_the_optimum(eps, V):
    q = torch.full((V,), eps / V, dtype=torch.float64)
    q[3] += 1 - eps
    at_q = L.cross_entropy(q.log()[None], torch.tensor([3]), label_smoothing=eps)
    assert at_q.item() == pytest.approx(L.smoothing_floor(eps, V), rel=1e-6)
    worse = L.cross_entropy((q.log() + 0.1 * torch.randn(V, dtype=torch.float64))[None],
                            torch.tensor([3]), label_smoothing=eps)
    assert worse.item() > at_q.item()


def test_smoothing_floor_shape():
    assert L.smoothing_floor(0.0, 1000) == pytest.approx(0.0, abs=1e-12)
    assert L.smoothing_floor(0.1, 256) < L.smoothing_floor(0.1, 128_256)
    assert L.smoothing_floor(1.0, 256) == pytest.approx(math.log(256))


@given(st.floats(0.01, 10), st.floats(0.05, 1.0))
def test_bits_per_byte_round_trip(nats, tokens_per_byte):
    bpb = L.bits_per_byte(nats, tokens_per_byte)
    assert L.nats_per_token(bpb, tokens_per_byte) == pytest.approx(nats)
    assert L.bits_per_byte(nats, 1.0) == pytest.approx(nats / math.log(2))
    assert L.perplexity(nats) == pytest.approx(math.exp(nats))


@pytest.mark.parametrize("kind", ["bytes", "bpe"])
def test_heldout_covers_the_validation_text(kind):
    tok = data.make_tokenizer(kind, 300)
    ds = data.build_dataset(tok, 64)
    torch.manual_seed(0)
    cfg = configs.get("tiny-llama").with_(vocab_size=tok.vocab_size, d_model=32, n_heads=2,
                                          n_kv_heads=2, d_ff=64, n_layers=1, max_seq_len=64)
    model = Transformer(cfg)
    r = L.heldout(model, ds, batch_size=64)
    assert r["tokens"] == ds.val[:, 1:].numel()
    val_text = data.load_corpus()[int(len(data.load_corpus()) * 0.9):]
    assert 0.98 * len(val_text) < r["bytes"] <= len(val_text)  # all but the unpacked tail
    if kind == "bytes":
        assert r["bytes"] == r["tokens"]
    loss = torch.stack([model(b[None, :-1], b[None, 1:])[1] for b in ds.val[:8]]).mean()
    assert 0.5 < r["nats_per_token"] / loss.item() < 1.5  # the same model, all blocks
    assert r["bits_per_byte"] == pytest.approx(
        L.bits_per_byte(r["nats_per_token"], r["tokens_per_byte"]))


def _net():
    torch.manual_seed(0)
    cfg = configs.get("tiny-llama").with_(vocab_size=64, d_model=32, n_heads=2, n_kv_heads=2,
                                          d_ff=64, n_layers=2, max_seq_len=32)
    return Transformer(cfg)


def _split(x, y, m):
    k = len(x) // m
    return [(x[i * k:(i + 1) * k], y[i * k:(i + 1) * k]) for i in range(m)]


def test_accumulation_mean_of_means_is_wrong_and_the_fix_is_exact():
    net, g = _net(), torch.Generator().manual_seed(1)
    lengths = [4, 5, 6, 32, 30, 31, 2, 3]  # short and long micro-batches
    x, y = L.padded_batch(lengths, 32, 64, g)
    ref = L.batch_grad(net, x, y)
    micro = _split(x, y, 4)
    naive = L.relative_error(L.accumulated_grad(net, micro, "mean-of-means"), ref)
    fixed = L.relative_error(L.accumulated_grad(net, micro, "tokens"), ref)
    trainer = L.trainer_grad(net, micro)
    assert naive > 0.05 and fixed < 1e-5
    assert L.relative_error(trainer, L.accumulated_grad(net, micro, "mean-of-means")) < 1e-5


def test_accumulation_is_exact_for_equal_token_counts():
    net, g = _net(), torch.Generator().manual_seed(2)
    x, y = L.padded_batch([20] * 8, 32, 64, g)  # every micro-batch 40 targets
    ref = L.batch_grad(net, x, y)
    micro = _split(x, y, 4)
    assert L.relative_error(L.accumulated_grad(net, micro, "mean-of-means"), ref) < 1e-5
    assert L.relative_error(L.trainer_grad(net, micro), ref) < 1e-5


def test_trainer_is_exact_on_packed_blocks():
    net = _net()
    blocks = data.pack(torch.randint(0, 64, (2000,), generator=torch.Generator().manual_seed(3)),
                       32)[:8]
    x, y = blocks[:, :-1], blocks[:, 1:]
    assert L.relative_error(L.trainer_grad(net, _split(x, y, 4)), L.batch_grad(net, x, y)) < 1e-5


def test_padded_batch():
    x, y = L.padded_batch([3, 8, 1], 8, 10, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (3, 8)
    assert (y != L.IGNORE_INDEX).sum(1).tolist() == [3, 8, 1]
    assert ((y == L.IGNORE_INDEX) | ((y >= 0) & (y < 10))).all()


@pytest.mark.parametrize("call,match", [
    (lambda: L.cross_entropy(torch.randn(3, 4), torch.tensor([0, 1, 2]), label_smoothing=1.5),
     "label_smoothing must be in"),
    (lambda: L.cross_entropy(torch.randn(3, 4), torch.tensor([0, 1, 2]), reduction="avg"),
     "reduction must be one of"),
    (lambda: L.cross_entropy(torch.randn(3, 4), torch.tensor([0, 1])), "do not match"),
    (lambda: L.cross_entropy(torch.randn(3, 4), torch.tensor([0, 1, 4])),
     r"class ids in \[0, 4\)"),
    (lambda: L.cross_entropy(torch.randint(0, 3, (3, 4)), torch.tensor([0, 1, 2])),
     "floating point"),
    (lambda: L.z_loss(torch.randn(3, 4), torch.tensor([0, 1, 2]), coef=-1.0), ">= 0"),
    (lambda: L.cross_entropy_grad(torch.randn(3, 4), torch.tensor([0, 1, 2]), z_coef=-1.0),
     "z_coef >= 0"),
    (lambda: L.smoothing_floor(0.1, 0), "vocab_size >= 1"),
    (lambda: L.bits_per_byte(2.0, 0.0), "tokens_per_byte must be positive"),
    (lambda: L.nats_per_token(2.0, -1.0), "tokens_per_byte must be positive"),
    (lambda: L.padded_batch([0, 3], 8, 10), r"each in \[1, seq_len=8\]"),
    (lambda: L.padded_batch([3], 8, 1), "vocab_size must be >= 2"),
    (lambda: L.accumulated_grad(_net(), [], "tokens"), "at least one micro-batch"),
    (lambda: L.accumulated_grad(_net(), [(None, None)], "per-token"), "normalise must be"),
    (lambda: L.trainer_grad(_net(), []), "at least one micro-batch"),
    (lambda: L.relative_error(torch.ones(3), torch.ones(4)), "shapes differ"),
    (lambda: L.heldout(_net(), None, batch_size=0), "batch_size must be >= 1"),
])
def test_bad_input_is_rejected(call, match):
    with pytest.raises(ValueError, match=match):
        call()
