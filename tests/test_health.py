"""Node health (book/failures/health): grading against a baseline, the CPU burn-in on 2 gloo
ranks, the nvidia-smi and kernel-log parsers on the stored (constructed) samples with their
planted faults, the Xid triage, the planted bit flip found by the replica checksums and the
planted slow rank named by the step times, the command's exit status, and the stored record
(book/failures/data/health-cpu.json) against a fresh short run."""

import json
from pathlib import Path

import pytest
import torch

from trainbook.__main__ import main
from trainbook.failures import gpu_counters as G
from trainbook.failures import health as H
from trainbook.failures import rank_faults as RF
from trainbook.failures import sdc
from trainbook.failures import stragglers as ST

DATA = Path(__file__).resolve().parents[1] / "book" / "failures" / "data"
SAMPLES = json.loads((DATA / "health-gpu-samples.json").read_text())


# ---- grading ---------------------------------------------------------------------------------

@pytest.mark.parametrize("value, status", [(100, "pass"), (80, "pass"), (79.9, "warn"),
                                           (50, "warn"), (49.9, "fail"), (0, "fail")])
def test_grade_by_fraction_of_expected(value, status):
    assert H.grade(value, 100.0) == status


def test_grade_without_expectation_passes_and_rejects_bad_thresholds():
    assert H.grade(1.0, None) == "pass"
    with pytest.raises(ValueError, match="> 0"):
        H.grade(1.0, 0.0)
    for warn, fail in ((0.5, 0.8), (1.0, 0.5), (0.8, 0.0)):
        with pytest.raises(ValueError, match="fail_below"):
            H.Thresholds(warn, fail)


def test_exit_status_fails_only_on_a_failure():
    ok = [H.Check("a", "pass"), H.Check("b", "warn"), H.Check("c", "skip")]
    assert H.exit_status(ok) == 0
    assert H.exit_status([*ok, H.Check("d", "fail")]) == 1


def test_chain_digest_is_reproducible_and_sensitive():
    a = H.chain_digest(64, seed=3)
    assert a == H.chain_digest(64, seed=3) != H.chain_digest(64, seed=4)
    assert H.disagreeing_ranks([a, a, "x", a]) == [2]
    with pytest.raises(ValueError, match="size"):
        H.chain_digest(0)


def test_measure_rejects_bad_input_before_work():
    with pytest.raises(ValueError, match="unknown burn-in"):
        H.measure(["matmul", "gpu-burn"])
    with pytest.raises(ValueError, match="budget_s"):
        H.measure(["matmul"], budget_s=0)
    with pytest.raises(ValueError, match="ranks >= 2"):
        H.measure(["all-reduce"], ranks=1)


# ---- the burn-in, for real on 2 gloo ranks ----------------------------------------------------

@pytest.fixture(scope="module")
def burn_in():
    return H.measure(H.BURN_IN, ranks=2, budget_s=0.3, timeout_s=120)


def test_burn_in_measures_and_grades_against_a_baseline(burn_in, tmp_path):
    m = burn_in
    assert m["matmul"] > 0 and m["memory"] > 0 and m["all-reduce"] > 0
    assert len(set(m["digests"])) == 1 and all(m["repeat_ok"])
    path = H.save_baseline(tmp_path / "base.json", m, "test")
    base = H.load_baseline(path)
    same = H.grade_burn_in(m, {k: base[k] for k in H.UNITS})
    assert [c.status for c in same] == ["pass"] * 4 and H.exit_status(same) == 0
    # the same node measured against a baseline three times faster: every number fails
    fast = {k: 3 * base[k] for k in H.UNITS}
    slow = H.grade_burn_in(m, fast)
    assert {c.name: c.status for c in slow} == {"matmul": "fail", "memory": "fail",
                                                "all-reduce": "fail", "determinism": "pass"}
    assert H.exit_status(slow) == 1


