import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainbook import configs, launch
from trainbook.model import MoE
from trainbook.parallel import expert_parallel as ep
from trainbook.parallel import harness


def test_layer_forward_and_backward_exact_on_two_and_four_ranks():
    variants = [dict(), dict(top_k=1), dict(n_experts=8, top_k=3)]
    for r in launch.run(ep.layer_sweep, 2, args=(variants,), timeout_s=120):
        for v, out in zip(variants, r.value):
            assert out["out"] < 1e-6 and out["input_grad"] < 1e-6, (v, out)
            assert out["expert_grad"] < 1e-6 and out["router_grad"] < 1e-6, (v, out)
            n = v.get("n_experts", 4) // 2
            assert out["local_experts"] == list(range(r.rank * n, (r.rank + 1) * n))
            # backward sends exactly what forward sent, in the other direction
            assert out["comm"]["forward_bytes"] == out["comm"]["backward_bytes"] > 0
    four = launch.run(ep.layer_sweep, 4, args=([dict(n_experts=4, top_k=2)],), timeout_s=120)
    for r in four:
        out = r.value[0]
        assert out["local_experts"] == [r.rank]
        assert max(out["out"], out["input_grad"], out["expert_grad"], out["router_grad"]) < 1e-6


def test_model_training_matches_single_process_and_memory_estimate():
    spec = ep.EPSetup()
    variants = [dict(measure_memory=True), dict(aux_weight=0.01, z_weight=0.001)]
    per_rank = launch.run(ep.sweep, 2, args=(spec, variants), timeout_s=240)
    for i, v in enumerate(variants):
        ref, ref_stats = ep.reference(
            spec.with_(**{k: w for k, w in v.items() if k != "measure_memory"}))
        outs = [r.value[i] for r in per_rank]
        d = harness.max_differences(ep.merge(outs), ref)
        assert d["loss"] < 1e-5 and d["grad"] < 1e-6 and d["param"] < 1e-6, (v, d)
        # routing statistics summed over ranks are the single-process ones
        for s, rs in zip(outs[0]["stats"], ref_stats):
            assert torch.equal(s["tokens_per_expert"], rs["tokens_per_expert"])
            assert s["dropped"] == rs["dropped"] == 0
    # experts are split, everything else is replicated
    names = [set(r.value[0]["trace"].first_grads) for r in per_rank]
    assert names[0] & names[1] == {n for n in names[0] if not ep.is_expert(n)}
    assert names[0] | names[1] == set(ref.first_grads)
    # per layer and step the all-to-alls carry (off-rank rows) x d x 4 bytes, twice
    for r in per_rank:
        comm = r.value[0]["alltoall"]
        assert comm["calls"] == 2 * spec.n_layers * spec.steps
        assert comm["forward_bytes"] == comm["backward_bytes"]
        assert comm["forward_bytes"] % (spec.d_model * 4) == 0
        tokens = spec.global_batch // 2 * spec.seq_len
        assert comm["forward_bytes"] <= (2 * spec.n_layers * spec.steps * tokens * spec.top_k
                                         * spec.d_model * 4)
    mem = per_rank[0].value[0]["memory"]
    assert mem["measured"]["weights"] == mem["estimate"]["weights"]  # experts divided by ep
    assert abs(mem["estimate"]["peak"] / mem["measured"]["peak"] - 1) < 0.3


def test_routed_moe_without_capacity_is_the_reference_moe():
    cfg = configs.get("tiny-mixtral").with_(d_model=32, d_ff=48)
    torch.manual_seed(0)
    moe = MoE(cfg)
    x = torch.randn(3, 7, 32)
    routed = ep.RoutedMoE(moe)
    assert torch.equal(routed(x), moe(x))
    assert routed.stats.dropped == 0 and int(routed.stats.counts.sum()) == 21 * cfg.top_k
    tight = ep.RoutedMoE(moe, capacity_factor=0.5)
    tight(x)
    cap = ep.capacity(21, cfg.n_experts, cfg.top_k, 0.5)
    assert tight.stats.dropped == int((routed.stats.counts - cap).clamp(min=0).sum()) > 0


def test_capacity_formula():
    assert ep.capacity(512, 8, 2, 1.25) == 160  # ceil(1.25 * 512 * 2 / 8)
    assert ep.capacity(10, 4, 1, 1.0) == 3
    assert ep.capacity(10, 4, 2, None) == 20  # no limit: every assignment fits


