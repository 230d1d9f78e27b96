"""Planted hangs on real gloo ranks (book/failures/hangs): each one times out within its short
process-group timeout, and the collective tracer's message names the rank that is behind or
disagrees and the operation; TORCH_DISTRIBUTED_DEBUG=DETAIL names the mismatch before it hangs;
SIGUSR2 makes every rank of a hung torchrun job print where it waits; the tools reject bad input."""

import json
import textwrap
from pathlib import Path

import pytest

from trainbook.failures import hangs, stacks
from trainbook.failures.hangs import Position, diagnose

DATA = Path(__file__).resolve().parents[1] / "book" / "failures" / "data"
RUNS = [("skip", False), ("order", False), ("stall", False), ("uneven", False),
        ("uneven-join", False), ("skip", True), ("order", True)]
TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def rows():
    return {(r["scenario"], r["detail"], r["rank"]): r
            for r in hangs.planted_hangs(RUNS, TIMEOUT_S)}


def test_every_planted_hang_times_out_and_the_tracer_names_the_rank_and_op(rows):
    skip = rows["skip", False, 0]
    assert "Timed out" in skip["message"]
    assert "rank 0 timed out in all_reduce #8" in skip["diagnosis"]
    assert "rank 1 last entered all_reduce #7" in skip["diagnosis"] and "skipped" in \
        skip["diagnosis"]
    for me, other, mine, theirs in ((0, 1, "all_reduce", "broadcast"),
                                    (1, 0, "broadcast", "all_reduce")):
        d = rows["order", False, me]["diagnosis"]
        assert f"rank {me} timed out in {mine} #1" in d and f"rank {other} is in {theirs} #1" \
            in d and "mismatch" in d
    stall = rows["stall", False, 0]["diagnosis"]
    assert "rank 1 is in all_reduce #2" in stall and "outside any collective" in stall
    uneven = rows["uneven", False, 1]["diagnosis"]
    assert "rank 1 timed out in barrier" in uneven and "rank 0 is in all_reduce" in uneven


def test_join_and_detail(rows):
    assert rows["uneven-join", False, 0]["error"] is None  # DDP's join() prevents the hang
    assert rows["uneven-join", False, 1]["error"] is None
    assert "Ranks 1 failed to pass monitoredBarrier" in rows["skip", True, 0]["message"]
    order = rows["order", True, 0]
    assert "Detected mismatch between collectives" in order["message"]
    assert "ALLREDUCE" in order["message"] and "BROADCAST" in order["message"]
    assert "Timed out" not in order["message"]  # DETAIL names the mismatch, not a timeout


def test_diagnose_and_bad_input():
    pos = {0: Position(0, 3, "all_reduce", "float32[4]"), 1: Position(1, 2, "all_reduce",
                                                                      "float32[4]")}
    assert "rank 1 is in all_reduce #2" in diagnose(pos, 0) and "1 behind" in diagnose(pos, 0)
    assert "published nothing" in diagnose({0: pos[0], 2: Position(2, 3, "all_reduce")}, 0)
    assert "every rank is in the same collective" in diagnose(
        {0: pos[0], 1: Position(1, 3, "all_reduce", "float32[4]")}, 0)
    with pytest.raises(ValueError, match="has no position"):
        diagnose(pos, 5)
    with pytest.raises(ValueError, match="unknown planted hang"):
        hangs.planted_hangs([("nope", False)])
    with pytest.raises(ValueError, match="timeout_s must be"):
        hangs.planted_hangs([("skip", False)], timeout_s=0.01)
    with pytest.raises(ValueError, match="needs a process group"):
        hangs.CollectiveTracer()
    assert [hangs.op_name(n) for n in ("allreduce_", "_allgather_base_", "recv_",
                                       "reduce_scatter_tensor_coalesced_")] == \
        ["all_reduce", "all_gather", "recv", "reduce_scatter"]


def test_parse_faulthandler():
    text = textwrap.dedent('''\
        Thread 0x00007f446b7fe6c0 (most recent call first):
          File "/usr/lib/python3.11/threading.py", line 331 in wait
          File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

        Current thread 0x00007f4490c7ab80 (most recent call first):
          File "/x/site-packages/torch/distributed/distributed_c10d.py", line 3252 in all_reduce
          File "<string>", line 1 in <module>
        ''')
    main = stacks.main_thread(stacks.parse_faulthandler(text))
    assert main[0].short() == "torch/distributed/distributed_c10d.py:3252 in all_reduce"
    with pytest.raises(ValueError, match="no main thread"):
        stacks.main_thread(stacks.parse_faulthandler(text.split("Current")[0]))


def test_sigusr2_dumps_show_where_each_rank_of_a_hung_job_waits(tmp_path):
    r = stacks.dump_stacks(tmp_path)
    assert r["stacks"][0][0].function == "all_reduce"  # rank 0 waits in the collective
    assert r["stacks"][1][0].function == "load_batch"  # rank 1 is stuck in its loader
    assert r["workers_alive"] == [] and r["workers_gone_s"] is not None
    if stacks.py_spy():
        assert "all_reduce" in r["py_spy"][0] and "load_batch" in r["py_spy"][1]


def test_the_stored_stack_record_shows_the_same_frames():
    rec = json.loads((DATA / "hangs-stacks.json").read_text())
    assert rec["measurement"] == "hangs-stacks"
    assert rec["stacks"]["0"][0]["function"] == "all_reduce"
    assert rec["stacks"]["1"][0]["function"] == "load_batch"
    assert "all_reduce" in rec["py_spy"]["0"] and "load_batch" in rec["py_spy"]["1"]
