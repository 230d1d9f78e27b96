"""The overlap thresholds against hand-derived formulas on tiny configs, the trace reading on a
hand-made trace, and DDP's overlap measured on two gloo ranks (structural facts only)."""

import pytest

from trainbook import configs, hardware, launch
from trainbook.parallel import overlap

H100 = hardware.get("h100-sxm")
F = 0.5 * 989.4e12  # half the H100's dense bf16 peak
RING, NVLS, NIC = 370e9, 480e9, 50e9  # the table's ring and all-reduce busbw, the NIC
TINY = configs.get("tiny-llama")  # d 128, 4 layers, 4 heads of 32, 2 kv heads, d_ff 352
# one block by hand: q, k, v, o + gate, up, down + two RMSNorm weights
P = 128 * 128 + 2 * 128 * 64 + 128 * 128 + 3 * 128 * 352 + 2 * 128


def test_table_figures_are_what_the_tests_assume():
    assert H100.peak_flops("bf16") == 989.4e12 and H100.nic_gbps == 50.0
    assert H100.busbw_gbps("all_gather") == H100.busbw_gbps("reduce_scatter") == 370.0
    assert H100.busbw_gbps("all_reduce") == 480.0 and H100.busbw_gbps("send") == 370.0
    assert overlap.achieved_flops(H100) == pytest.approx(F)
    assert overlap.bandwidth("h100-sxm", "all_gather", "nic") == NIC


def test_block_params_by_hand():
    assert overlap.block_params(TINY) == (P, P)
    moe = configs.get("tiny-mixtral")  # 4 experts of d_ff 176, top 2, a router
    expert, router = 3 * 128 * 176, 128 * 4
    stored, active = overlap.block_params(moe)
    assert stored == 128 * 128 * 2 + 2 * 128 * 64 + 4 * expert + router + 2 * 128
    assert stored - active == 2 * expert


def test_fsdp_threshold_is_f_over_w_times_n_minus_one_over_n():
    for n, over, w in ((8, "domain", RING), (64, "nic", NIC), (2, "domain", RING)):
        assert overlap.fsdp_min_tokens(TINY, H100, n, over) == pytest.approx(F / w * (n - 1) / n)
    # fp32 reduce-scatter: the backward (2 + 4 bytes against 4 FLOPs) binds, 1.5x
    fp32 = overlap.fsdp_min_tokens(TINY, H100, 8, reduce_dtype="fp32")
    assert fp32 == pytest.approx(1.5 * F / RING * 7 / 8)
    # with the causal attention core: 6P + 3 x 4 H d_h (T + 1) / 2 FLOPs per token
    T = 64
    core = 3 * 4 * 4 * 32 * (T + 1) / 2
    with_core = overlap.fsdp_min_tokens(TINY, H100, 8, seq_len=T)
    assert with_core == pytest.approx(F / RING * 7 / 8 * 6 * P / (6 * P + core))
    # a mixture of experts gathers every expert but computes with top_k of them
    moe = configs.get("tiny-mixtral")
    stored, active = overlap.block_params(moe)
    assert overlap.fsdp_min_tokens(moe, H100, 8) == pytest.approx(F / RING * 7 / 8
                                                                 * stored / active)
    assert overlap.fsdp_min_tokens(TINY, H100, 1) == 0.0  # one rank moves nothing


def test_fsdp_step_crosses_at_the_threshold():
    b = overlap.fsdp_min_tokens(TINY, H100, 8)
    at = overlap.fsdp_step(TINY, H100, 8, b)
    assert at["compute"] == pytest.approx(at["comm"]) and at["exposed"] == pytest.approx(0)
    assert at["compute"] == pytest.approx(4 * 6 * P * b / F)
    assert at["comm"] == pytest.approx(4 * 3 * 2 * P * 7 / 8 / RING)
    below, above = overlap.fsdp_step(TINY, H100, 8, b / 2), overlap.fsdp_step(TINY, H100, 8, 2 * b)
    assert below["exposed"] == pytest.approx(below["comm"] - below["compute"])
    assert above["exposed"] == 0.0
    slow = overlap.fsdp_step(TINY, H100, 8, b, alpha_s=1e-6)  # 7 ring steps per collective
    assert slow["comm"] - at["comm"] == pytest.approx(4 * 3 * 7 * 1e-6)


