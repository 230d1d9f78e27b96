import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainbook import launch
from trainbook.parallel import context_parallel as cp
from trainbook.parallel import cp_attention as cpa
from trainbook.parallel import harness

# ---- single process: the online softmax, sharding and the work count ----------------------------

@settings(deadline=None, max_examples=40)
@given(tq=st.integers(1, 12), tk=st.integers(1, 24), d=st.integers(1, 8),
       cuts=st.lists(st.integers(1, 23), max_size=5), causal=st.booleans(),
       shuffle=st.integers(0, 2**16), seed=st.integers(0, 2**16))
def test_online_softmax_is_exact(tq, tk, d, cuts, causal, shuffle, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, tq, d, generator=g, dtype=torch.float64) * 3
    k = torch.randn(2, tk, d, generator=g, dtype=torch.float64) * 3
    v = torch.randn(2, tk, d, generator=g, dtype=torch.float64)
    # queries sit at the end of the key sequence, so every query sees at least one key
    q_pos, k_pos = torch.arange(tk - tq, tk) if tq <= tk else torch.arange(tq), torch.arange(tk)
    mask = cpa.causal_mask(q_pos, k_pos) if causal else torch.ones(tq, tk, dtype=torch.bool)
    if not mask.any(-1).all():
        return
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    edges = sorted({0, tk, *[c for c in cuts if c < tk]})
    blocks = list(zip(edges[:-1], edges[1:]))
    order = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(shuffle))
    state = None
    for i in order.tolist():  # any block order gives the same answer
        a, b = blocks[i]
        state = cpa.online_softmax_update(state, q, k[:, a:b], v[:, a:b], mask[:, a:b])
    out, lse = cpa.online_softmax_finish(state)
    scores = (q @ k.transpose(-2, -1) / d ** 0.5).masked_fill(~mask, float("-inf"))
    assert torch.allclose(out, ref, atol=1e-10, rtol=0)
    assert torch.allclose(lse.squeeze(-1), scores.logsumexp(-1), atol=1e-10, rtol=0)


def test_online_softmax_gradients_match_softmax_attention():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 16, 8, generator=g, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    pos = torch.arange(16)
    ref = cpa.attention(q, k, v, pos, pos)
    grads_ref = torch.autograd.grad(ref.square().sum(), (q, k, v))
    state = None
    for a in (12, 4, 0, 8):  # blocks out of order; block 12..16 hides rows 0..11 entirely
        mask = cpa.causal_mask(pos, pos[a:a + 4])
        state = cpa.online_softmax_update(state, q, k[:, a:a + 4], v[:, a:a + 4], mask)
    out = cpa.online_softmax_finish(state)[0]
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    assert torch.allclose(out, ref, atol=1e-12)
    for a, b in zip(grads, grads_ref):
        assert torch.isfinite(a).all() and torch.allclose(a, b, atol=1e-10)


@pytest.mark.parametrize("scheme", cpa.SCHEMES)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_shards_cover_the_sequence_and_work_matches_the_mask(scheme, n):
    T = 48
    positions = [cpa.shard_positions(T, n, r, scheme) for r in range(n)]
    assert torch.equal(torch.cat(positions).sort().values, torch.arange(T))
    counted = [int(cpa.causal_mask(p, torch.arange(T)).sum()) for p in positions]
    assert counted == cpa.causal_work(T, n, scheme)
    assert sum(counted) == T * (T + 1) // 2


def test_zigzag_balances_the_causal_work():
    contiguous, zigzag = cpa.causal_work(1024, 4), cpa.causal_work(1024, 4, "zigzag")
    assert len(set(zigzag)) == 1
    assert contiguous == sorted(contiguous) and contiguous[-1] > 6 * contiguous[0]
    # contiguous: rank r does (2r+1)/(2n) of the mean work, about; the last rank sets the pace
    assert max(contiguous) / (sum(contiguous) / 4) == pytest.approx(7 / 4, rel=0.01)


