import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from trainbook import configs
from trainbook.model import MoE, Transformer, apply_rope, count_parameters, rope_tables


def shrink(cfg: configs.ModelConfig) -> configs.ModelConfig:
    """Same architecture (flavour, GQA ratio, experts, ties, biases), tiny widths."""
    group = cfg.n_heads // cfg.n_kv_heads
    kv = min(cfg.n_kv_heads, 2)
    return cfg.with_(vocab_size=97, n_layers=2, d_model=16 * kv * group, n_heads=kv * group,
                     n_kv_heads=None if cfg.n_kv_heads is None else kv,
                     d_ff=None if cfg.d_ff is None else 40, head_dim=None, max_seq_len=32)


@pytest.mark.parametrize("name", list(configs.PRESETS))
def test_instantiated_count_equals_analytic_on_tiny_widths(name):
    cfg = shrink(configs.get(name))
    assert count_parameters(Transformer(cfg)) == configs.param_counts(cfg)["total"]


@pytest.mark.parametrize("name", ["gpt2", "llama-3-8b", "mixtral-8x7b"])
def test_full_size_count_on_meta_device(name):
    cfg = configs.get(name)
    with torch.device("meta"):
        model = Transformer(cfg)
    assert count_parameters(model) == configs.param_counts(cfg)["total"]


def test_qwen2_style_biases_counted(hf_dir):
    cfg = shrink(configs.from_hf_config(hf_dir / "qwen2-0.5b.json"))
    model = Transformer(cfg)
    assert model.blocks[0].attn.q.bias is not None and model.blocks[0].attn.o.bias is None
    assert count_parameters(model) == configs.param_counts(cfg)["total"]


@settings(max_examples=25, deadline=None)
@given(flavour=st.sampled_from(["gpt2", "llama"]), heads=st.integers(1, 4), group=st.integers(1, 3),
       hd=st.sampled_from([2, 4, 8]), layers=st.integers(1, 3), ff=st.integers(1, 48),
       experts=st.integers(1, 4), tied=st.booleans(), qkv_bias=st.booleans())
def test_any_valid_config_counts_exactly(flavour, heads, group, hd, layers, ff, experts, tied,
                                         qkv_bias):
    if flavour == "gpt2":
        group, experts, qkv_bias = 1, 1, False
    n_heads = heads * group
    cfg = configs.ModelConfig("h", flavour, 31, layers, n_heads * hd, n_heads, heads, ff,
                              max_seq_len=16, tie_embeddings=tied, qkv_bias=qkv_bias,
                              n_experts=experts, top_k=min(2, experts))
    assert count_parameters(Transformer(cfg)) == configs.param_counts(cfg)["total"]


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama", "tiny-mixtral"])
def test_forward_shapes_and_initial_loss(name):
    torch.manual_seed(0)
    cfg = configs.get(name)
    model = Transformer(cfg)
    idx, targets = torch.randint(0, cfg.vocab_size, (2, 4, 64))
    logits, loss = model(idx, targets)
    assert logits.shape == (4, 64, cfg.vocab_size)
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.25  # near-uniform predictions at init


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama", "tiny-mixtral"])
def test_causal(name):
    torch.manual_seed(0)
    cfg = configs.get(name)
    model = Transformer(cfg).eval()
    a = torch.randint(0, cfg.vocab_size, (1, 32))
    b = a.clone()
    b[0, 20:] = (b[0, 20:] + 1) % cfg.vocab_size  # change only the future
    la, lb = model(a)[0], model(b)[0]
    torch.testing.assert_close(la[:, :20], lb[:, :20])
    assert not torch.allclose(la[:, 20:], lb[:, 20:])


def test_gqa_equals_mha_with_repeated_kv_weights():
    torch.manual_seed(0)
    gqa_cfg = configs.get("tiny-llama")  # 4 heads, 2 kv heads
    gqa = Transformer(gqa_cfg).eval()
    mha = Transformer(gqa_cfg.with_(n_kv_heads=4)).eval()
    state = gqa.state_dict()
    hd = gqa_cfg.head_dim
    for k in list(state):
        if k.endswith((".k.weight", ".v.weight")):  # (kv*hd, d) -> (h*hd, d), each kv head twice
            w = state[k].view(2, hd, -1)
            state[k] = w.repeat_interleave(2, dim=0).reshape(4 * hd, -1)
    mha.load_state_dict(state)
    idx = torch.randint(0, gqa_cfg.vocab_size, (2, 16))
    torch.testing.assert_close(gqa(idx)[0], mha(idx)[0])


def test_rope_is_a_rotation_and_relative():
    cos, sin = rope_tables(16, 8, 10000.0)
    q, k = torch.randn(1, 1, 16, 8), torch.randn(1, 1, 16, 8)
    rq = apply_rope(q, cos, sin)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))  # norm preserved
    # q_m . k_n depends only on m - n: shift both positions by 3.
    same_q, same_k = q[:, :, 5:6].expand(1, 1, 16, 8), k[:, :, 2:3].expand(1, 1, 16, 8)
    rq, rk = apply_rope(same_q, cos, sin), apply_rope(same_k, cos, sin)
    dot = (rq[0, 0, :, None] * rk[0, 0, None, :]).sum(-1)  # dot[m, n]
    torch.testing.assert_close(dot[7, 4], dot[10, 7])


def test_moe_matches_a_dense_reference():
    torch.manual_seed(0)
    cfg = configs.get("tiny-mixtral")
    moe = MoE(cfg)
    x = torch.randn(3, 5, cfg.d_model)
    probs, chosen = moe.router(x).topk(cfg.top_k, dim=-1)
    weights = probs.softmax(-1)
    ref = torch.zeros_like(x)
    for b in range(3):
        for t in range(5):
            for j in range(cfg.top_k):
                ref[b, t] += weights[b, t, j] * moe.experts[chosen[b, t, j]](x[b, t])
    torch.testing.assert_close(moe(x), ref)


def test_sdpa_matches_explicit_attention():
    torch.manual_seed(0)
    cfg = configs.get("tiny-gpt2")
    attn = Transformer(cfg).blocks[0].attn
    x = torch.randn(2, 10, cfg.d_model)
    B, T, h, hd = 2, 10, cfg.n_heads, cfg.head_dim
    q, k, v = (m(x).view(B, T, h, hd).transpose(1, 2) for m in (attn.q, attn.k, attn.v))
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    ref = attn.o((F.softmax(scores, -1) @ v).transpose(1, 2).reshape(B, T, h * hd))
    torch.testing.assert_close(attn(x), ref)


def test_tied_and_untied_heads():
    gpt2 = Transformer(configs.get("tiny-gpt2"))
    assert gpt2.head.weight is gpt2.embed.weight
    llama = Transformer(configs.get("tiny-llama"))
    assert llama.head.weight is not llama.embed.weight


def test_generate_and_errors():
    torch.manual_seed(0)
    cfg = configs.get("tiny-llama").with_(max_seq_len=16)
    model = Transformer(cfg).eval()
    out = model.generate(torch.zeros(1, 4, dtype=torch.long), 20, top_k=5)  # runs past max_seq_len
    assert out.shape == (1, 24)
    with pytest.raises(ValueError, match="exceeds max_seq_len 16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature must be positive"):
        model.generate(torch.zeros(1, 4, dtype=torch.long), 1, temperature=0)
