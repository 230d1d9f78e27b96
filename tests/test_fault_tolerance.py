"""Fault tolerance on real processes (book/failures/fault-tolerance): a SIGKILLed torchrun agent
leaves orphans that train on unless the guard's watchdog is on, and the directory lock stops the
job restarted over them; SIGTERM to the agent reaches every rank, which stop after the same step
with one sharded checkpoint; `--max-restarts` brings a job with a SIGKILLed rank back from its
checkpoint to the uninterrupted loss curve; the goodput driver kills and restarts the trainer and
its accounting adds up; the stored records agree with fresh runs."""

import json
from pathlib import Path

import pytest

from trainbook.failures import fault_tolerance as F
from trainbook.failures import goodput as G

DATA = Path(__file__).resolve().parents[1] / "book" / "failures" / "data"


def test_without_the_watchdog_orphans_train_on_and_the_lock_stops_the_restarted_job(tmp_path):
    r = F.orphans(tmp_path, watchdog=False, watch_s=1.0)
    agent = r["agent"]
    assert all(p != agent for p in r["parents_after"].values()), r  # reparented
    assert all(r["alive_after"].values()) and r["gone_after_s"] is None
    assert r["orphans_still_training"] > 0 or r["checkpoints_after_kill"], r
    assert r["restarted_exit"] != 0
    holder = r["lock_holder"]["pid"]
    assert holder == r["workers"][0] and f'"pid": {holder}' in r["restarted_error"]


def test_sigterm_to_the_agent_stops_every_rank_after_the_same_step(tmp_path):
    r = F.sigterm(tmp_path, at_step=3)
    assert len(r["received"]) == 2 and {"rank 0", "rank 1"} <= {
        " ".join(line.split()[1:3]) for line in r["received"]}
    assert len(r["forwarded"]) == 2 and not r["sigkill"]  # torchrun forwarded, no SIGKILL
    step = int(r["stopped"].split()[3].rstrip(":"))
    assert r["checkpoint"] == f"step-{step:06d}" and step == r["logged_last"]
    assert r["shard_files"] == ["__0_0.distcp", "__1_0.distcp"]  # both ranks wrote theirs


def test_elastic_restart_resumes_to_the_uninterrupted_curve_and_matches_the_record(tmp_path):
    record = F.read_record(DATA / "fault-tolerance-restarts.json")
    steps = record["steps"]
    ref = F.reference(tmp_path / "ref", steps=steps)
    r = F.elastic_restart(tmp_path / "elastic", steps=steps, ckpt_every=5, at_step=12)
    assert r["exit"] == 0, r["stderr_tail"]
    assert r["resumed_step"] is not None and 0 < r["resumed_step"] <= r["killed_after_step"]
    assert [h["loss"] for h in r["history"]] == [h["loss"] for h in ref]  # bit for bit
    # the stored run is this run (another CPU may round differently: a tolerance)
    assert [h["loss"] for h in record["reference"]] == pytest.approx(
        [h["loss"] for h in ref], rel=1e-4)
    unshared = [t for t in record["restarts"] if not t["share_store"]]
    assert unshared and all(t["exit"] == 0 and t["history_equals_reference"] for t in unshared)


def test_goodput_driver_kills_restarts_and_recovers_bit_for_bit(tmp_path):
    steps, k = 60, 10
    ref = G.attempt(G.trainer_argv(tmp_path / "ref", steps), 0.0, None)
    # seed 871: the first failure 0.92 s after the first step, the next 169 s later: one kill
    run = G.run_under_failures(tmp_path / "run", steps, k, mtbf_s=24.0, seed=871)
    assert run["failures"] >= 1 and len(run["attempts"]) == run["failures"] + 1
    assert run["losses"] == [loss for _, _, loss in ref.steps]
    first, second = run["attempts"][:2]
    assert first["killed"] and second["resumed_from"] % k == 0
    assert run["recomputed_steps"] == first["last_step"] - second["resumed_from"] \
        if run["failures"] == 1 else run["recomputed_steps"] > 0
    c = run["costs"]
    assert c["step_s"] > 0 and c["restart_s"] > 0


