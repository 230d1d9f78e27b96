"""SLURM: the generated sbatch script, checked as text and by bash, and run for real.

The real run starts munged, slurmctld and slurmd on this machine (Debian's slurm-wlm; skipped
with the reason where they are not installed or not root), submits the generated script, and
the job trains on 2 ranks, gets the pre-timeout signal, checkpoints, is requeued and resumes,
until it completes with the loss curve of the same run without SLURM, bit for bit. The daemons
and every process the jobs started are stopped by pid in the fixture's finaliser, whatever
happens. The stored record (book/failures/data/slurm-requeue.json) is checked against the
generator and against the fresh run.
"""

import json
import math
import subprocess
import time
from pathlib import Path

import pytest

from trainbook.__main__ import main
from trainbook.failures import slurm as S
from trainbook.failures import slurm_cluster as C
from trainbook.failures import slurm_requeue as R

ROOT = Path(__file__).resolve().parents[1]
STORED = ROOT / "book" / "failures" / "data" / "slurm-requeue.json"


def bash_syntax(text: str, tmp_path: Path) -> None:
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=10)
    assert r.returncode == 0, r.stderr


# ---- the generator ---------------------------------------------------------------------------

@pytest.mark.parametrize("text, seconds", [("30", 1800), ("1", 60), ("90:30", 5430),
                                           ("04:00:00", 14400), ("2-00", 172800),
                                           ("1-02:03", 93780), ("1-00:00:05", 86405)])
def test_parse_time_reads_sbatch_formats(text, seconds):
    assert S.parse_time(text) == seconds


@pytest.mark.parametrize("text", ["", "abc", "1:2:3:4", "01:60:00", "00:00:30", "1-24:61"])
def test_parse_time_rejects(text):
    with pytest.raises(ValueError, match="time"):
        S.parse_time(text)


def test_script_for_many_gpu_nodes(tmp_path):
    spec = S.JobSpec(train_args=("--model", "llama-3-8b", "--steps", "5000"), nodes=4,
                     cpus_per_task=96, partition="gpu", time="24:00:00", signal_lead_s=300)
    text = S.sbatch_script(spec)
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --cpus-per-task=96", "#SBATCH --partition=gpu",
                 "#SBATCH --signal=B:USR1@300", "#SBATCH --requeue",
                 "#SBATCH --open-mode=append", "trap on_usr1 USR1",
                 'scancel --signal=TERM "$SLURM_JOB_ID"', 'scontrol requeue "$SLURM_JOB_ID"',
                 'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
                 "MASTER_PORT=$(( 15000 + SLURM_JOB_ID % 10000 ))", "--numa-binding node",
                 '--rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT"', '--rdzv_id "$SLURM_JOB_ID"',
                 '--nnodes "$SLURM_NNODES"', "--nproc_per_node 8", "OMP_NUM_THREADS",
                 '--ckpt-dir "$CKPT_DIR" --resume &', 'compgen -G "$CKPT_DIR/step-005000*"'):
        assert line in text, line
    assert "--array" not in text
    bash_syntax(text, tmp_path)


