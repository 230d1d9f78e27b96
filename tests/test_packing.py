"""Packing versus padding and document masks (trainbook.pretrain.packing)."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from trainbook import configs
from trainbook.model import Transformer
from trainbook.pretrain import packing as P


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 600), min_size=1, max_size=60), st.integers(1, 300))
def test_padding_waste_orders_the_strategies(lengths, seq_len):
    w = {s: P.padding_waste(lengths, seq_len, s, batch_size=4) for s in P.STRATEGIES}
    assert all(0 <= v < 1 for v in w.values())
    assert w["batch"] <= w["fixed"] + 1e-12
    assert w["packed"] < seq_len / sum(lengths) + 1e-12  # only the last row is padded


def test_padding_waste_by_hand():
    assert P.padding_waste([10, 30], 40, "fixed") == pytest.approx(1 - 40 / 80)
    assert P.padding_waste([10, 30, 50], 40, "fixed") == pytest.approx(1 - 90 / 160)
    assert P.padding_waste([10, 30], 40, "packed") == 0
    assert P.padding_waste([10, 30, 20, 20], 40, "sorted", batch_size=2) == pytest.approx(
        1 - 80 / (2 * 20 + 2 * 30))


def test_pack_documents_ids_and_positions():
    pk = P.pack_documents([[1, 2, 3], [4, 5], [6, 7, 8, 9, 10]], 4, eos_id=0)
    assert pk.tokens.tolist() == [[1, 2, 3, 0, 4], [4, 5, 0, 6, 7], [7, 8, 9, 10, 0]]
    assert pk.doc_ids.tolist() == [[0, 0, 0, 0, 1], [1, 1, 1, 2, 2], [2, 2, 2, 2, 2]]
    assert pk.positions.tolist() == [[0, 1, 2, 3, 0], [0, 1, 2, 0, 1], [0, 1, 2, 3, 4]]
    assert P.cu_seqlens(pk.doc_ids[:, :-1]).tolist() == [0, 4, 7, 8, 12]


def test_document_mask_is_block_diagonal_causal():
    m = P.document_mask(torch.tensor([[0, 0, 1, 1, 1]]))[0, 0]
    want = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0],
                         [0, 0, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(m, want)


def test_masked_attention_equals_attention_per_document():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 7, 8) for _ in range(3))
    ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1]])
    packed = F.scaled_dot_product_attention(q, k, v, attn_mask=P.document_mask(ids))
    for sl in (slice(0, 3), slice(3, 7)):
        alone = F.scaled_dot_product_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl],
                                               is_causal=True)
        torch.testing.assert_close(packed[:, :, sl], alone)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_mask_stops_the_leak_and_positions_reset_for_learned_positions(name):
    torch.manual_seed(0)
    model = Transformer(configs.get(name).with_(vocab_size=300))
    g = torch.Generator().manual_seed(1)
    a, other, doc = (torch.randint(0, 300, (n,), generator=g).tolist() for n in (24, 24, 16))
    leaky = P.leak(model, a, other, doc, masked=False, reset_positions=False)
    assert leaky["vs other previous document"] > 1e-3
    masked = P.leak(model, a, other, doc, masked=True, reset_positions=False)
    assert masked["vs other previous document"] == 0  # bit for bit: a never enters doc's sums
    full = P.leak(model, a, other, doc, masked=True, reset_positions=True)
    assert full["vs document alone"] < 1e-5
    if name == "tiny-gpt2":  # learned positions: without the reset doc sits at positions 24..
        assert masked["vs document alone"] > 1e-3
    else:  # RoPE is relative: the mask alone gives the document's own logits
        assert masked["vs document alone"] < 1e-5
    assert all("core" not in vars(m) for m in model.modules())  # seams restored


def test_bad_input():
    with pytest.raises(ValueError, match="strategy 'zip' is unknown"):
        P.padding_waste([3], 4, "zip")
    with pytest.raises(ValueError, match="positive document lengths"):
        P.padding_waste([0, 3], 4)
    with pytest.raises(ValueError, match="at least one document"):
        P.pack_documents([], 4, 0)
    with pytest.raises(ValueError, match="same length"):
        P.leak(Transformer(configs.get("tiny-gpt2")), [1], [1, 2], [3], True, True)
    with pytest.raises(ValueError, match="no trainbook.model.Attention"):
        with P.document_attention(torch.nn.Linear(2, 2), torch.zeros(1, 2, dtype=torch.long)):
            pass
    with pytest.raises(ValueError, match="batch, time"):
        P.document_mask(torch.zeros(3, dtype=torch.long))
