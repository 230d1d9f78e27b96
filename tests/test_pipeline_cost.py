"""Pipeline schedules in closed form (trainbook.parallel.pipeline_cost): the published bubble
and memory forms, their consistency with the unit-slot bubble, p2p traffic and DP hiding."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainbook.parallel import pipeline_cost as pc
from trainbook.parallel import pipeline_schedules as schedules

EQUAL = pc.StageTimes(1.0, 1.0, 1.0)


@given(p=st.integers(2, 64), m=st.integers(1, 256))
def test_1f1b_matches_the_unit_slot_bubble(p, m):
    assert pc.step("1f1b", p, m, EQUAL)["bubble_fraction"] == pytest.approx(
        schedules.bubble_fraction(p, m))


@given(p=st.integers(2, 64), m=st.integers(1, 256), v=st.integers(1, 8))
def test_interleaving_divides_the_bubble(p, m, v):
    assert pc.bubble("interleaved", p, EQUAL, v) == pytest.approx(pc.bubble("1f1b", p, EQUAL) / v)
    assert pc.step("interleaved", p, m, EQUAL, v)["bubble_fraction"] == pytest.approx(
        schedules.bubble_fraction(p, m, v))


@pytest.mark.parametrize("p", [2, 4, 8, 16, 64])
def test_zero_bubble_forms_at_equal_times(p):
    # Qi et al. Section 2: ZB-H1 a third of 1F1B's bubble at 1F1B's memory, ZB-H2 none at 2p-1
    assert pc.bubble("zb-h1", p, EQUAL) == pytest.approx(pc.bubble("1f1b", p, EQUAL) / 3)
    assert pc.bubble("zb-h2", p, EQUAL) == 0
    assert pc.memory("zb-h1", p)["activations_MB"] == pc.memory("1f1b", p)["activations_MB"] == p
    assert pc.memory("zb-h2", p)["activations_MB"] == 2 * p - 1
    # DualPipe's README row: ZB1P is (PP-1)(F+B-2W), the same as ZB-H1's (p-1)(F+I-W)
    t = pc.StageTimes(1.0, 0.7, 1.3)
    assert pc.bubble("zb-h1", p, t) == pytest.approx((p - 1) * (t.F + t.B - 2 * t.W))


def test_dualpipe():
    assert pc.bubble("dualpipe", 16, EQUAL) == pytest.approx(7 * (3 + 2 - 3))
    overlapped = pc.StageTimes(1.0, 1.0, 1.0, FB=2.5)  # F and B overlap: F&B < F + B
    assert pc.bubble("dualpipe", 16, overlapped) < pc.bubble("dualpipe", 16, EQUAL)
    assert pc.memory("dualpipe", 16) == {"activations_MB": 17, "parameters": 2}


@pytest.mark.parametrize("p, v", [(4, 2), (16, 2), (16, 4), (8, 3)])
def test_interleaved_memory_is_megatrons_factor(p, v):
    # PyTorch's warm-up count gives p (1 + (p - 1) / (p v)) micro-batch activations on rank 0
    assert pc.memory("interleaved", p, v)["activations_MB"] == pytest.approx(
        p * (1 + (p - 1) / (p * v)))


def test_from_ratio():
    t = pc.StageTimes.from_ratio(2.0, 2.0, 0.5)
    assert (t.F, t.I, t.W, t.B) == (2.0, 2.0, 2.0, 4.0)


def test_p2p_is_small_against_compute_and_scales():
    a = pc.p2p("llama-3-405b", 1, 8192, m=32, p=16, tp=8)
    assert a["message_bytes"] == 8192 * 16384 * 2 / 8
    assert a["bytes_per_step"] == 2 * 32 * a["message_bytes"]
    assert a["send_over_forward"] < 0.02
    b = pc.p2p("llama-3-405b", 1, 8192, m=32, p=16, tp=8, v=4)
    assert b["bytes_per_step"] == 4 * a["bytes_per_step"]
    assert b["send_over_forward"] == pytest.approx(4 * a["send_over_forward"])


def test_dp_exposed():
    t = pc.StageTimes.from_ratio(1.0)
    assert pc.dp_exposed(1.5, t) == 0
    assert pc.dp_exposed(5.0, t) == pytest.approx(3.0)


@pytest.mark.parametrize("call, match", [
    (lambda: pc.bubble("gpipe", 4, EQUAL), "schedule must be one of"),
    (lambda: pc.bubble("1f1b", 0, EQUAL), "p must be a positive integer"),
    (lambda: pc.bubble("dualpipe", 5, EQUAL), "even number of stages"),
    (lambda: pc.bubble("zb-h1", 4, EQUAL, v=2), "applies to the interleaved"),
    (lambda: pc.step("1f1b", 4, 0, EQUAL), "m must be a positive integer"),
    (lambda: pc.StageTimes(-1.0, 1.0, 1.0), "stage time F must be >= 0"),
    (lambda: pc.StageTimes(1.0, 1.0, 1.0, FB=5.0), "overlapped F&B"),
    (lambda: pc.StageTimes.from_ratio(weight_share=1.5), "weight_share"),
    (lambda: pc.p2p("llama-3-8b", 1, 8192, 8, p=1), "p >= 2"),
    (lambda: pc.p2p("llama-3-8b", 1, 8192, 8, p=4, mfu=0), "mfu must be in"),
    (lambda: pc.dp_exposed(-1.0, EQUAL), "dp_comm_s must be >= 0"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()