@pytest.mark.records
def test_stored_goodput_sweep_agrees_with_young_daly_within_noise():
    """The stored sweep: every killed run recovered bit for bit, its model rows are what the
    model gives for its measured costs, the model's wall time is within two standard errors of the
    measured mean at every interval (the chapter asserts the same), and its pick is the measured
    best. The sweep cannot rank the intervals on its own: their means lie within 4.6 s, about
    one standard error."""
    rec = G.read_sweep(DATA / "fault-tolerance-goodput.json")
    assert all(r["losses_equal_reference"] for r in rec["runs"])
    assert {(r["ckpt_every"], r["seed"]) for r in rec["runs"]} == \
        {(k, s) for k in rec["intervals"] for s in rec["seeds"]}
    costs = G.Costs(**rec["costs"])
    assert costs == G.pooled_costs(rec["runs"])
    again = G.model_rows(costs, rec["steps"], rec["intervals"], rec["mtbf_s"])
    assert [pytest.approx(r) for r in again] == rec["model_rows"]
    rows = {r["ckpt_every"]: r for r in G.summarize(rec)}
    best = min(rows, key=lambda k: rows[k]["measured_wall_s"])
    pick = min(rows, key=lambda k: rows[k]["model_wall_s"])
    assert pick == best  # this record: the model's interval is also the measured best
    for r in rows.values():  # the model's wall time, not only its ranking, within noise
        assert abs(r["measured_wall_s"] - r["model_wall_s"]) <= 2 * r["measured_sem_s"]
    young = rec["model_rows"][0]["young_steps"]
    assert pick == min(rows, key=lambda k: abs(k - young))


def _attempt(started, first_step, steps, resumed, killed, dt=0.1, ckpt_every=2, delta=0.3):
    rows, t = [], first_step
    for s in steps:
        rows.append((s, t, 1.0 / s))
        t += dt + (delta if s % ckpt_every == 0 else 0.0)
    return G.Attempt(started, rows[-1][1] + 0.05, rows, resumed, killed)


def test_account_splits_the_wall_time():
    a = _attempt(0.0, 2.0, range(1, 6), 0, killed=True)  # steps 1..5, checkpoint at 4
    b = _attempt(4.0, 5.5, range(5, 11), 4, killed=False)
    acc = G.account([a, b], steps=10, ckpt_every=2)
    assert acc["failures"] == 1 and acc["recomputed_steps"] == 1  # step 5 trained twice
    assert acc["startup_s"] == pytest.approx(1.5)
    assert acc["wall_s"] == pytest.approx(b.steps[-1][1] - 2.0)
    assert acc["losses"] == [1.0 / s for s in range(1, 11)]
    costs = acc["costs"]
    assert costs["step_s"] == pytest.approx(0.1) and costs["ckpt_s"] == pytest.approx(0.3)
    assert costs["restart_s"] == pytest.approx(1.5 - 0.1)


def test_bad_input_is_rejected_before_any_work(tmp_path):
    with pytest.raises(ValueError, match="steps must be"):
        G.run_under_failures(tmp_path, 1, 1, 10.0)
    with pytest.raises(ValueError, match="ckpt_every must be"):
        G.run_under_failures(tmp_path, 10, 0, 10.0)
    with pytest.raises(ValueError, match="mtbf_s must be"):
        G.run_under_failures(tmp_path, 10, 2, -1.0)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "step-000002.pt").write_text("x")
    with pytest.raises(ValueError, match="earlier run"):
        G.run_under_failures(tmp_path, 10, 2, 10.0)
    with pytest.raises(ValueError, match="at_step must be"):
        F.elastic_restart(tmp_path, steps=10, at_step=10)
    with pytest.raises(ValueError, match="nprocs"):
        F.Job(tmp_path, [], nprocs=0)
    with pytest.raises(ValueError, match="no restart time"):
        G.model_rows(G.Costs(0.1, 0.2, None), 100, [10], 30.0)
    (tmp_path / "x.json").write_text(json.dumps({"measurement": "other"}))
    with pytest.raises(ValueError, match="not a fault-tolerance-goodput record"):
        G.read_sweep(tmp_path / "x.json")
    with pytest.raises(ValueError, match="not a fault-tolerance-restarts record"):
        F.read_record(tmp_path / "x.json")
    with pytest.raises(ValueError, match="trials must be"):
        F.write_record(tmp_path / "y.json", trials=0)