def test_a_rank_with_different_bits_fails_determinism(burn_in):
    bad = {**burn_in, "digests": [burn_in["digests"][0], "0" * 64],
           "repeat_ok": [True, False]}
    (check,) = [c for c in H.grade_burn_in(bad, {}) if c.name == "determinism"]
    assert check.status == "fail" and "rank" in check.detail


def test_load_baseline_refuses_other_files(tmp_path):
    (tmp_path / "x.json").write_text('{"kind": "other"}')
    for p in (tmp_path / "x.json", tmp_path / "missing.json"):
        with pytest.raises(ValueError, match="--save-baseline"):
            H.load_baseline(p)


# ---- GPU counters, on the stored samples ------------------------------------------------------

def by_name(checks):
    return {c.name: c.status for c in checks}


def test_query_sample_finds_every_planted_fault():
    rows = G.parse_query(SAMPLES["query"], tuple(SAMPLES["query_fields"]))
    assert len(rows) == 8 and rows[2]["remapped_rows.pending"] is True
    s = by_name(G.check_query(rows))
    assert s["ecc 0"] == "pass" and s["ecc 1"] == "warn" and s["ecc 2"] == "fail"
    assert s["remapped-rows 2"] == "fail" and s["remapped-rows 4"] == "fail"
    assert s["clocks 3"] == "fail" and s["clocks 1"] == "pass" and s["clocks 5"] == "pass"
    healthy = {f"{k} {i}" for k in ("ecc", "remapped-rows", "clocks") for i in (0, 5, 6, 7)}
    assert all(s[n] == "pass" for n in healthy)
    assert G.clock_reasons(0x44) == ["SW power cap", "HW thermal slowdown"]
    with pytest.raises(ValueError, match="fields"):
        G.parse_query("0, 1, 2\n")


def test_nvlink_sample_finds_the_down_link():
    links = G.parse_nvlink(SAMPLES["nvlink"])
    assert len(links) == 8 and links[6][7] is None and links[0] == [26.562] * 18
    s = by_name(G.check_nvlink(links))
    assert s["nvlink 6"] == "fail" and [n for n, v in s.items() if v != "pass"] == ["nvlink 6"]
    assert by_name(G.check_nvlink({0: []})) == {"nvlink": "skip"}


def test_xid_triage_of_the_kernel_log():
    xids = G.parse_xids(SAMPLES["kernel_log"])
    assert [x["xid"] for x in xids] == [13, 13, 31, 48, 63, 45, 74, 79]
    assert xids[-1]["bus"] == "0000:db:00" and xids[-1]["triage"] == "drain node"
    s = by_name(G.check_xids(xids))
    assert s == {"xid 13": "warn", "xid 31": "warn", "xid 45": "warn", "xid 48": "fail",
                 "xid 63": "warn", "xid 74": "fail", "xid 79": "fail"}
    assert by_name(G.check_xids([])) == {"xid": "pass"}
    assert G.parse_xids("NVRM: Xid (PCI:0000:01:00): 999, new")[0]["triage"] == "look it up"


def test_counters_skip_without_a_driver_but_read_a_saved_log(tmp_path):
    log = tmp_path / "dmesg.txt"
    log.write_text(SAMPLES["kernel_log"])
    checks = G.run(G.COUNTERS, kernel_log_file=str(log), smi="no-such-nvidia-smi")
    s = by_name(checks)
    assert s["ecc"] == s["remapped-rows"] == s["clocks"] == s["nvlink"] == "skip"
    assert s["xid 79"] == "fail"
    with pytest.raises(ValueError, match="unknown counter"):
        G.run(["ecc", "temperature"])


