import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainbook import launch
from trainbook.parallel import context_parallel as cp
from trainbook.parallel import cp_attention as cpa
from trainbook.parallel import cp_ulysses as uly
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


@pytest.mark.parametrize("kind", cpa.KINDS)
@pytest.mark.parametrize("n", [1, 2, 4])
def test_attention_work_adds_up_and_ulysses_balances_without_zigzag(kind, n):
    work = cpa.attention_work(kind, 48, n, ulysses_degree=min(n, 2))
    assert sum(work) == 48 * 49 // 2
    if kind.startswith("ulysses"):  # every rank attends over the whole sequence for H/n heads
        assert len(set(work)) == 1


def test_ulysses_splits_heads_and_replicates_kv_heads_beyond_their_count():
    assert uly.ulysses_kv_heads(32, 8, 4) == 8  # 2 kv heads per rank
    assert uly.ulysses_kv_heads(32, 8, 8) == 8  # 1 per rank
    assert uly.ulysses_kv_heads(32, 8, 16) == 16  # each kv head sent to 2 ranks
    assert uly.ulysses_kv_heads(32, 8, 32) == 32
    with pytest.raises(ValueError, match="32 query heads divisible by 64"):
        uly.ulysses_kv_heads(32, 8, 64)  # Ulysses caps the degree at the query heads
    with pytest.raises(ValueError, match="4 kv heads cannot be split over 6"):
        uly.ulysses_kv_heads(12, 4, 6)
    with pytest.raises(ValueError, match="not a multiple of 4 kv heads"):
        uly.ulysses_kv_heads(6, 4, 2)


def test_hybrid_grid_rows_are_ulysses_groups_of_consecutive_ranks():
    grid = uly.hybrid_grid(8, 4)
    assert grid == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [list(c) for c in zip(*grid)] == [[0, 4], [1, 5], [2, 6], [3, 7]]  # the rings
    assert uly.hybrid_grid(4, 1) == [[0], [1], [2], [3]] and uly.hybrid_grid(4, 4) == [[0, 1, 2, 3]]


def test_document_mask_is_causal_within_documents():
    doc = cpa.packed_document_ids(3, 24, 4, seed=1)
    assert all(len(row.unique()) == 4 and (row.diff() >= 0).all() for row in doc)
    pos = torch.arange(24)
    mask = cpa.attention_mask(pos, pos, doc, doc)
    assert mask.shape == (3, 1, 24, 24)
    for b in range(3):
        brute = [[j <= i and doc[b, i] == doc[b, j] for j in range(24)] for i in range(24)]
        assert torch.equal(mask[b, 0], torch.tensor(brute))
    one = cpa.attention_mask(pos[8:16], pos, doc[0, 8:16], doc[0])  # a shard's queries, 1 row
    assert torch.equal(one, mask[0, 0, 8:16])
    # the mask matters: attention across documents is a different answer
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 2, 24, 8, generator=g) for _ in range(3))
    assert (cpa.attention(q, k, v, pos, pos, doc, doc) - cpa.attention(q, k, v, pos, pos)
            ).abs().max() > 0.1


LLAMA = dict(seq_len=128 * 1024, heads=32, kv_heads=8, head_dim=128)  # Llama 3 8B, bf16


def test_comm_volume_ulysses_constant_when_sequence_and_ranks_grow_together():
    # Jacobs et al. 2023: 4Nh/P per link, constant when N and P grow proportionally. Per rank
    # here: (P-1)/P of it, with GQA's smaller k and v; ring and all-gather send (P-1) K/V shards.
    s0 = 8192
    vol = {k: [uly.comm_volume(k, **{**LLAMA, "seq_len": s0 * n}, cp=n).sent for n in (2, 4, 8)]
           for k in ("ulysses", "ring", "allgather_kv")}
    ulysses = [v * n / (n - 1) for v, n in zip(vol["ulysses"], (2, 4, 8))]
    assert len(set(ulysses)) == 1 and ulysses[0] == (2 * 4096 + 2 * 1024) * s0 * 2
    assert vol["ring"] == vol["allgather_kv"] == [2 * (n - 1) * 1024 * s0 * 2 for n in (2, 4, 8)]