@settings(deadline=None, max_examples=40)
@given(tokens=st.integers(1, 40), n_experts=st.integers(2, 8), data=st.data())
def test_capacity_drops_counted_like_a_loop(tokens, n_experts, data):
    top_k = data.draw(st.integers(1, n_experts))
    factor = data.draw(st.floats(0.1, 2.0))
    seed = data.draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    chosen = torch.stack([torch.randperm(n_experts, generator=g)[:top_k] for _ in range(tokens)])
    cap = ep.capacity(tokens, n_experts, top_k, factor)
    keep = ep.keep_mask(chosen, n_experts, cap)
    # the plain loop: first choices of all tokens, then second choices, ...
    used, expected = [0] * n_experts, torch.zeros_like(keep)
    for slot in range(top_k):
        for t in range(tokens):
            e = int(chosen[t, slot])
            if used[e] < cap:
                used[e] += 1
                expected[t, slot] = True
    assert torch.equal(keep, expected)
    counts = ep.expert_counts(chosen, n_experts)
    assert int((~keep).sum()) == int((counts - cap).clamp(min=0).sum())


def test_load_balancing_loss_is_one_when_uniform_and_larger_when_skewed():
    E, T, k = 4, 64, 2
    uniform_probs = torch.full((T, E), 1 / E)
    uniform = ep.load_balancing_loss(uniform_probs, torch.full((E,), T * k // E), k)
    assert uniform.item() == pytest.approx(1.0)
    skewed_probs = torch.tensor([0.7, 0.1, 0.1, 0.1]).expand(T, E)
    skewed = ep.load_balancing_loss(skewed_probs, torch.tensor([T, T // 2, T // 4, T // 4]), k)
    assert skewed.item() > 1.0
    collapsed = ep.load_balancing_loss(torch.eye(E)[[0] * T], torch.tensor([T, 0, 0, 0]), 1)
    assert collapsed.item() == pytest.approx(E)  # top-1: the maximum E, everything on one expert
    logits = torch.randn(T, E)
    weights, chosen, probs = ep.route(logits, k)
    assert torch.allclose(weights.sum(-1), torch.ones(T))
    assert ep.router_z_loss(logits).item() == pytest.approx(
        torch.logsumexp(logits, -1).pow(2).mean().item())
    assert math.isclose(probs.sum().item(), T, rel_tol=1e-5)


@pytest.mark.parametrize("E,k", [(4, 1), (4, 2), (8, 2), (8, 3), (64, 8)])
def test_load_balancing_loss_reaches_E_over_k_when_all_tokens_pick_the_same_k(E, k):
    """Top-k routing sends each token to k distinct experts, so f_i <= 1/k and the loss is at
    most E/k; it gets there when all tokens route to the same k experts with all the router's
    probability on them. Random routings stay below."""
    T = 32
    logits = torch.full((T, E), -30.0)
    logits[:, :k] = torch.randn(T, k)  # experts 0..k-1 win for every token
    weights, chosen, probs = ep.route(logits, k)
    counts = ep.expert_counts(chosen, E)
    assert counts[:k].tolist() == [T] * k and counts[k:].sum() == 0
    loss = ep.load_balancing_loss(probs, counts, k)
    assert loss.item() == pytest.approx(E / k, rel=1e-6)
    g = torch.Generator().manual_seed(E * 100 + k)
    for _ in range(20):
        logits = torch.randn(T, E, generator=g) * 5
        _, chosen, probs = ep.route(logits, k)
        assert ep.load_balancing_loss(probs, ep.expert_counts(chosen, E), k).item() <= E / k + 1e-6


def test_bad_input():
    with pytest.raises(ValueError, match="do not split over 3 expert-parallel ranks"):
        ep.check_moe(4, 2, ep=3)
    with pytest.raises(ValueError, match="top_k 5 is larger than the number of experts 4"):
        ep.route(torch.randn(3, 4), 5)
    with pytest.raises(ValueError, match="capacity factor must be positive"):
        ep.capacity(10, 4, 2, 0.0)
    with pytest.raises(ValueError, match="capacity factor must be positive"):
        ep.EPSetup(capacity_factor=-1.0)
    with pytest.raises(ValueError, match="needs a process group"):
        ep.ExpertParallelMoE(MoE(configs.get("tiny-mixtral")))
    with pytest.raises(ValueError, match="runs inside a process group"):
        ep.run_ep(ep.EPSetup())
    with pytest.raises(ValueError, match="aux_weight and z_weight must be >= 0"):
        ep.EPSetup(aux_weight=-0.1)
