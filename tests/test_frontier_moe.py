"""Training mixture-of-experts models (book/frontier/moe): the routers and the balancing losses
against their printed formulas and against Hugging Face transformers, the MoE layer's seams
(auxiliary losses through the backward pass, capacity, shared experts, bias balancing,
upcycling), and the parameter accounting of Mixtral 8x7B and DeepSeek-V3 against transformers'
own models and the published figures."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainbook import configs
from trainbook.frontier import moe_accounting as A
from trainbook.frontier import moe_router as R
from trainbook.frontier.moe_layer import (
    AuxLossScaler,
    MoEHook,
    MoEOptions,
    RoutedLayer,
    Upcycle,
    upcycle,
)
from trainbook.model import MoE, Transformer
from trainbook.parallel import moe_routing as mr


def _logits(tokens, experts, seed=0, scale=1.0):
    return scale * torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------
# The balancing losses as printed
# ---------------------------------------------------------------------------------------------

def _switch_by_hand(logits):
    """Fedus et al. 2021 eqs. 4-6, term by term: N sum_i f_i P_i, f_i = 1/T sum_x 1{argmax p(x)
    = i}, P_i = 1/T sum_x p_i(x)."""
    T, N = logits.shape
    p = logits.softmax(-1)
    total = 0.0
    for i in range(N):
        f = sum(1.0 for x in range(T) if int(p[x].argmax()) == i) / T
        P = sum(float(p[x, i]) for x in range(T)) / T
        total += f * P
    return N * total


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), E=st.integers(2, 9), T=st.integers(1, 40))
def test_switch_loss_is_equation_4(seed, E, T):
    logits = _logits(T, E, seed, 2.0)
    assert R.switch_loss(logits).item() == pytest.approx(_switch_by_hand(logits), rel=1e-5)
    probs = logits.softmax(-1)
    assert R.topk_loss(probs, probs.argmax(-1, keepdim=True)).item() == \
        pytest.approx(R.switch_loss(logits).item(), rel=1e-6)


def test_switch_loss_bounds():
    E, T = 8, 64
    assert R.switch_loss(torch.zeros(T, E)).item() == pytest.approx(1.0)  # ties: argmax 0 ...
    uniform_probs = torch.full((T, E), 1 / E)
    even = torch.arange(T) % E  # ... but an even assignment with uniform P is exactly 1
    assert R.topk_loss(uniform_probs, even[:, None]).item() == pytest.approx(1.0)
    one_hot = torch.full((T, E), -30.0)
    one_hot[:, 3] = 30.0  # every token, all probability, one expert: N
    assert R.switch_loss(one_hot).item() == pytest.approx(E, rel=1e-6)


def test_hf_mixtral_loss_matches_transformers():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    for seed, (E, k, layers, T) in enumerate([(8, 2, 3, 50), (4, 1, 1, 7), (16, 4, 2, 33)]):
        logits = [_logits(T, E, seed * 10 + i, 1.5) for i in range(layers)]
        hf = load_balancing_loss_func(tuple(logits), E, k)
        ours = R.hf_mixtral_loss(logits, k)
        torch.testing.assert_close(ours, hf.float(), rtol=1e-6, atol=1e-6)


def test_hf_mixtral_is_k_times_switch_and_pools_layers():
    k = 2
    a, b = _logits(64, 8, 1, 3.0), _logits(64, 8, 2, 0.1)
    pa = a.softmax(-1)
    one = R.topk_loss(pa, pa.topk(k, -1).indices)
    assert R.hf_mixtral_loss([a], k).item() == pytest.approx(k * one.item(), rel=1e-6)
    pooled = R.hf_mixtral_loss([a, b], k).item()
    mean_of_layers = (R.hf_mixtral_loss([a], k).item() + R.hf_mixtral_loss([b], k).item()) / 2
    assert abs(pooled - mean_of_layers) > 1e-3  # pooling is not averaging


def test_sequence_loss_is_deepseek_v3s_equations():
    E, k, T, n_seq = 8, 2, 16, 3
    logits = _logits(n_seq * T, E, 5, 2.0)
    s = logits.sigmoid()
    chosen = s.topk(k, -1).indices
    total = 0.0
    for q in range(n_seq):  # eqs. 17-20, per sequence, then the mean over sequences
        rows = range(q * T, (q + 1) * T)
        for i in range(E):
            f = E / (k * T) * sum(1.0 for t in rows if i in chosen[t].tolist())
            P = sum(float(s[t, i] / s[t].sum()) for t in rows) / T
            total += f * P
    probs = s / s.sum(-1, keepdim=True)
    assert R.sequence_loss(probs, chosen, T).item() == pytest.approx(total / n_seq, rel=1e-5)
    even = (torch.arange(T * k) % E).view(T, k)
    assert R.sequence_loss(torch.full((T, E), 1 / E), even, T).item() == pytest.approx(1.0)


def test_transformers_mixtral_defaults():
    """The chapter compares the released config's coefficient with the library's default."""
    from transformers import MixtralConfig

    c = MixtralConfig()
    assert c.router_aux_loss_coef == R.HF_MIXTRAL_AUX_COEF
    assert c.output_router_logits is False and c.router_jitter_noise == 0.0


# ---------------------------------------------------------------------------------------------
# Routers and load statistics
# ---------------------------------------------------------------------------------------------

def test_routers():
    logits = _logits(20, 6, 3)
    mix = R.route(logits, 2, "mixtral")
    w, c, p = mr.route(logits, 2)
    assert torch.equal(mix.chosen, c) and torch.equal(mix.weights, w) and torch.equal(mix.probs, p)
    sw = R.route(logits, 2, "switch")
    assert torch.equal(sw.chosen, c)  # the same experts, other weights
    torch.testing.assert_close(sw.weights, logits.softmax(-1).gather(1, c))
    assert (sw.weights.sum(-1) < 1).all()
    sig = R.route(logits, 2, "sigmoid")
    torch.testing.assert_close(sig.weights.sum(-1), torch.ones(20))
    assert torch.equal(sig.chosen.sort(-1).values, logits.topk(2, -1).indices.sort(-1).values)
    bias = torch.zeros(6)
    bias[5] = 10.0
    assert (R.route(logits, 2, "sigmoid", bias).chosen == 5).any(-1).all()


def test_load_stats():
    even = R.load_stats(torch.full((8,), 10))
    assert even == {"max_over_mean": 1.0, "entropy": pytest.approx(1.0), "cv": 0.0, "dead": 0}
    two = R.load_stats(torch.tensor([50, 50, 0, 0, 0, 0, 0, 0]))
    assert two["max_over_mean"] == 4.0 and two["dead"] == 6
    assert two["entropy"] == pytest.approx(math.log(2) / math.log(8))


@pytest.mark.parametrize("call, match", [
    (lambda: R.route(torch.zeros(4, 4), 2, "softmax"), "router must be one of"),
    (lambda: R.route(torch.zeros(4), 1), r"\(tokens, experts\)"),
    (lambda: R.route(torch.zeros(4, 1), 1), "at least 2 experts"),
    (lambda: R.route(torch.zeros(4, 4), 5), "top_k 5"),
    (lambda: R.route(torch.zeros(4, 4), 1.5), "whole number"),
    (lambda: R.route(torch.zeros(4, 4), 1, "mixtral", torch.zeros(4)), "sigmoid"),
    (lambda: R.switch_loss(torch.zeros(3)), r"\(tokens, experts\)"),
    (lambda: R.topk_loss(torch.zeros(3, 4), torch.zeros(2, 1, dtype=torch.long)), "same tokens"),
    (lambda: R.hf_mixtral_loss(torch.zeros(3, 4), 1), "one \\(tokens, E\\) tensor"),
    (lambda: R.hf_mixtral_loss([], 1), "one \\(tokens, E\\) tensor"),
    (lambda: R.hf_mixtral_loss([torch.zeros(3, 4), torch.zeros(3, 5)], 1), "same number"),
    (lambda: R.sequence_loss(torch.zeros(6, 4), torch.zeros(6, 1, dtype=torch.long), 4),
     "do not split"),
    (lambda: R.sequence_loss(torch.zeros(6, 4), torch.zeros(6, 1, dtype=torch.long), 0),
     "seq_len"),
    (lambda: R.load_stats(torch.zeros(4)), "not all zero"),
    (lambda: R.load_stats(torch.tensor([1, -1])), "non-negative"),
    (lambda: R.load_stats(torch.ones(1)), "one entry per expert"),
])
def test_router_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---------------------------------------------------------------------------------------------
# The layer
# ---------------------------------------------------------------------------------------------

def _moe(n_experts=4, top_k=2, d=32, ff=48, seed=0):
    torch.manual_seed(seed)
    return MoE(configs.get("tiny-mixtral").with_(d_model=d, d_ff=ff, n_experts=n_experts,
                                                 top_k=top_k))


def test_default_layer_is_the_models_moe():
    moe = _moe()
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1))
    ref = moe(x)
    layer = RoutedLayer(moe, MoEOptions())
    assert torch.equal(layer(x), ref)
    assert {n for n, _ in layer.named_parameters()} == {n for n, _ in moe.named_parameters()}


def test_aux_loss_reaches_the_gradient_as_if_added_to_the_loss():
    opts = MoEOptions(balance="switch", balance_coef=0.3, z_coef=0.05)
    x = torch.randn(3, 4, 32, generator=torch.Generator().manual_seed(2))
    upstream = torch.randn(3, 4, 32, generator=torch.Generator().manual_seed(3))
    layer = RoutedLayer(_moe(), opts).train()
    layer.scale = 0.5  # two micro-batches
    (layer(x) * upstream).sum().backward()
    got = {n: p.grad.clone() for n, p in layer.named_parameters()}
    ref = RoutedLayer(_moe(), MoEOptions()).train()  # the same weights, the loss written out
    flat = x.reshape(-1, 32)
    logits = ref.router(flat)
    r = R.route(logits, 2)
    total = (ref(x) * upstream).sum() + 0.5 * (0.3 * R.topk_loss(r.probs, r.chosen)
                                               + 0.05 * mr.router_z_loss(logits))
    total.backward()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(got[n], p.grad, msg=n)
    assert layer.balance_value > 0 and layer.z_value > 0


def test_aux_loss_scaler_is_the_identity_forward():
    out = torch.randn(3, requires_grad=True)
    aux = (out * 2).sum()
    y = AuxLossScaler.apply(out, aux, 0.25)
    assert torch.equal(y, out)
    y.sum().backward()
    torch.testing.assert_close(out.grad, torch.full((3,), 1 + 0.25 * 2))


def test_capacity_drops_and_dropless():
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(4))
    layer = RoutedLayer(_moe(), MoEOptions(capacity_factor=1.0)).train()
    layer(x)
    r = R.route(layer.router(x), 2)
    keep = mr.keep_mask(r.chosen, 4, mr.capacity(64, 4, 2, 1.0))
    assert layer.dropped == int((~keep).sum()) > 0 and layer.assigned == 128
    free = RoutedLayer(_moe(), MoEOptions()).train()
    free(x)
    assert free.dropped == 0 and int(free.counts.sum()) == 128


def test_shared_experts_see_every_token():
    moe = _moe(n_experts=5, top_k=2)
    layer = RoutedLayer(moe, MoEOptions(n_shared=1)).eval()
    assert layer.router.weight.shape == (4, 32) and len(layer.experts) == 4
    torch.testing.assert_close(layer.router.weight, moe.router.weight[1:])
    x = torch.randn(10, 32, generator=torch.Generator().manual_seed(5))
    r = R.route(layer.router(x), 2)
    expect = torch.stack([sum(r.weights[t, s] * layer.experts[e](x[t])
                              for s, e in enumerate(r.chosen[t].tolist()))
                          for t in range(10)]) + moe.experts[0](x)
    torch.testing.assert_close(layer(x), expect)


def test_hook_trains_records_and_moves_the_bias():
    from trainbook.frontier import moe_runs as M

    cfg = M.proxy_config(4, 2, 32, steps=3, warmup_steps=1, eval_batches=1)
    hook_opts = MoEOptions(router="sigmoid", bias_gamma=0.01, capacity_factor=1.0)
    res = M.run(cfg, hook_opts)
    rows = res.history
    assert len(rows[0]["expert_counts"]) == 2 and len(rows[0]["expert_counts"][0]) == 4
    assert sum(rows[0]["expert_counts"][0]) == cfg.batch_size * cfg.seq_len * 2
    assert 0 <= rows[0]["dropped_frac"] < 1
    biases = [m.bias for m in res.model.modules() if isinstance(m, RoutedLayer)]
    assert all(b.abs().max() <= 0.03 + 1e-6 for b in biases)  # gamma per step, 3 steps
    assert all(b.abs().sum() > 0 for b in biases)
    assert "blocks.0.mlp.bias" in res.model.state_dict()  # checkpointed, as DeepSeek-V3's


def test_upcycled_model_computes_what_the_dense_one_does():
    dense_cfg = configs.get("tiny-llama").with_(d_model=32, n_heads=2, n_kv_heads=2, d_ff=48,
                                                 n_layers=2, vocab_size=64, max_seq_len=16)
    torch.manual_seed(0)
    dense = Transformer(dense_cfg)
    moe = Transformer(dense_cfg.with_(n_experts=4, top_k=2))
    upcycle(moe, dense.state_dict())
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(moe(idx)[0], dense(idx)[0], rtol=1e-5, atol=1e-5)
    switch = Transformer(dense_cfg.with_(n_experts=4, top_k=2))
    upcycle(switch, dense.state_dict())
    MoEHook(MoEOptions(router="switch")).on_model(switch)  # weights sum below 1: not dense
    assert (switch(idx)[0] - dense(idx)[0]).abs().max() > 1e-3
    narrow = Transformer(dense_cfg.with_(n_experts=4, top_k=2, d_ff=24))
    with pytest.raises(ValueError, match="give the experts the dense d_ff"):
        upcycle(narrow, dense.state_dict())
    other = Transformer(dense_cfg.with_(n_experts=4, top_k=2, d_model=64, n_heads=2))
    with pytest.raises(ValueError, match="same d_model"):
        upcycle(other, dense.state_dict())


@pytest.mark.parametrize("call, match", [
    (lambda: MoEOptions(router="top1"), "router must be one of"),
    (lambda: MoEOptions(balance="gshard", balance_coef=0.1), "balance must be one of"),
    (lambda: MoEOptions(balance="switch"), "give both"),
    (lambda: MoEOptions(balance_coef=0.1), "give both"),
    (lambda: MoEOptions(z_coef=-1.0), "z_coef"),
    (lambda: MoEOptions(z_coef=float("nan")), "z_coef"),
    (lambda: MoEOptions(capacity_factor=0.0), "capacity_factor"),
    (lambda: MoEOptions(bias_gamma=0.001), "router='sigmoid'"),
    (lambda: MoEOptions(n_shared=-1), "n_shared"),
    (lambda: RoutedLayer(torch.nn.Linear(2, 2), MoEOptions()), "wraps a trainbook.model.MoE"),
    (lambda: RoutedLayer(_moe(n_experts=3, top_k=2), MoEOptions(n_shared=2)), "routed"),
    (lambda: MoEHook("switch"), "MoEOptions"),
    (lambda: MoEHook().on_model(Transformer(configs.get("tiny-llama"))), "no MoE layers"),
    (lambda: upcycle(Transformer(configs.get("tiny-mixtral")), {}), "state_dict"),
    (lambda: Upcycle({}), "state_dict"),
])
def test_layer_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---------------------------------------------------------------------------------------------
# Accounting
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(A.MODELS))
def test_counts_match_transformers_models(name):
    assert A.counts(name)["total"] == A.hf_param_count(name)


def test_mixtral_counts_are_the_presets():
    assert A.counts("mixtral-8x7b")["total"] == \
        configs.param_counts(configs.get("mixtral-8x7b"))["total"]
    c = configs.from_hf_config(A.MIXTRAL_8X7B)
    assert (c.n_experts, c.top_k, c.d_ff, c.rope_theta) == (8, 2, 14336, 1e6)


def test_deepseek_v3_counts():
    c = A.counts("deepseek-v3")
    assert c["total"] == 671_026_419_200
    # the active share: 8 of 256 routed experts plus the shared one, per MoE layer
    expert = 3 * 7168 * 2048
    assert c["total"] - c["active"] == 58 * 248 * expert
    # the checkpoint: the main model, the MTP module with its own embedding and head, FP8 scales
    assert c["checkpoint"] == c["total"] + c["mtp_unique"] + 2 * 129280 * 7168 + c["fp8_scales"]
    no_fp8 = A.counts({**A.DEEPSEEK_V3, "quantization_config": None})
    assert no_fp8["fp8_scales"] == 0 and no_fp8["total"] == c["total"]


def test_published_figures_recomputed():
    rows = A.published_check()
    assert len(rows) == len(A.PUBLISHED) and all(r["agrees"] for r in rows)
    # the conventions differ: Mixtral's 12.9 counts the embedding, DeepSeek's 37 does not
    mix, ds = A.counts("mixtral-8x7b"), A.counts("deepseek-v3")
    assert f"{mix['active_no_embedding'] / 1e9:.1f}" != "12.9"
    assert f"{ds['active'] / 1e9:.0f}" != "37"
    assert f"{(ds['checkpoint'] - ds['fp8_scales']) / 1e9:.0f}" != "685"


def test_flops_per_token():
    mix = A.flops_per_token("mixtral-8x7b", 4096)
    from trainbook.compute.flops import training_flops_per_token

    assert mix["moe"] == training_flops_per_token(configs.get("mixtral-8x7b"), 4096)
    c = A.counts("mixtral-8x7b")
    assert mix["dense_equivalent"] - mix["moe"] == 6 * (c["total"] - c["active"])
    ds = A.flops_per_token("deepseek-v3", 1)
    d = A.counts("deepseek-v3")
    assert ds["moe"] == 6 * d["active_no_embedding"] + 6 * 61 * 128 * (192 + 128)


@pytest.mark.parametrize("call, match", [
    (lambda: A.load("gpt-5"), "neither one of"),
    (lambda: A.counts({"model_type": "deepseek_v3"}), "lacks hidden_size"),
    (lambda: A.counts({**A.DEEPSEEK_V3, "hidden_size": -1}), "hidden_size"),
    (lambda: A.counts({**A.DEEPSEEK_V3, "num_experts_per_tok": 300}), "inconsistent"),
    (lambda: A.counts({**A.DEEPSEEK_V3, "moe_layer_freq": 2}), "moe_layer_freq"),
    (lambda: A.counts({"model_type": "qwen2_moe"}), "not supported"),
    (lambda: A.deepseek_v3_counts(A.MIXTRAL_8X7B), "lacks"),
    (lambda: A.flops_per_token("mixtral-8x7b", 0), "seq_len"),
    (lambda: A.published_check(["llama"]), "no published figures"),
    (lambda: A.hf_param_count({"model_type": "llama"}), "builds"),
])
def test_accounting_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_load_reads_files(tmp_path):
    import json

    p = tmp_path / "config.json"
    p.write_text(json.dumps(A.DEEPSEEK_V3))
    assert A.counts(str(p)) == A.counts("deepseek-v3") == A.counts(str(tmp_path))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="cannot read"):
        A.load(str(tmp_path / "bad.json"))
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(ValueError, match="not a Hugging Face config.json"):
        A.load(str(tmp_path / "list.json"))


def test_moe_params_command(capsys):
    import json

    from trainbook.__main__ import main

    assert main(["moe-params", "--model", "deepseek-v3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["params"]["total"] == 671_026_419_200 and all(r["agrees"]
                                                             for r in out["published"])
    assert main(["moe-params", "--model", "mixtral-8x7b"]) == 0
    text = capsys.readouterr().out
    assert "46.70 B total, 12.88 B active" in text
    assert main(["moe-params", "--model", "no-such-model"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:")