def test_comm_volume_at_fixed_length_ulysses_shrinks_ring_does_not():
    cps = (2, 4, 8, 16, 32)
    vol = {k: [uly.comm_volume(k, **LLAMA, cp=n, ulysses_degree=min(n, 8)).sent for n in cps]
           for k in uly.SCHEMES}
    assert vol["ulysses"] == sorted(vol["ulysses"], reverse=True)
    assert vol["ring"] == sorted(vol["ring"]) and vol["ring"][-1] < 2 * LLAMA["seq_len"] * 1024 * 2
    # with 4 query heads per kv head, Ulysses sends less than the ring from cp > 5 on
    assert [u < r for u, r in zip(vol["ulysses"], vol["ring"])] == [False, False, True, True, True]
    assert all(h <= u for h, u in zip(vol["hybrid"], vol["ulysses"]))  # no kv replication
    one = uly.comm_volume("ring_zigzag", **LLAMA, cp=4)
    assert one.calls == {"send": 3, "recv": 3} and one.bytes["send"] == one.sent


def test_bad_input():
    q = torch.randn(1, 2, 4)
    with pytest.raises(ValueError, match="not divisible by 8.*zigzag"):
        cpa.shard_positions(36, 4, 0, "zigzag")
    with pytest.raises(ValueError, match="not divisible by 3"):
        cpa.causal_work(32, 3)
    with pytest.raises(ValueError, match="scheme 'striped' is unknown"):
        cpa.shard_positions(32, 2, 0, "striped")
    with pytest.raises(ValueError, match="rank 2 is not in 0..1"):
        cpa.shard_positions(32, 2, 2)
    with pytest.raises(ValueError, match="kind 'deepspeed' is unknown"):
        cpa.check_kind("deepspeed")
    with pytest.raises(ValueError, match="needs a process group"):
        cpa.check_attention("ring")
    with pytest.raises(ValueError, match="kind 'deepspeed' is unknown"):
        cp.ContextParallelRun(kind="deepspeed")
    with pytest.raises(ValueError, match="4 query heads divisible by 3"):
        cpa.check_layout("ulysses_zigzag", 3, 4, 2)
    with pytest.raises(ValueError, match="Ulysses degree 3 does not divide the 4 CP ranks"):
        cpa.check_layout("hybrid", 4, 4, 2, ulysses_degree=3)
    cpa.check_layout("ring", 3, 4, 2)  # the ring has no cap from the heads

    class Mesh:  # build() rejects the layout before it makes a group or a model
        def size(self):
            return 3
    with pytest.raises(ValueError, match="4 query heads divisible by 3"):
        cp.ContextParallelRun(kind="ulysses").build(harness.Setup(), Mesh())
    with pytest.raises(ValueError, match="scheme 'striped' is unknown"):
        uly.comm_volume("striped", 1024, 2, 4, 2, 8)
    with pytest.raises(ValueError, match="does not split over 3 ranks"):
        uly.comm_volume("ring", 1024, 3, 4, 2, 8)
    with pytest.raises(ValueError, match="needs a process group"):
        uly.hybrid_groups(2)
    with pytest.raises(ValueError, match="Ulysses x ring groups"):
        cpa.hybrid_attention(q, q, q, [torch.arange(2)], group=None)
    with pytest.raises(ValueError, match="0 documents in a 8-token row: use 1..8"):
        cpa.packed_document_ids(1, 8, 0)
    with pytest.raises(ValueError, match="for both the queries and the keys"):
        cpa.attention_mask(torch.arange(4), torch.arange(4), torch.zeros(4))
    with pytest.raises(ValueError, match="needs a process group"):
        harness.run(harness.Setup(), cp.ContextParallelRun())
    state = cpa.online_softmax_update(None, q, q, q, torch.zeros(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="attended to no key"):
        cpa.online_softmax_finish(state)


# ---- multi-process: exactness against full attention and against the reference model ----------

TWO = [k for k in cpa.KINDS if not k.startswith("hybrid")]  # the hybrid needs 4 ranks: below
COMM = ("allgather_kv", "ring", "ulysses")


@pytest.fixture(scope="module")
def two_ranks():
    setup = harness.Setup(steps=2)
    variants = {("check", k): cp.attention_check(k) for k in cpa.KINDS}
    variants |= {("documents", k): cp.attention_check(k, documents=3) for k in cpa.KINDS}
    variants |= {("train", k): cp.ContextParallelRun(kind=k) for k in TWO}
    variants |= {("comm", k): cp.comm_probe(k) for k in COMM}
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
            assert o["pairs"] == cpa.attention_work(kind, 32, 2)[rank]
            d = outs["documents", kind]  # the same, with a document mask in reference and CP
            assert max(d["out"], d["dq"], d["dk"], d["dv"]) < 1e-5, d
            assert d["pairs"] < 2 * o["pairs"]  # 2 rows, fewer pairs each: the mask is used


def test_forward_communication_matches_the_formula_on_two_ranks(two_ranks):
    setup, _, per_rank = two_ranks
    for outs in per_rank:
        for kind in COMM:
            want = cp.setup_comm_volume(kind, setup, 2)
            got = outs["comm", kind]
            assert got["calls"] == want.calls and got["bytes"] == want.bytes, (kind, got, want)


def test_cp_training_matches_the_reference(two_ranks):
    setup, variants, per_rank = two_ranks
    ref = harness.reference(setup)
    for rank, outs in enumerate(per_rank):
        for kind in TWO:
            o = outs["train", kind]
            d = harness.max_differences(o.trace, ref)
            assert d["loss"] < 1e-5 and d["grad"] < 1e-6 and d["param"] < 1e-6, (kind, d)
            assert o["pairs_per_layer"] == cpa.attention_work(kind, setup.seq_len, 2)[rank]


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


def test_four_ranks_zigzag_hybrid_ulysses_exact_and_gpt2_adamw_training():
    # the gpt2 flavour takes the learned-position path (global positions looked up per rank)
    s = harness.Setup(flavour="gpt2", n_kv_heads=4, optimizer="adamw", steps=2)
    kinds = ("allgather_kv_zigzag", "ring_zigzag", "ulysses", "hybrid", "hybrid_zigzag")
    variants = {("check", k): cp.attention_check(k) for k in kinds}  # ulysses: kv replicated
    variants |= {("documents", k): cp.attention_check(k, documents=5)
                 for k in ("ring_zigzag", "ulysses_zigzag", "hybrid_zigzag")}
    variants |= {("train", k): cp.ContextParallelRun(kind=k) for k in ("ring_zigzag",
                                                                       "hybrid_zigzag")}
    variants |= {("comm", k): cp.comm_probe(k) for k in ("ring", "ulysses", "hybrid")}
    res = launch.run(harness.sweep, 4, args=(s, variants), timeout_s=240)
    ref = harness.reference(s)
    for r in res:
        for k, o in r.value.items():
            if k[0] in ("check", "documents"):
                assert max(o["out"], o["dq"], o["dk"], o["dv"]) < 1e-5, o
            elif k[0] == "train":
                d = harness.max_differences(o.trace, ref)
                assert d["loss"] < 1e-5 and d["grad"] < 1e-6 and d["param"] < 1e-4, (k, d)  # Adam
                assert o["pairs_per_layer"] == cpa.attention_work(k[1], 32, 4)[r.rank]
            else:
                want = cp.setup_comm_volume(k[1], s, 4)
                assert o["calls"] == want.calls and o["bytes"] == want.bytes, (k, o, want)
        for k in kinds:
            assert r.value["check", k]["pairs"] == cpa.attention_work(k, 32, 4)[r.rank]
    pairs = [r.value["check", "allgather_kv_zigzag"]["pairs"] for r in res]
    assert len(set(pairs)) == 1 and pairs == cpa.causal_work(32, 4, "zigzag")
