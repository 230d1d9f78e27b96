import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainbook import configs, launch
from trainbook.model import MoE
from trainbook.parallel import expert_parallel as ep
from trainbook.parallel import harness
from trainbook.parallel import moe_routing as mr


def test_layer_forward_and_backward_exact_on_two_and_four_ranks():
    variants = {"default": {}, "top1": dict(top_k=1), "8x3": dict(n_experts=8, top_k=3)}
    checks = {k: ep.layer_check(**v) for k, v in variants.items()}
    for r in launch.run(harness.sweep, 2, args=(harness.Setup(), checks), timeout_s=120):
        for name, v in variants.items():
            out = r.value[name]
            assert out["out"] < 1e-6 and out["input_grad"] < 1e-6, (v, out)
            assert out["expert_grad"] < 1e-6 and out["router_grad"] < 1e-6, (v, out)
            n = v.get("n_experts", 4) // 2
            assert out["local_experts"] == list(range(r.rank * n, (r.rank + 1) * n))
            # backward sends exactly what forward sent, in the other direction
            assert out["comm"]["forward_bytes"] == out["comm"]["backward_bytes"] > 0
    four = launch.run(harness.sweep, 4, args=(harness.Setup(), {"4": ep.layer_check()}),
                      timeout_s=120)
    for r in four:
        out = r.value["4"]
        assert out["local_experts"] == [r.rank]
        assert max(out["out"], out["input_grad"], out["expert_grad"], out["router_grad"]) < 1e-6


SETUP = harness.Setup(d_ff=64)  # a tiny Mixtral: 4 experts of width 64, top-2


def test_model_training_matches_single_process_and_memory_estimate():
    runs = {"plain": ep.ExpertParallelRun(),
            "aux": ep.ExpertParallelRun(aux_weight=0.01, z_weight=0.001),
            "memory": ep.ExpertParallelRun(measure_memory=True, setup=dataclasses.replace(
                SETUP, steps=1, optimizer="adamw"))}
    per_rank = launch.run(harness.sweep, 2, args=(SETUP, runs), timeout_s=240)
    for name in ("plain", "aux"):
        ref = harness.run(SETUP, runs[name])  # the same technique in one process
        for r in per_rank:
            out = r.value[name]
            d = harness.max_differences(out.trace, ref.trace)
            assert d["loss"] < 1e-5 and d["grad"] < 1e-6 and d["param"] < 1e-6, (name, d)
            # routing statistics summed over ranks are the single-process ones
            for s, rs in zip(out["routing"], ref["routing"], strict=True):
                assert torch.equal(s["tokens_per_expert"], rs["tokens_per_expert"])
                assert s["dropped"] == rs["dropped"] == 0
    # experts are split, everything else is replicated
    full = sum(p.numel() for p in ep.build_model(SETUP, runs["plain"]).parameters())
    on_rank = [r.value["plain"]["params_on_rank"] for r in per_rank]
    assert on_rank[0] == on_rank[1] < full
    # per layer and step the all-to-alls carry (off-rank rows) x d x 4 bytes, twice
    for r in per_rank:
        comm = r.value["plain"]["alltoall"]
        assert comm["calls"] == 2 * SETUP.n_layers * SETUP.steps
        assert comm["forward_bytes"] == comm["backward_bytes"]
        assert comm["forward_bytes"] % (SETUP.d_model * 4) == 0
        tokens = SETUP.global_batch // 2 * SETUP.seq_len
        assert comm["forward_bytes"] <= (2 * SETUP.n_layers * SETUP.steps * tokens * 2
                                         * SETUP.d_model * 4)
    mem = per_rank[0].value["memory"].memory
    est = ep.estimate_memory(runs["memory"].setup, runs["memory"], 2)
    assert mem["weights"] == est.weights  # experts divided by ep
    assert abs(est.peak / mem["peak"] - 1) < 0.3


def test_routed_moe_without_capacity_is_the_reference_moe():
    cfg = configs.get("tiny-mixtral").with_(d_model=32, d_ff=48)
    torch.manual_seed(0)
    moe = MoE(cfg)
    x = torch.randn(3, 7, 32)
    routed = mr.RoutedMoE(moe)
    assert torch.equal(routed(x), moe(x))
    assert routed.stats.dropped == 0 and int(routed.stats.counts.sum()) == 21 * cfg.top_k
    tight = mr.RoutedMoE(moe, capacity_factor=0.5)
    tight(x)
    cap = mr.capacity(21, cfg.n_experts, cfg.top_k, 0.5)
    assert tight.stats.dropped == int((routed.stats.counts - cap).clamp(min=0).sum()) > 0


