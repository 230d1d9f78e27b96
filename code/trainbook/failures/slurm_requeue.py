"""The generated sbatch script on a real controller: the job trains on 2 ranks, gets the
pre-timeout signal, checkpoints, is requeued and resumes, attempt after attempt, until the run is
done; its loss curve is compared bit for bit with the same run without SLURM.

`requeue_run` drives one job on a `slurm_cluster.Cluster`: a one-minute time limit and
`--signal=B:USR1@50` make slurmctld warn the job at its first 30-second check, so each attempt
trains for the 15-25 s between its start and that check. The job is submitted where the next
check will find it training; each requeued attempt (held by SLURM with reason BeginTime) is
released 1-2 s later (`Cluster.release`: sooner, and slurmd can refuse its credential).
`signal_outcome` runs one attempt of a script variant and says what the signal did (the
chapter's measurements of the alternatives). `write_record` stores both, with the command, date,
versions and machine.

Chapter: book/failures/slurm.
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ..bench.gpu_truth import header
from ..bench.gpu_truth import write_record as write_json
from ..launch import torchrun
from ..train.checkpoint import checkpoint_path, load_checkpoint
from .slurm import JobSpec, sbatch_script
from .slurm_cluster import CHECK_PERIOD_S, Cluster

# a model small enough that 2 ranks on 2 shared cores take ~15 ms a step
TINY = ("--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--n-kv-heads", "1", "--d-ff",
        "32", "--tokenizer", "bytes", "--seq-len", "16", "--batch-size", "2", "--warmup-steps",
        "1", "--log-every", "100", "--no-progress", "--eval-batches", "1")
TERMINAL = ("COMPLETED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
            "DEADLINE", "PREEMPTED")
LEAD_IN_S = 18  # submit this long before slurmctld's next check: start-up, then ~10 s training
TRAIN_S = 30.0  # a job this long (measured on this machine) outlives its first attempt anywhere


def demo_spec(steps: int, ckpt_dir: str = "ckpt", signal_lead_s: int = 50,
              port: int | None = None) -> JobSpec:
    """The test's job: one node, 2 CPU ranks, a one-minute limit, USR1 50 s before it."""
    if steps < 2:
        raise ValueError(f"steps must be >= 2, got {steps}")
    return JobSpec(train_args=(*TINY, "--steps", str(steps)), ckpt_dir=ckpt_dir, nodes=1,
                   gpus_per_node=0, nproc_per_node=2, cpus_per_task=2, time="1",
                   signal_lead_s=signal_lead_s, job_name="requeue", output="%x-%j.out",
                   port=port)


def parse_attempts(log: str) -> list[dict[str, Any]]:
    """Each attempt of a job, from its log (the script's and the trainer's lines): the attempt
    number, the step it resumed at, whether USR1 came, the step it stopped at, the signal the
    ranks received, and whether it finished the run."""
    attempts: list[dict[str, Any]] = []
    for line in log.splitlines():
        if m := re.match(r"job \d+ attempt (\d+)", line):
            attempts.append({"attempt": int(m[1]), "resumed_at": 0, "usr1": False,
                             "stopped_at": None, "ranks_got": [], "done_steps": None})
        elif not attempts:
            continue
        elif m := re.match(r"resumed from \S+ at step (\d+)", line):
            attempts[-1]["resumed_at"] = int(m[1])
        elif line.startswith("USR1 at"):
            attempts[-1]["usr1"] = True
        elif m := re.match(r"trainbook: rank (\d+) received (SIG\w+)", line):
            attempts[-1]["ranks_got"].append(f"{m[1]}:{m[2]}")
        elif m := re.match(r"stopped after step (\d+): (SIG\w+)", line):
            attempts[-1]["stopped_at"] = int(m[1])
        elif m := re.match(r"done: (\d+) steps", line):
            attempts[-1]["done_steps"] = int(m[1])
    return attempts


def _submit_on_phase(cluster: Cluster, script: Path, lead_in_s: float) -> int:
    """sbatch when slurmctld's next check is `lead_in_s` away."""
    wait = cluster.next_check() - lead_in_s
    time.sleep(wait if wait >= 0 else wait + CHECK_PERIOD_S)
    return cluster.submit(script, cwd=script.parent)


