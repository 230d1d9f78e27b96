"""torchft on CPU (book/failures/fault-tolerance): a lighthouse and two replica groups train the
book's model with gloo; one group is SIGKILLed and restarted. The survivor never restarts and its
step never goes back, the outage steps use one group's gradients, the restarted group receives
the survivor's weights live (bit for bit) and its step jumps to the survivor's, and the work lost
is below a global restart's. The stored record satisfies the same claims and starts like a fresh
run."""

from pathlib import Path

import pytest

pytest.importorskip("torchft", reason="torchft is not installed (pip install torchft==0.2.0)")

from trainbook.failures import torchft_demo as T  # noqa: E402

RECORD = Path(__file__).resolve().parents[1] / "book/failures/data/fault-tolerance-torchft.json"


def _claims(f: dict) -> None:
    assert f["survivor_monotonic"] and f["outage_steps"] > 0 and f["outage_one_participant"]
    assert f["restarted_first_before"] == 0 and f["heal_step"] > f["killed_at_step"]
    assert f["rejoin_step"] == f["heal_step"] + 1 and f["rejoin_step_joint"]
    assert f["healed_weights_equal"] and f["weights_equal_after"]
    assert f["weights_equal_before_kill"]
    assert f["lost_group_steps_torchft"] < f["lost_group_steps_global"]


def test_stored_record_satisfies_the_claims():
    record = T.read_record(RECORD)
    assert record["versions"]["torchft"].startswith("0.2")
    _claims(T.facts(record))


def test_live_run_kill_rejoin_and_it_matches_the_stored_record(tmp_path):
    r = T.run(tmp_path, kill_after=8, after_rejoin=5, down_s=0.5, timeout_s=240)
    f = T.facts(r)
    _claims(f)
    assert r["lighthouse_exit"] == -9  # it ran until we stopped it, by pid
    # before the kill the run is deterministic: the same losses as the stored run's
    stored = T.read_record(RECORD)["log"]["group0"]
    live = [x["loss"] for x in r["log"]["group0"] if x["step"] <= 8]
    assert live == pytest.approx([x["loss"] for x in stored[:len(live)]], rel=1e-4)


@pytest.mark.parametrize("kwargs, err", [
    ({"kill_after": 0}, ValueError), ({"kill_after": 2.5}, TypeError),
    ({"after_rejoin": 0}, ValueError), ({"down_s": -1}, ValueError),
    ({"timeout_s": 0}, ValueError), ({"down_s": "1"}, TypeError),
])
def test_run_rejects_bad_input_before_starting_anything(tmp_path, kwargs, err):
    with pytest.raises(err):
        T.run(tmp_path / "x", **kwargs)
    assert not (tmp_path / "x").exists()


def test_facts_and_record_io_reject_bad_input(tmp_path):
    with pytest.raises(TypeError, match="torchft_demo.run"):
        T.facts({"steps": 3})
    with pytest.raises(ValueError, match="ckpt_every"):
        T.facts(T.read_record(RECORD), ckpt_every=0)
    with pytest.raises(ValueError, match=r"\.json"):
        T.write_record(tmp_path / "x.txt")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="write_record"):
        T.read_record(tmp_path / "bad.json")