def test_sweep_makes_an_array_with_a_folder_per_value(tmp_path):
    spec = S.JobSpec(train_args=("--steps", "100"), gpus_per_node=0, nproc_per_node=2,
                     sweep=S.parse_sweep("lr=1e-3,3e-3,1e-2"), max_parallel=2)
    text = S.sbatch_script(spec)
    assert "#SBATCH --array=0-2%2" in text and "VALUES=(1e-3 3e-3 1e-2)" in text
    assert 'CKPT_DIR="$CKPT_DIR/lr-$VALUE"' in text and '--lr "$VALUE"' in text
    assert "--numa-binding" not in text and "--gpus-per-node" not in text
    bash_syntax(text, tmp_path)
    out = subprocess.run(["bash", "-c", text.split("srun ")[0].replace("scontrol show "
                          "hostnames", "echo") + 'echo "$CKPT_DIR $VALUE"'],
                         env={"SLURM_ARRAY_TASK_ID": "1", "SLURM_JOB_ID": "77",
                              "SLURM_JOB_NODELIST": "n1", "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=10)
    assert out.stdout.strip().endswith("ckpt/lr-3e-3 3e-3"), out.stdout + out.stderr


def test_no_signal_no_trap_and_no_requeue(tmp_path):
    text = S.sbatch_script(S.JobSpec(signal_lead_s=0, requeue=False))
    assert "--signal" not in text and "trap on_usr1" not in text and "#SBATCH --no-requeue" in text
    bash_syntax(text, tmp_path)


@pytest.mark.parametrize("kwargs, match", [
    (dict(gpus_per_node=0), "nproc_per_node"),
    (dict(time="1", signal_lead_s=60), "no time to train"),
    (dict(signal_lead_s=70000), "65535"),
    (dict(nodes=0), "nodes"),
    (dict(port=80), "port"),
    (dict(numa_binding="far"), "numa_binding"),
    (dict(max_parallel=2), "sweep"),
    (dict(train_args=("--ckpt-dir", "x")), "set by the script"),
    (dict(train_args=("--lr", "1"), sweep=("--lr", ("1", "2"))), "swept"),
    (dict(job_name="a b"), "job name"),
])
def test_jobspec_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        S.JobSpec(**kwargs)


@pytest.mark.parametrize("text, match", [("lr", "OPTION=V1"), ("lr=", "OPTION=V1"),
                                         ("ckpt-dir=a,b", "set by the script"),
                                         ("lr=1,1", "repeats"), ("lr=a/b", "folder")])
def test_parse_sweep_rejects(text, match):
    with pytest.raises(ValueError, match=match):
        S.parse_sweep(text)


def test_command_writes_a_checked_script(tmp_path, capsys):
    out = tmp_path / "jobs" / "train.sbatch"
    assert main(["slurm", "--nodes", "2", "--output", str(out), "--", "--model", "gpt2",
                 "--steps", "30", "--warmup-steps", "3"]) == 0
    assert "#SBATCH --nodes=2" in out.read_text() and "--model gpt2" in out.read_text()
    capsys.readouterr()
    assert main(["slurm", "--gpus-per-node", "4", "--json", "--", "--steps", "30",
                 "--warmup-steps", "3"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["spec"]["gpus_per_node"] == 4 and "#SBATCH --gpus-per-node=4" in record["script"]
    assert main(["slurm", "--", "--stepz", "3"]) == 2
    assert "--stepz" in capsys.readouterr().err
    assert main(["slurm", "--nodes", "2", "--", "--tp", "3"]) == 2  # 16 ranks, 3 does not fit
    assert "tp 3" in capsys.readouterr().err


# ---- the real cluster --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster():
    reason = C.missing()
    if reason:
        pytest.skip(reason)
    c = C.Cluster()
    try:
        c.__enter__()
        yield c
    finally:
        c.stop()
        assert c.leftovers() == [], "processes of the cluster outlived it"
        assert all(p.poll() is not None for p in c.procs.values())


@pytest.fixture(scope="module")
def fresh(cluster, tmp_path_factory):
    # steps sized to this machine's speed: a fixed count can finish before the signal
    return R.requeue_run(cluster, tmp_path_factory.mktemp("requeue"), steps=None, timeout_s=300)


def test_signal_checkpoint_requeue_resume_is_bit_for_bit(fresh):
    attempts = fresh["attempts"]
    assert fresh["state"] == "COMPLETED" and fresh["restarts"] >= 1
    stopped = [a for a in attempts if a["stopped_at"]]
    assert stopped, f"no attempt checkpointed at the signal: {attempts}"
    first = stopped[0]
    assert first["usr1"] and sorted(first["ranks_got"]) == ["0:SIGTERM", "1:SIGTERM"]
    resumed = attempts[attempts.index(first) + 1]
    assert resumed["attempt"] == first["attempt"] + 1
    assert resumed["resumed_at"] == first["stopped_at"]
    assert attempts[-1]["done_steps"] == fresh["steps"]
    assert fresh["losses_equal"] and fresh["max_abs_diff"] == 0.0


def test_stored_record_matches_the_generator_and_the_fresh_run(fresh):
    record = json.loads(STORED.read_text())
    for key in ("command", "date_utc", "versions", "device"):
        assert record[key], key
    run = record["run"]
    spec = S.JobSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in run["spec"].items()})
    assert S.sbatch_script(spec, "trainbook.failures.slurm_requeue.demo_spec") == run["script"]
    for r in (run, fresh):
        assert r["state"] == "COMPLETED" and r["losses_equal"] and r["restarts"] >= 1
        assert any(a["stopped_at"] for a in r["attempts"])
    if run["steps"] == fresh["steps"]:  # the fresh run's length follows this machine's speed
        assert run["final_loss"] == fresh["final_loss"]
    chosen, all_steps, srun_term = record["variants"]
    assert chosen["batch_shell_trapped"] and chosen["checkpoint_step"] and chosen["requeued"]
    assert not all_steps["batch_shell_trapped"] and all_steps["agent_died"]
    assert not all_steps["checkpoints"] and not all_steps["requeued"]
    assert srun_term["batch_shell_trapped"] and not srun_term["checkpoints"]
    assert any("forcing job termination" in line for line in srun_term["srun"])


def test_steps_for_rejects_a_non_positive_time(tmp_path):
    with pytest.raises(ValueError, match="seconds must be > 0"):
        R.steps_for(0, tmp_path)


def test_cluster_refuses_to_start_without_slurm(monkeypatch):
    monkeypatch.setattr(C.shutil, "which", lambda name: None)
    monkeypatch.setattr(C.Path, "exists", lambda self: False)
    assert "not installed" in C.missing()
    with pytest.raises(RuntimeError, match="apt-get install"):
        C.Cluster()


def test_parse_attempts_reads_a_log():
    log = "\n".join(["job 5 attempt 0 on n1: rendezvous", "USR1 at 1: checkpoint, then requeue",
                     "trainbook: rank 1 received SIGTERM: stopping",
                     "trainbook: rank 0 received SIGTERM: stopping",
                     "stopped after step 40: SIGTERM received", "done: 40 steps, validation",
                     "job 5 attempt 1 on n1: rendezvous",
                     "resumed from ckpt/step-000040.pt at step 40", "done: 90 steps, valid"])
    a, b = R.parse_attempts(log)
    assert a == {"attempt": 0, "resumed_at": 0, "usr1": True, "stopped_at": 40,
                 "ranks_got": ["1:SIGTERM", "0:SIGTERM"], "done_steps": 40}
    assert b["resumed_at"] == 40 and b["done_steps"] == 90 and not b["usr1"]


def test_release_waits_until_the_revocation_second_has_passed(monkeypatch):
    # CI failed a job with "Job credential revoked": released in the second it was requeued
    cluster = object.__new__(C.Cluster)  # no daemons: only the timing of the update is checked
    calls = []
    monkeypatch.setattr(cluster, "run", lambda *argv, **kw: calls.append((time.time(), argv)))
    seen = time.time()
    cluster.release(7)
    (at, argv), = calls
    assert argv == ("scontrol", "update", "JobId=7", "StartTime=now")
    assert math.floor(at) >= math.floor(seen) + C.RELEASE_AFTER_S and at - seen < 2.5