def test_command_exit_status_follows_the_kernel_log(tmp_path, capsys):
    bad, good = tmp_path / "bad.txt", tmp_path / "good.txt"
    bad.write_text(SAMPLES["kernel_log"])
    good.write_text("[1.0] NVRM: loading NVIDIA UNIX x86_64 Kernel Module\n")
    assert main(["health", "--checks", "xid", "--kernel-log", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS" in out and "FAIL (exit status 1)" in out
    assert main(["health", "--checks", "xid", "--kernel-log", str(good), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "pass"
    assert main(["health", "--checks", "matmul,gpu-burn"]) == 2
    assert "gpu-burn" in capsys.readouterr().err
    assert main(["health", "--warn-below", "0.4", "--fail-below", "0.6"]) == 2


# ---- SDC: checksums and a planted bit flip ----------------------------------------------------

def test_checksum_sees_one_flipped_bit_and_flip_is_its_own_inverse():
    t = torch.randn(100, generator=torch.Generator().manual_seed(0))
    before = sdc.checksum(t)
    for bit in (0, 22, 31):
        sdc.flip_bit(t, 7, bit)
        assert sdc.checksum(t) != before
        sdc.flip_bit(t, 7, bit)
        assert sdc.checksum(t) == before
    with pytest.raises(ValueError, match="bit"):
        sdc.flip_bit(t, 0, 32)
    assert sdc.disagreements([{"a": 1, "b": 2}, {"a": 1, "b": 3}, {"a": 1, "b": 2}]) == \
        [{"tensor": "b", "ranks": [1]}]


def test_stragglers_names_the_slow_rank():
    rows = [{"step": s, "rank": r, "forward_s": 0.01 + (0.05 if r == 2 else 0), "step_s": 0.07}
            for s in range(1, 6) for r in range(4)]
    assert [x["rank"] for x in ST.stragglers(rows)] == [2]
    assert ST.stragglers(rows, threshold=10) == []
    with pytest.raises(ValueError, match="threshold"):
        ST.stragglers(rows, threshold=1)


@pytest.fixture(scope="module")
def demo():
    return RF.demo(ranks=2, flip_step=5, flip_rank=1, delay_s=0.05, slow_steps=(6, 15),
                   steps=8, straggler_steps=15, timeout_s=180)


def test_planted_bit_flip_is_found_at_its_step_on_its_rank(demo):
    assert demo["clean_found"] == []
    first = demo["found"][0]
    assert first == {"step": 5, "tensor": RF.FLIP_TENSOR, "ranks": [1]}
    assert sdc.first_step(demo["found"]) == 5
    a, b = demo["rank_checksums"]
    assert a != b  # the replicas never agree again: the flip is in the weights for good


def test_planted_slow_rank_is_named_and_slows_everyone(demo):
    rows = demo["rows"]
    assert [x["rank"] for x in ST.stragglers(rows, steps=(6, 15))] == [1]
    assert ST.stragglers(rows, steps=(2, 5)) == []  # before the slowdown: nobody
    during = {r["rank"]: r for r in ST.summary(rows, (6, 15))}
    # both ranks' steps take the delay: rank 0 waits for rank 1 at the all-reduce
    assert during[0]["step_s"] > 0.04 and during[0]["forward_s"] < 0.04


# ---- the stored record ----------------------------------------------------------------------

@pytest.mark.records
def test_stored_record_has_provenance_and_agrees_with_a_fresh_run(demo):
    record = RF.read_record(DATA / "health-cpu.json")
    for key in ("command", "date_utc", "versions", "device"):
        assert record[key], key
    h = record["health"]
    assert h["exit_status"] == 0
    assert {c["name"]: c["status"] for c in h["checks"]}["determinism"] == "pass"
    rows = record["straggler_sweep"]["rows"]
    assert rows[0]["delay_s"] == 0 and rows[0]["flagged"] == []
    big = [r for r in rows if r["delay_s"] >= 0.05]
    assert big and all(r["flagged"] == [1] for r in big)
    # everyone waits for the slow rank: every rank's step takes at least the delay
    assert all(p["step_s"] >= r["delay_s"] for r in rows for p in r["per_rank"])
    # the fresh run names the same rank
    assert [x["rank"] for x in ST.stragglers(demo["rows"], steps=(6, 15))] == [1]
    with pytest.raises(ValueError, match="health-cpu"):
        RF.read_record(DATA / "health-gpu-samples.json")
