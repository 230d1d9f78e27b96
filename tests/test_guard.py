"""The trainer's guard, with real processes and real signals: SIGTERM stops a run after a step
with a checkpoint and the resumed run is the uninterrupted one bit for bit; a worker whose
launcher is SIGKILLed exits instead of training on as an orphan; a second job on the same
checkpoint directory fails at once, naming the first; old checkpoints are pruned."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from trainbook.train import TrainConfig, latest_checkpoint, load_checkpoint, train
from trainbook.train.checkpoint import prune_checkpoints
from trainbook.train.guard import CheckpointDirLocked, Guard, lock_dir

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--n-kv-heads", "1",
        "--d-ff", "32", "--tokenizer", "bytes", "--seq-len", "16", "--batch-size", "2",
        "--warmup-steps", "1", "--log-every", "1", "--no-progress"]
TIMEOUT_S = 120


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")}
    env.update(PYTHONPATH=str(ROOT / "code"), OMP_NUM_THREADS="1", **extra)
    return env


def _trainer(tmp_path: Path, steps: int, *extra: str, **env) -> subprocess.Popen:
    argv = [sys.executable, "-u", "-m", "trainbook", "train", *TINY, "--steps", str(steps),
            "--cache-dir", str(tmp_path / "cache"), *extra]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path, env=_env(**env))


def _wait_for_step(proc: subprocess.Popen, step: int) -> None:
    for line in proc.stdout:
        if line.startswith("step") and int(line.split()[1]) >= step:
            return
    raise AssertionError(f"the trainer ended before step {step}: {proc.stderr.read()}")


def test_sigterm_checkpoints_stops_cleanly_and_resumes_bit_for_bit(tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = _trainer(tmp_path, 100_000, "--ckpt-dir", str(ckpt), "--json-out", "run.json")
    try:
        _wait_for_step(proc, 5)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=TIMEOUT_S)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "received SIGTERM" in err and "Traceback" not in err
    stopped = json.loads((tmp_path / "run.json").read_text())
    n = len(stopped["history"])
    assert latest_checkpoint(ckpt).name == f"step-{n:06d}.pt"
    assert load_checkpoint(latest_checkpoint(ckpt))["step"] == n
    # the same run from scratch, and resumed from the signal's checkpoint, to step n + 3
    base = dict(model="tiny-llama", d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32,
                tokenizer="bytes", seq_len=16, batch_size=2, warmup_steps=1, steps=100_000,
                log_every=0, progress=False, cache_dir=str(tmp_path / "cache"))
    whole = train(TrainConfig(**base, stop_after=n + 3))
    resumed = train(TrainConfig(**base, stop_after=n + 3, ckpt_dir=str(ckpt), resume=True))
    assert resumed.losses() == whole.losses()
    assert resumed.losses()[:n] == [r["loss"] for r in stopped["history"]]


def test_a_worker_exits_when_its_launcher_is_killed(tmp_path):
    """A stand-in for torchrun's agent starts the trainer (with TORCHELASTIC_RUN_ID, as torchrun
    sets it) and is SIGKILLed: the worker notices within a second and exits. Without the guard
    it would be reparented and train on."""
    agent = textwrap.dedent(f"""
        import subprocess, sys, time
        child = subprocess.Popen({[sys.executable, "-u", "-m", "trainbook", "train", *TINY,
                                   "--steps", "100000", "--cache-dir",
                                   str(tmp_path / "cache")]!r})
        print(child.pid, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", agent], stdout=subprocess.PIPE, text=True,
                              cwd=tmp_path, env=_env(TORCHELASTIC_RUN_ID="test-run"))
    worker = int(parent.stdout.readline())
    try:
        time.sleep(4)  # the worker is importing torch and starting to train
        assert _alive(worker)
        parent.kill()
        parent.wait(timeout=10)
        deadline = time.time() + 30
        while _alive(worker) and time.time() < deadline:
            time.sleep(0.2)
        assert not _alive(worker), "the orphaned worker is still running"
    finally:
        parent.kill()
        if _alive(worker):
            os.kill(worker, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Running (a zombie whose parent has not reaped it yet counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_a_second_job_on_the_same_checkpoint_dir_fails_naming_the_first(tmp_path):
    proc = _trainer(tmp_path, 100_000, "--ckpt-dir", str(tmp_path / "ckpt"),
                    SLURM_JOB_ID="4242")
    try:
        _wait_for_step(proc, 1)
        second = subprocess.run([sys.executable, "-m", "trainbook", "train", *TINY, "--steps",
                                 "3", "--ckpt-dir", str(tmp_path / "ckpt"), "--cache-dir",
                                 str(tmp_path / "cache")], capture_output=True, text=True,
                                cwd=tmp_path, env=_env(), timeout=TIMEOUT_S)
    finally:
        proc.kill()
        proc.wait()
    assert second.returncode != 0
    assert "is in use by another live process" in second.stderr and '"4242"' in second.stderr
    assert not list((tmp_path / "ckpt").glob("step-*"))  # the first run has not saved yet
    lock_dir(tmp_path / "ckpt")  # the lock died with its process


def test_lock_is_exclusive_and_released(tmp_path):
    fd = lock_dir(tmp_path)
    with pytest.raises(CheckpointDirLocked, match="in use by another live process"):
        lock_dir(tmp_path)
    os.close(fd)
    os.close(lock_dir(tmp_path))


def test_guard_restores_handlers_and_flags_a_signal_in_process():
    before = signal.getsignal(signal.SIGUSR1)
    with Guard() as g:
        os.kill(os.getpid(), signal.SIGUSR1)
        for _ in range(100):  # Python runs the handler between bytecodes
            if g.signal:
                break
            time.sleep(0.01)
        assert g.stop_requested() == "SIGUSR1"
    assert signal.getsignal(signal.SIGUSR1) is before


def test_keep_last_prunes_old_and_incomplete_checkpoints(tmp_path, cache_dir):
    cfg = TrainConfig(model="tiny-llama", d_model=32, n_layers=1, n_heads=2, n_kv_heads=1,
                      d_ff=32, tokenizer="bytes", seq_len=16, batch_size=2, warmup_steps=1,
                      steps=10, log_every=0, progress=False, cache_dir=cache_dir,
                      ckpt_dir=str(tmp_path), ckpt_every=2, keep_last=2)
    (tmp_path / "step-000001.pt.tmp").write_bytes(b"half a checkpoint")
    train(cfg)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000008.pt",
                                                                "step-000010.pt"]
    with pytest.raises(ValueError, match="keep must be >= 1"):
        prune_checkpoints(tmp_path, 0)
    with pytest.raises(ValueError, match="keep_last, resume and overwrite need ckpt_dir"):
        TrainConfig(keep_last=2)
    assert load_checkpoint(tmp_path / "step-000010.pt")["step"] == 10


def test_a_signalled_rank_writes_its_line_in_one_write(monkeypatch):
    """Two ranks signalled at once share the job's log: a line written in pieces (print's text,
    then its newline, under PYTHONUNBUFFERED) glues to the other rank's, as a SLURM run showed."""
    writes = []

    class Recorder:
        def write(self, text):
            writes.append(text)

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stderr", Recorder())
    g = Guard(rank=1)
    g._handler(signal.SIGTERM, None)
    assert writes == ["trainbook: rank 1 received SIGTERM: stopping after this step with a "
                      "checkpoint\n"]
