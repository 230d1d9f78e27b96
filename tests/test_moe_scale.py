"""DeepSeek-V3 routing (trainbook.parallel.moe_balance) against Hugging Face transformers, the
aux-loss-free balancing, and the MoE cost models (trainbook.parallel.moe_cost)."""

from math import comb

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainbook.parallel import moe_balance as mb
from trainbook.parallel import moe_cost as mc


def _hf_router(n_experts, top_k, n_groups, topk_groups, d, seed):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(hidden_size=d, n_routed_experts=n_experts, num_experts_per_tok=top_k,
                           n_group=n_groups, topk_group=topk_groups, routed_scaling_factor=2.5,
                           norm_topk_prob=True)
    router = DeepseekV3TopkRouter(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(n_experts, d, generator=g))
        router.e_score_correction_bias.copy_(0.3 * torch.randn(n_experts, generator=g))
    return router


def test_transformers_defaults_are_deepseek_v3s():
    from transformers import DeepseekV3Config

    c = DeepseekV3Config()
    assert (c.n_routed_experts, c.num_experts_per_tok, c.n_group, c.topk_group) == (256, 8, 8, 4)
    assert (c.n_shared_experts, c.moe_intermediate_size, c.hidden_size) == (1, 2048, 7168)
    assert c.routed_scaling_factor == 2.5 and c.norm_topk_prob


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), shape=st.sampled_from([(16, 4, 4, 2), (32, 8, 8, 4),
                                                           (12, 3, 3, 1), (8, 2, 2, 2)]))
def test_group_limited_route_matches_transformers(seed, shape):
    n_experts, top_k, n_groups, topk_groups = shape
    router = _hf_router(n_experts, top_k, n_groups, topk_groups, 24, seed)
    x = torch.randn(40, 24, generator=torch.Generator().manual_seed(seed + 1))
    logits, hf_w, hf_idx = router(x)
    w, idx = mb.group_limited_route(logits, router.e_score_correction_bias, top_k, n_groups,
                                    topk_groups, scaling=2.5)
    hf_order, order = hf_idx.argsort(-1), idx.argsort(-1)
    assert torch.equal(hf_idx.gather(1, hf_order), idx.gather(1, order))
    torch.testing.assert_close(hf_w.gather(1, hf_order), w.gather(1, order))


def test_tokens_stay_within_their_node_limit():
    logits = torch.randn(500, 64, generator=torch.Generator().manual_seed(0))
    _, chosen = mb.group_limited_route(logits, None, 8, 8, 3)
    assert mb.nodes_per_token(chosen, 64, 8).max() <= 3
    _, free = mb.group_limited_route(logits, None, 8, 8, 8)
    assert mb.nodes_per_token(free, 64, 8).float().mean() > 3


def test_bias_steers_the_choice_not_the_weights():
    logits = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    bias = torch.zeros(16)
    bias[3] = 10.0  # expert 3 always chosen, but its weight is its own affinity
    w, chosen = mb.group_limited_route(logits, bias, 2, 4, 4, normalize=False)
    assert (chosen == 3).any(-1).all()
    slot = (chosen == 3).float().argmax(-1)
    assert torch.allclose(w.gather(1, slot[:, None]).squeeze(1), logits[:, 3].sigmoid())


def test_update_bias_and_balancing_reduces_imbalance():
    b = mb.update_bias(torch.zeros(4), torch.tensor([10, 2, 4, 4]), 0.5)
    assert b.tolist() == [-0.5, 0.5, 0.5, 0.5]
    run = mb.balance_run(40, tokens=512, gamma=1e-2)
    still = mb.balance_run(40, tokens=512, gamma=0.0)
    assert run[0]["max_over_mean"] > 4 and run[-1]["max_over_mean"] < 2
    assert still[-1]["max_over_mean"] > 4


@pytest.mark.parametrize("E, k, nodes, limit", [(256, 8, 8, None), (256, 8, 8, 4), (64, 6, 8, 3)])
def test_expected_nodes_matches_sampling(E, k, nodes, limit):
    g = torch.Generator().manual_seed(0)
    pool = E if limit is None else limit * E // nodes
    picks = torch.rand(20_000, pool, generator=g).topk(k, dim=-1).indices  # uniform k-subsets
    measured = mb.nodes_per_token(picks, pool, pool // (E // nodes)).float().mean().item()
    assert measured == pytest.approx(mc.expected_nodes(E, k, nodes, limit), rel=0.01)


def test_expected_nodes_edges():
    assert mc.expected_nodes(8, 1, 4) == 1
    assert mc.expected_nodes(8, 8, 4) == 4
    assert mc.expected_nodes(256, 8, 8) == pytest.approx(8 * (1 - comb(224, 8) / comb(256, 8)))


def test_costs():
    assert mc.dispatch_bytes(10, 7168, 3.0, 8, dtype_bytes=1) == 10 * 3 * 7168
    assert mc.dispatch_bytes(10, 7168, 3.0, 8, dedup_per_node=False) == 10 * 8 * 7168 * 2
    fine, coarse = mc.permutation_share(7168, 2048), mc.permutation_share(4096, 14336)
    assert fine > 5 * coarse  # permutation weighs more with narrow experts
    assert mc.imbalance_slowdown([1, 1, 1, 1]) == 1
    assert mc.imbalance_slowdown([4, 0, 0, 0]) == 4


@pytest.mark.parametrize("call, match", [
    (lambda: mb.group_limited_route(torch.zeros(2, 10), None, 2, 4, 2), "do not split"),
    (lambda: mb.group_limited_route(torch.zeros(2, 8), None, 2, 4, 5), "topk_groups"),
    (lambda: mb.group_limited_route(torch.zeros(2, 8), None, 2, 8, 2), "two best experts"),
    (lambda: mb.group_limited_route(torch.zeros(2, 8), None, 5, 4, 2), "top_k 5"),
    (lambda: mb.group_limited_route(torch.zeros(2, 8), torch.zeros(3), 2, 4, 2), "bias must"),
    (lambda: mb.update_bias(torch.zeros(4), torch.zeros(4), -1.0), "gamma"),
    (lambda: mb.balance_run(0), "steps and tokens"),
    (lambda: mc.expected_nodes(10, 2, 4), "do not split"),
    (lambda: mc.expected_nodes(16, 2, 4, 5), "node_limit"),
    (lambda: mc.expected_nodes(16, 9, 4, 2), "top_k 9"),
    (lambda: mc.permutation_share(0, 10), "d_model, d_ff"),
    (lambda: mc.imbalance_slowdown([]), "token counts per rank"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()