def steps_for(seconds: float, workdir: str | Path, timeout_s: float = 120) -> int:
    """The number of demo steps that 2 ranks train in about `seconds` on this machine (measured
    with a short plain torchrun run), so the job needs more than one attempt on a fast CPU and
    not too many on a slow one. At least 1,500, at most 100,000."""
    if not seconds > 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    out = Path(workdir) / "calibrate.json"
    torchrun(["train", *TINY, "--steps", "300", "--json-out", str(out)], nprocs=2,
             timeout_s=timeout_s, cwd=workdir)
    times = sorted(r["step_time_s"] for r in json.loads(out.read_text())["history"][20:])
    return int(min(100_000, max(1500, seconds / times[len(times) // 2])))


def requeue_run(cluster: Cluster, workdir: str | Path, steps: int | None = 1500,
                timeout_s: float = 240, max_attempts: int = 6,
                lead_in_s: float = LEAD_IN_S) -> dict[str, Any]:
    """Run the demo job to the end, releasing each requeued attempt; the same run under plain
    torchrun in parallel, as the reference. Returns what happened (see the module doc).
    `steps=None`: as many as take TRAIN_S seconds here (`steps_for`): a fixed count finishes
    inside the first attempt on a fast machine, and then nothing is requeued."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    if steps is None:
        steps = steps_for(TRAIN_S, workdir)
    spec = demo_spec(steps, ckpt_dir=str(workdir / "ckpt"))
    script = workdir / "train.sbatch"
    script.write_text(sbatch_script(spec, "trainbook.failures.slurm_requeue.demo_spec"))
    reference: dict[str, Any] = {}

    def run_reference() -> None:
        try:
            torchrun(["train", *spec.train_args, "--json-out", str(workdir / "reference.json")],
                     nprocs=2, timeout_s=timeout_s, cwd=workdir)
            reference["losses"] = [r["loss"] for r in
                                   json.loads((workdir / "reference.json").read_text())["history"]]
        except Exception as e:  # noqa: BLE001 -- reported with the record, raised below
            reference["error"] = f"{type(e).__name__}: {e}"

    ref = threading.Thread(target=run_reference, daemon=True)
    ref.start()
    t0 = time.time()
    job = _submit_on_phase(cluster, script, lead_in_s)
    events: list[tuple[float, str]] = [(round(time.time() - t0, 1), "submitted")]
    end, state = time.monotonic() + timeout_s, ""
    while True:
        rec = cluster.job(job)
        if rec.get("JobState") != state:
            state = rec.get("JobState", "?")
            events.append((round(time.time() - t0, 1), f"{state} ({rec.get('Reason')})"))
        if state == "PENDING" and rec.get("Reason") == "BeginTime":
            cluster.release(job)
            events.append((round(time.time() - t0, 1), "released"))
        if state in TERMINAL:  # confirm: a job being requeued can look ended for a moment
            time.sleep(2.0)
            again = cluster.job(job)
            if again.get("JobState") == state and again.get("Restarts") == rec.get("Restarts"):
                break
            continue
        if int(rec.get("Restarts", 0)) > max_attempts:
            break
        if time.monotonic() > end:
            raise TimeoutError(f"job {job} did not finish in {timeout_s:g} s (state {state}); "
                               f"log:\n{_log(workdir, job)[-3000:]}")
        time.sleep(0.5)
    ref.join(timeout=max(1.0, end - time.monotonic()))
    log = _log(workdir, job)
    if state != "COMPLETED":
        raise RuntimeError(f"job {job} ended {state} after {rec.get('Restarts')} restarts "
                           f"(events {events}); log:\n{log[-3000:]}\nslurmctld:\n"
                           f"{cluster.log('slurmctld')[-2000:]}")
    if "losses" not in reference:
        raise RuntimeError(f"the reference run failed: {reference.get('error', 'timed out')}")
    losses = [r["loss"] for r in load_checkpoint(checkpoint_path(spec.ckpt_dir, steps))["history"]]
    diff = max((abs(a - b) for a, b in zip(losses, reference["losses"])), default=float("nan"))
    return {"job_id": job, "steps": steps, "state": state, "restarts": int(rec["Restarts"]),
            "attempts": parse_attempts(log), "events": events, "script": script.read_text(),
            "spec": asdict(spec), "losses_equal": losses == reference["losses"],
            "max_abs_diff": diff, "final_loss": losses[-1]}


def signal_outcome(cluster: Cluster, workdir: str | Path, batch_signal: bool = True,
                   forward: str = "scancel", steps: int = 100_000,
                   timeout_s: float = 120) -> dict[str, Any]:
    """One attempt of a script variant: what the pre-timeout signal did to the ranks, whether
    they checkpointed and whether the job was requeued. The job is cancelled afterwards."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    spec = demo_spec(steps, ckpt_dir=str(workdir / "ckpt"))
    script = workdir / "train.sbatch"
    script.write_text(sbatch_script(spec, "trainbook.failures.slurm_requeue.demo_spec",
                                    batch_signal=batch_signal, forward=forward))
    job = _submit_on_phase(cluster, script, LEAD_IN_S)
    end, seen_running = time.monotonic() + timeout_s, False
    while time.monotonic() < end:
        rec = cluster.job(job)
        seen_running |= rec.get("JobState") == "RUNNING"
        if seen_running and rec.get("JobState") != "RUNNING":
            break
        time.sleep(0.5)
    else:
        raise TimeoutError(f"job {job} was not signalled within {timeout_s:g} s")
    settle = time.monotonic() + 15  # the trap's requeue, or the end, reaches the controller
    while (rec := cluster.job(job)).get("JobState") not in (*TERMINAL, "PENDING") \
            and time.monotonic() < settle:
        time.sleep(0.5)
    cluster.run("scancel", str(job))
    log = _log(workdir, job)
    first = (parse_attempts(log) or [{}])[0]
    srun = [ln.split("srun: ", 1)[1] for ln in log.splitlines() if ln.startswith("srun: ")]
    return {"batch_signal": batch_signal, "forward": forward,
            "sbatch_signal": f"--signal={'B:' if batch_signal else ''}USR1@{spec.signal_lead_s}",
            "batch_shell_trapped": first.get("usr1", False),
            "ranks_got": first.get("ranks_got", []), "checkpoint_step": first.get("stopped_at"),
            "checkpoints": sorted(p.name for p in Path(spec.ckpt_dir).glob("step-*")),
            # srun reports its task (the torchrun agent) killed by the signal's default action
            "agent_died": any("User defined signal 1" in line for line in srun),
            "requeued": int(rec.get("Restarts", 0)) >= 1,
            "srun": srun}


def _log(workdir: Path, job: int) -> str:
    path = workdir / f"requeue-{job}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def write_record(path: str | Path, steps: int | None = None) -> Path:
    """Run the requeue demo and the two alternatives on a fresh cluster; store the record as
    JSON with its provenance (command, date, versions, machine). `steps=None` sizes the run to
    this machine, as the test does: 1,500 steps fit one attempt on an idle CPU, no requeue."""
    import tempfile

    path = Path(path)
    command = ("python -c \"from trainbook.failures import slurm_requeue; "
               f"slurm_requeue.write_record({str(path)!r}, steps={steps})\"")
    record = header("slurm-requeue", command, torch.device("cpu"), "small")
    with tempfile.TemporaryDirectory() as tmp, Cluster() as cluster:
        record["slurm"] = cluster.run("sinfo", "--version").strip()
        record["run"] = requeue_run(cluster, Path(tmp) / "run", steps)
        record["variants"] = [
            signal_outcome(cluster, Path(tmp) / "batch-scancel"),
            signal_outcome(cluster, Path(tmp) / "all-steps", batch_signal=False),
            signal_outcome(cluster, Path(tmp) / "srun-term", forward="srun-term")]
    return write_json(path.parent, path.stem, record)