def test_bad_input():
    with pytest.raises(ValueError, match="not divisible by 8.*zigzag"):
        cpa.shard_positions(36, 4, 0, "zigzag")
    with pytest.raises(ValueError, match="not divisible by 3"):
        cpa.causal_work(32, 3)
    with pytest.raises(ValueError, match="scheme 'striped' is unknown"):
        cpa.shard_positions(32, 2, 0, "striped")
    with pytest.raises(ValueError, match="rank 2 is not in 0..1"):
        cpa.shard_positions(32, 2, 2)
    with pytest.raises(ValueError, match="kind 'ulysses' is unknown"):
        cpa.check_kind("ulysses")
    with pytest.raises(ValueError, match="needs a process group"):
        cpa.check_attention("ring")
    with pytest.raises(ValueError, match="kind 'ulysses' is unknown"):
        cp.ContextParallelRun(kind="ulysses")
    with pytest.raises(ValueError, match="needs a process group"):
        harness.run(harness.Setup(), cp.ContextParallelRun())
    q = torch.randn(1, 2, 4)
    state = cpa.online_softmax_update(None, q, q, q, torch.zeros(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="attended to no key"):
        cpa.online_softmax_finish(state)


# ---- multi-process: exactness against full attention and against the reference model ----------

@pytest.fixture(scope="module")
def two_ranks():
    setup = harness.Setup(steps=2)
    variants = {("check", k): cp.attention_check(k) for k in cpa.KINDS}
    variants |= {("train", k): cp.ContextParallelRun(kind=k) for k in cpa.KINDS}
    variants["memory"] = cp.ContextParallelRun(
        kind="allgather_kv", measure_memory=True,
        setup=dataclasses.replace(setup, steps=1, optimizer="adamw"))
    variants["official"] = cp.official_api_probe()
    res = launch.run(harness.sweep, 2, args=(setup, variants), timeout_s=240)
    return setup, variants, [r.value for r in res]


def test_cp_attention_forward_and_backward_exact_on_two_ranks(two_ranks):
    setup, variants, per_rank = two_ranks
    for rank, outs in enumerate(per_rank):
        for kind in cpa.KINDS:
            o = outs["check", kind]
            assert max(o["out"], o["dq"], o["dk"], o["dv"]) < 1e-5, o
            scheme = "zigzag" if "zigzag" in kind else "contiguous"
            assert o["pairs"] == cpa.causal_work(32, 2, scheme)[rank]


def test_cp_training_matches_the_reference(two_ranks):
    setup, variants, per_rank = two_ranks
    ref = harness.reference(setup)
    for rank, outs in enumerate(per_rank):
        for kind in cpa.KINDS:
            o = outs["train", kind]
            d = harness.max_differences(o.trace, ref)
            assert d["loss"] < 1e-5 and d["grad"] < 1e-6 and d["param"] < 1e-6, (kind, d)
            scheme = "zigzag" if "zigzag" in kind else "contiguous"
            assert o["pairs_per_layer"] == cpa.causal_work(setup.seq_len, 2, scheme)[rank]


def test_memory_per_rank_close_to_the_estimator(two_ranks):
    setup, _, per_rank = two_ranks
    est = cp.estimate_memory(setup, 2).peak
    for outs in per_rank:
        mem = outs["memory"].memory
        assert mem["peak"] > 0 and abs(est / mem["peak"] - 1) < 0.15, (mem, est)


def test_official_api_fails_on_cpu_with_a_real_error(two_ranks):
    _, _, per_rank = two_ranks
    probe = per_rank[0]["official"]
    # torch 2.13 CPU: no sharding rule for the CPU flash kernel, and the math kernel mixes types.
    # If a later torch makes it work, this test says so: update the chapter.
    assert "sharding strategy" in probe["FLASH_ATTENTION"], probe
    assert probe["MATH"] != "works", probe


def test_four_ranks_zigzag_exact_and_gpt2_adamw_training():
    # the gpt2 flavour takes the learned-position path (global positions looked up per rank)
    s = harness.Setup(flavour="gpt2", n_kv_heads=4, optimizer="adamw", steps=2)
    variants = {k: cp.attention_check(k) for k in ("allgather_kv_zigzag", "ring_zigzag")}
    variants["train"] = cp.ContextParallelRun(kind="ring_zigzag")
    res = launch.run(harness.sweep, 4, args=(s, variants), timeout_s=240)
    ref = harness.reference(s)
    for r in res:
        for k in ("allgather_kv_zigzag", "ring_zigzag"):
            o = r.value[k]
            assert max(o["out"], o["dq"], o["dk"], o["dv"]) < 1e-5, o
        d = harness.max_differences(r.value["train"].trace, ref)
        assert d["loss"] < 1e-5 and d["grad"] < 1e-6 and d["param"] < 1e-4, d  # Adam: see DP tests
    pairs = [r.value["allgather_kv_zigzag"]["pairs"] for r in res]
    assert len(set(pairs)) == 1 and pairs == cpa.causal_work(32, 4, "zigzag")
