import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainbook import launch
from trainbook.parallel import harness
from trainbook.parallel import pipeline as pp
from trainbook.parallel import pipeline_schedules as ps

SETUP = harness.Setup(n_layers=4, steps=2)  # 4 layers: 2 stages, or 2 ranks x 2 chunks


@pytest.fixture(scope="module")
def runs():
    """Every schedule in one launch (starting processes costs more than these tiny runs)."""
    variants = {k: pp.PipelineRun(kind=k, microbatches=4) for k in pp.KINDS}
    per_rank = launch.run(harness.sweep, 2, args=(SETUP, variants), timeout_s=240)
    return {k: [r.value[k] for r in per_rank] for k in variants}


@pytest.fixture(scope="module")
def ref():
    return harness.reference(SETUP)


@pytest.mark.parametrize("kind", pp.KINDS)
def test_schedules_match_single_process(runs, ref, kind):
    for out in runs[kind]:  # every rank returns the gathered trace
        d = harness.max_differences(out.trace, ref)
        assert d["loss"] < 1e-5 and d["grad"] < 1e-6 and d["param"] < 1e-6, (kind, d)  # SGD: exact


def test_in_flight_gpipe_m_and_1f1b_p_minus_stage(runs):
    assert runs["gpipe"][0]["in_flight"] == [4, 4]
    assert runs["1f1b"][0]["in_flight"] == [2, 1]  # p - stage


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "native-1f1b", "native-interleaved"])
def test_timestamps_are_well_formed(runs, kind):
    events = runs[kind][0]["events"]
    m, stages = 4, {e["stage"] for rank in events for e in rank}
    at = {(e["stage"], e["op"], e["mb"]): e for rank in events for e in rank}
    for s in stages:
        for i in range(m):
            f, b = at[(s, "F", i)], at[(s, "B", i)]
            assert f["start"] <= f["end"] <= b["start"] <= b["end"]
            if s + 1 in stages:  # the next stage's forward needs this stage's output
                assert at[(s + 1, "F", i)]["start"] >= f["end"]  # one clock on one host
                assert b["start"] >= at[(s + 1, "B", i)]["end"]
    for rank in events:  # one rank computes one thing at a time
        spans = sorted((e["start"], e["end"]) for e in rank)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def test_zero_bubble_splits_backward_and_plans(runs):
    out = runs["native-zero-bubble"][0]
    ops = {e["op"] for rank in out["events"] for e in rank}
    assert {"F", "I", "W"} <= ops  # backward split into input and weight gradients
    plan = out["planned"]
    assert sorted(plan) == [0, 1]
    # V shape: rank 0 holds stages 0 and 3; each runs every micro-batch's F, I and W once
    for rank, stages in ((0, (0, 3)), (1, (1, 2))):
        acts = [a for a in plan[rank] if a]
        for s in stages:
            for op in "FIW":
                assert sorted(a for a in acts if a.startswith(f"{s}{op}")) == \
                    [f"{s}{op}{i}" for i in range(4)]


def test_schedule_order_and_bubble():
    assert ps.schedule_order("1f1b", 4, 8, 3)[:4] == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    order = ps.schedule_order("1f1b", 4, 8, 0)
    assert order[:4] == [("F", 0), ("F", 1), ("F", 2), ("F", 3)]  # p - 1 warm-up, then 1F1B
    for kind in ps.SCRATCH:
        for s in range(4):
            o = ps.schedule_order(kind, 4, 8, s)
            assert sorted(o) == sorted([("F", i) for i in range(8)] + [("B", i) for i in range(8)])
            assert all(o.index(("F", i)) < o.index(("B", i)) for i in range(8))
    assert ps.bubble_fraction(2, 4) == pytest.approx(1 / 5)
    assert ps.bubble_over_compute(8, 32) == pytest.approx(7 / 32)
    assert ps.bubble_over_compute(8, 32, v=2) == pytest.approx(7 / 64)  # Megatron Sec 2.2.2


def test_tied_gpt2_and_memory():
    s = harness.Setup(flavour="gpt2", n_kv_heads=4, n_layers=2, steps=1)
    variants = {k: pp.PipelineRun(kind=k, microbatches=4, measure_memory=True)
                for k in ("1f1b", "gpipe")}
    per_rank = launch.run(harness.sweep, 2, args=(s, variants), timeout_s=240)
    ref = harness.reference(s)
    d = harness.max_differences(per_rank[0].value["1f1b"].trace, ref)
    assert d["grad"] < 1e-6 and d["param"] < 1e-6, d  # tied embedding: grads summed over stages
    one = [r.value["1f1b"].memory for r in per_rank]  # by rank, that is by stage
    gpipe = [r.value["gpipe"].memory for r in per_rank]
    for mem in one + gpipe:
        assert mem["peak"] > mem["weights"] > 0
    # stage 0 holds 4 micro-batches under GPipe, 2 under 1F1B
    assert gpipe[0]["activations"] > one[0]["activations"]


@settings(deadline=None, max_examples=50)
@given(p=st.integers(2, 16), extra=st.integers(0, 40), data=st.data())
def test_schedule_orders_are_valid_and_bound_memory(p, extra, data):
    m = p + extra
    stage = data.draw(st.integers(0, p - 1))
    for kind, bound in (("gpipe", m), ("1f1b", p - stage)):
        order = ps.schedule_order(kind, p, m, stage)
        assert [i for op, i in order if op == "F"] == list(range(m))  # in micro-batch order
        assert [i for op, i in order if op == "B"] == list(range(m))
        live, peak = set(), 0
        for op, i in order:
            live.add(i) if op == "F" else live.remove(i)  # B of i only after F of i
            peak = max(peak, len(live))
        assert peak == bound


def test_bad_input():
    with pytest.raises(ValueError, match="do not split into 3 equal stages"):
        pp.split_model(harness.build_model(SETUP), 3, 0)
    with pytest.raises(ValueError, match="one of"):
        ps.schedule_order("zb", 2, 4, 0)
    with pytest.raises(ValueError, match="positive integer"):
        ps.bubble_fraction(0, 4)
    with pytest.raises(ValueError, match="needs a process group"):
        harness.run(SETUP, pp.PipelineRun())
    with pytest.raises(ValueError, match="kind must be one of"):
        pp.PipelineRun(kind="dualpipe")
    with pytest.raises(ValueError, match="needs at least 2 micro-batches"):
        pp.validate(SETUP, "1f1b", 1, 2)
    with pytest.raises(ValueError, match="needs microbatches >= 2"):
        pp.validate(SETUP, "native-zero-bubble", 1, 2)
    with pytest.raises(ValueError, match="2 layers do not split into 4 equal stages"):
        pp.validate(harness.Setup(n_layers=2), "native-interleaved", 4, 2)
    with pytest.raises(ValueError, match="does not split into 3 micro-batches"):
        pp.validate(SETUP, "gpipe", 3, 2)
    with pytest.raises(ValueError, match="kind must be one of"):
        pp.validate(SETUP, "dualpipe", 4, 2)