def test_dp_threshold_and_the_most_ranks_a_batch_allows():
    for n, over, w in ((8, "domain", NVLS), (64, "nic", NIC)):
        assert overlap.dp_min_tokens(TINY, H100, n, over) == pytest.approx(F / w * (n - 1) / n)
    assert overlap.dp_min_tokens(TINY, H100, 8, grad_dtype="fp32") == \
        pytest.approx(2 * F / NVLS * 7 / 8)
    k = F / NIC  # n <= 1 + B / K
    assert overlap.dp_max_ranks(TINY, H100, 4 * 2**20) == int(1 + 4 * 2**20 // k)
    n = overlap.dp_max_ranks(TINY, H100, 4 * 2**20)
    assert 4 * 2**20 / n >= overlap.dp_min_tokens(TINY, H100, n, "nic")
    assert 4 * 2**20 / (n + 1) < overlap.dp_min_tokens(TINY, H100, n + 1, "nic")


def test_tp_ratio_by_hand():
    act = 2 * 128  # bf16 bytes of one token's activation
    for t in (2, 4):
        comm = 4 * 2 * (t - 1) / t * act / NVLS
        assert overlap.tp_ratio(TINY, H100, t) == pytest.approx(comm / (6 * P / t / F))
        sp = 4 * 2 * (t - 1) / t * act / RING  # an all-gather and a reduce-scatter per all-reduce
        assert overlap.tp_ratio(TINY, H100, t, sequence_parallel=True) == \
            pytest.approx(sp / (6 * P / t / F))
    width = overlap.tp_min_width(TINY, H100)
    assert width == pytest.approx(8 * F * 128**2 / (3 * P * NVLS))  # 4aF h^2 / (3 P W), a = 2
    # the ratio is (t - 1) x width / h, times the slower link's factor
    assert overlap.tp_ratio(TINY, H100, 8, "nic") == pytest.approx(7 * width / 128 * NVLS / NIC)


def test_cp_chunk_by_hand():
    # K and V of a token: 2 x 2 kv heads x 32 x 2 bytes; work per query-key pair 4 x 4 x 32 FLOPs
    assert overlap.cp_min_chunk(TINY, H100, causal=False) == \
        pytest.approx(F / RING * (2 * 2 * 32 * 2) / (4 * 4 * 32))
    assert overlap.cp_min_chunk(TINY, H100, "nic") == pytest.approx(2 * F / NIC * 2 / 4)


def test_trace_overlap_on_a_hand_made_trace():
    c, acc = overlap.EVENTS["compute"], overlap.EVENTS["accumulate"]
    ar, launch_ = overlap.EVENTS["allreduce"], overlap.EVENTS["launch"]
    events = [(c + "MmBackward0", 0.0, 2.0), (c + "MmBackward0", 1.0, 3.0), (acc, 3.0, 3.5),
              (launch_, 3.2, 3.3), (c + "EmbeddingBackward0", 4.0, 6.0),
              (ar, 2.5, 4.5), (ar, 4.2, 5.0), (ar, 6.5, 7.0), ("aten::mm", 0.0, 9.0)]
    r = overlap.trace_overlap(events)
    # compute [0, 3] u [4, 6]; all-reduce [2.5, 5] u [6.5, 7]: 3 s, of which 0.5 + 1 overlap
    assert r["allreduces"] == 3 and r["allreduce_s"] == pytest.approx(3.0)
    assert r["overlap_s"] == pytest.approx(1.5) and r["fraction"] == pytest.approx(0.5)
    assert r["backward_s"] == pytest.approx(5.0) and r["backward_span_s"] == pytest.approx(6.0)
    assert r["started_before_end"] == 2 and r["last_end_s"] == pytest.approx(7.0)
    assert r["found"] == {"compute": 4, "accumulate": 1, "launch": 1, "allreduce": 3}
    assert r["compute"] == [(0.0, 3.0), (4.0, 6.0)] and r["comm"][0] == (2.5, 4.5)
    with pytest.raises(ValueError, match="no 'gloo:all_reduce' event"):
        overlap.trace_overlap([e for e in events if e[0] != ar])
    with pytest.raises(ValueError, match="EVENTS updated"):
        overlap.trace_overlap([(ar, 0.0, 1.0)])


def test_ddp_overlap_on_two_ranks():
    cfg = TINY.with_(n_layers=2, vocab_size=256)
    mib = 4 * configs.param_counts(cfg)["total"] / 2**20
    caps = {"many": mib / 10, "one": 2 * mib}
    ranks = launch.run(overlap.profile_ddp_overlap, 2, args=(cfg, caps),
                       kwargs=dict(seq_len=32, batch=2), timeout_s=120)
    for r in ranks:
        many, one = r.value["many"], r.value["one"]
        for out in (many, one):
            assert all(out["found"].values()), out["found"]  # every name the reading needs
            assert 0.0 <= out["fraction"] <= 1.0
            assert out["grad_mib"] == pytest.approx(mib)
        assert many["allreduces"] > 3 and many["started_before_end"] >= 1
        assert one["allreduces"] == 1 and one["started_before_end"] == 0
        assert one["overlap_s"] == 0.0 and one["first_start_s"] >= one["backward_span_s"]


def test_bad_input():
    with pytest.raises(ValueError, match="must be a ModelConfig"):
        overlap.block_params("llama-3-8b")
    with pytest.raises(ValueError, match="unknown accelerator"):
        overlap.fsdp_min_tokens(TINY, "h900", 8)
    with pytest.raises(ValueError, match="entry of hardware.SPECS"):
        overlap.fsdp_min_tokens(TINY, 3, 8)
    with pytest.raises(ValueError, match="do not fit in one h100-sxm scale-up domain of 8"):
        overlap.fsdp_min_tokens(TINY, H100, 64)
    with pytest.raises(ValueError, match="n must be a whole number >= 1"):
        overlap.dp_min_tokens(TINY, H100, 0)
    with pytest.raises(ValueError, match="t must be a whole number >= 1"):
        overlap.tp_ratio(TINY, H100, 2.5)
    with pytest.raises(ValueError, match=r"mfu must be in \(0, 1\]"):
        overlap.cp_min_chunk(TINY, H100, mfu=1.5)
    with pytest.raises(ValueError, match="over must be 'domain'"):
        overlap.bandwidth(H100, "all_gather", "pcie")
    with pytest.raises(ValueError, match="has no NIC"):
        overlap.bandwidth("h100-pcie", "all_gather", "nic")
    with pytest.raises(ValueError, match="unknown collective"):
        overlap.bandwidth(H100, "gather", "nic")
    with pytest.raises(ValueError, match="unknown dtype"):
        overlap.fsdp_min_tokens(TINY, H100, 8, reduce_dtype="fp64")
    with pytest.raises(ValueError, match="tokens_per_gpu must be positive"):
        overlap.fsdp_step(TINY, H100, 8, 0)
    with pytest.raises(ValueError, match="global_batch_tokens must be a whole number"):
        overlap.dp_max_ranks(TINY, H100, 0)
    with pytest.raises(ValueError, match="runs inside a process group"):
        overlap.profile_ddp_overlap(TINY, {"one": 1.0})