def test_capacity_formula():
    assert mr.capacity(512, 8, 2, 1.25) == 160  # ceil(1.25 * 512 * 2 / 8)
    assert mr.capacity(10, 4, 1, 1.0) == 3
    assert mr.capacity(10, 4, 2, None) == 20  # no limit: every assignment fits


@settings(deadline=None, max_examples=40)
@given(tokens=st.integers(1, 40), n_experts=st.integers(2, 8), data=st.data())
def test_capacity_drops_counted_like_a_loop(tokens, n_experts, data):
    top_k = data.draw(st.integers(1, n_experts))
    factor = data.draw(st.floats(0.1, 2.0))
    seed = data.draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    chosen = torch.stack([torch.randperm(n_experts, generator=g)[:top_k] for _ in range(tokens)])
    cap = mr.capacity(tokens, n_experts, top_k, factor)
    keep = mr.keep_mask(chosen, n_experts, cap)
    # the plain loop: first choices of all tokens, then second choices, ...
    used, expected = [0] * n_experts, torch.zeros_like(keep)
    for slot in range(top_k):
        for t in range(tokens):
            e = int(chosen[t, slot])
            if used[e] < cap:
                used[e] += 1
                expected[t, slot] = True
    assert torch.equal(keep, expected)
    counts = mr.expert_counts(chosen, n_experts)
    assert int((~keep).sum()) == int((counts - cap).clamp(min=0).sum())


def test_load_balancing_loss_is_one_when_uniform_and_larger_when_skewed():
    E, T, k = 4, 64, 2
    uniform_probs = torch.full((T, E), 1 / E)
    uniform = mr.load_balancing_loss(uniform_probs, torch.full((E,), T * k // E), k)
    assert uniform.item() == pytest.approx(1.0)
    skewed_probs = torch.tensor([0.7, 0.1, 0.1, 0.1]).expand(T, E)
    skewed = mr.load_balancing_loss(skewed_probs, torch.tensor([T, T // 2, T // 4, T // 4]), k)
    assert skewed.item() > 1.0
    collapsed = mr.load_balancing_loss(torch.eye(E)[[0] * T], torch.tensor([T, 0, 0, 0]), 1)
    assert collapsed.item() == pytest.approx(E)  # top-1: the maximum E, everything on one expert
    logits = torch.randn(T, E)
    weights, chosen, probs = mr.route(logits, k)
    assert torch.allclose(weights.sum(-1), torch.ones(T))
    assert mr.router_z_loss(logits).item() == pytest.approx(
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
    weights, chosen, probs = mr.route(logits, k)
    counts = mr.expert_counts(chosen, E)
    assert counts[:k].tolist() == [T] * k and counts[k:].sum() == 0
    loss = mr.load_balancing_loss(probs, counts, k)
    assert loss.item() == pytest.approx(E / k, rel=1e-6)
    g = torch.Generator().manual_seed(E * 100 + k)
    for _ in range(20):
        logits = torch.randn(T, E, generator=g) * 5
        _, chosen, probs = mr.route(logits, k)
        assert mr.load_balancing_loss(probs, mr.expert_counts(chosen, E), k).item() <= E / k + 1e-6


def test_bad_input():
    with pytest.raises(ValueError, match="do not split over 3 expert-parallel ranks"):
        mr.check_moe(4, 2, ep=3)
    with pytest.raises(ValueError, match="top_k 5 is larger than the number of experts 4"):
        mr.route(torch.randn(3, 4), 5)
    with pytest.raises(ValueError, match="capacity factor must be positive"):
        mr.capacity(10, 4, 2, 0.0)
    with pytest.raises(ValueError, match="capacity factor must be positive"):
        ep.ExpertParallelRun(capacity_factor=-1.0)
    with pytest.raises(ValueError, match="needs a process group"):
        ep.ExpertParallelMoE(MoE(configs.get("tiny-mixtral")))
    with pytest.raises(RuntimeError, match="do not split over 3 expert-parallel ranks"):
        launch.run(harness.sweep, 3, timeout_s=60,
                   args=(harness.Setup(global_batch=9), {"x": ep.ExpertParallelRun()}))
    with pytest.raises(ValueError, match="aux_weight and z_weight must be >= 0"):
        ep.ExpertParallelRun(aux_weight=-0.1)
