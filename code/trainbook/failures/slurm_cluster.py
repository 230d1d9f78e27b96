"""A real SLURM cluster on this machine, for tests and the chapter: munged, slurmctld and slurmd
(Debian's `slurm-wlm` and `munge`) under a temporary folder, stopped by pid when done.

`Cluster` is a context manager. It writes a munge key and a slurm.conf (the settings of
/work/shared/notes/slurm-on-one-machine.md: one node with this machine's cores, one partition,
linuxproc process tracking, accounting off) with free ports and every path inside its folder, so
nothing under /etc changes and two clusters can run side by side. The daemons run in the
foreground as its children, with a parent-death signal, so they die with the process that
started them. On exit it cancels the jobs, stops the daemons (SIGTERM, then SIGKILL) and kills,
by pid, any process still carrying its marker in the environment (job steps outlive slurmd).
Client commands (`sbatch`, `scontrol`, ...) run with `Cluster.env`: SLURM_CONF points at its
configuration.

slurmctld checks time limits and sends `--signal` warnings every 30 s (PERIODIC_TIMEOUT), counted
from its start: `next_check()` says when the next check is, so a test can start a job where the
warning will find it training.

Chapter: book/failures/slurm.
"""

from __future__ import annotations

import ctypes
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from ..launch import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "sinfo", "squeue", "scancel", "srun")
CHECK_PERIOD_S = 30  # slurmctld's PERIODIC_TIMEOUT: time limits and --signal warnings
MARKER = "TRAINBOOK_SLURM_CLUSTER"
# whole seconds between seeing a job requeued and releasing it: slurmd compares a credential's
# timestamp with the revocation's at one-second resolution (`Cluster.release`)
RELEASE_AFTER_S = 2
INSTALL = "apt-get install -y slurm-wlm munge"


def missing() -> str | None:
    """Why a cluster cannot start here (None: it can): the programs, root, Linux."""
    absent = [p for p in (*DAEMONS, *CLIENTS) if shutil.which(p) is None
              and not Path("/usr/sbin", p).exists()]
    if absent:
        return f"SLURM is not installed ({', '.join(absent)} missing): {INSTALL} (Debian)"
    if not Path("/proc/self/environ").exists():
        return "a SLURM cluster here needs Linux (/proc)"
    if os.geteuid() != 0:
        return "slurmd must run as root to start jobs; run as root (CI does)"
    return None


def _program(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def _die_with_parent() -> None:  # in the child, before exec: SIGKILL when the parent dies
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1


def slurm_conf(root: Path, host: str, cpus: int, ctld_port: int, slurmd_port: int) -> str:
    """The slurm.conf of a one-node cluster whose state, logs and sockets live under `root`."""
    return "\n".join([
        "ClusterName=trainbook", f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={ctld_port}", f"SlurmdPort={slurmd_port}",
        "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={root}/munge/sock",
        "SlurmUser=root", "SlurmdUser=root", f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool", f"SlurmctldPidFile={root}/slurmctld.pid",
        f"SlurmdPidFile={root}/slurmd.pid", f"SlurmctldLogFile={root}/log/slurmctld.log",
        f"SlurmdLogFile={root}/log/slurmd.log", "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none", "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
        "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
        "ReturnToService=2", "MpiDefault=none", "MailProg=/bin/true",
        f"NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1000 State=UNKNOWN",
        f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP "
        "OverSubscribe=YES", ""])


def parse_record(text: str) -> dict[str, str]:
    """`scontrol show job -o` (one line of Key=Value pairs) as a dict."""
    out = {}
    for item in text.split():
        key, sep, value = item.partition("=")
        if sep:
            out[key] = value
    return out


class Cluster:
    """munged + slurmctld + slurmd under a temporary folder (a context manager)."""

    def __init__(self, cpus: int | None = None, start_timeout_s: float = 30,
                 extra_env: dict[str, str] | None = None, keep: bool = False):
        reason = missing()
        if reason:
            raise RuntimeError(reason)
        self.cpus = cpus or os.cpu_count() or 1
        if self.cpus < 1 or start_timeout_s <= 0:
            raise ValueError(f"need cpus >= 1 and start_timeout_s > 0, got {cpus}, "
                             f"{start_timeout_s}")
        self.start_timeout_s, self.keep = start_timeout_s, keep
        self.root = Path(tempfile.mkdtemp(prefix="trainbook-slurm-"))
        self.host = socket.gethostname().split(".")[0]
        # jobs see this Python's environment first, as sbatch from an activated venv gives
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        self.env = {**os.environ, **(extra_env or {}), "PATH": path,
                    "SLURM_CONF": str(self.root / "slurm.conf"), MARKER: str(self.root)}
        self.procs: dict[str, subprocess.Popen] = {}
        self.started = 0.0  # time.time() when slurmctld started: its 30 s checks count from here

    # ---- life cycle ----------------------------------------------------------------------------

    def __enter__(self) -> Cluster:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _start(self) -> None:
        root = self.root
        root.chmod(0o755)  # munged checks that every folder above its socket is searchable
        for d in ("munge", "state", "spool", "log"):
            (root / d).mkdir()
        key = root / "munge" / "key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        conf = slurm_conf(root, self.host, self.cpus, free_port(), free_port())
        (root / "slurm.conf").write_text(conf)
        self._daemon("munged", ["munged", "-F", f"--key-file={key}",
                                f"--socket={root}/munge/sock", f"--pid-file={root}/munge/pid",
                                f"--seed-file={root}/munge/seed",
                                f"--log-file={root}/log/munged.log"])
        self._wait(lambda: (root / "munge" / "sock").exists(), "munged to open its socket")
        self.started = time.time()
        self._daemon("slurmctld", ["slurmctld", "-D", "-f", str(root / "slurm.conf")])
        self._wait(lambda: self._quiet("sinfo"), "slurmctld to answer")
        self._daemon("slurmd", ["slurmd", "-D", "-f", str(root / "slurm.conf")])
        self._wait(lambda: self._quiet("sinfo", "-h", "-o", "%t").strip() == "idle",
                   "the node to be idle")

    def _daemon(self, name: str, argv: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "w")
        self.procs[name] = subprocess.Popen([_program(argv[0]), *argv[1:]], stdout=log,
                                            stderr=subprocess.STDOUT, env=self.env,
                                            preexec_fn=_die_with_parent)
        log.close()

    def _quiet(self, *argv: str) -> str:
        r = subprocess.run([_program(argv[0]), *argv[1:]], capture_output=True, text=True,
                           env=self.env, timeout=10)
        return r.stdout if r.returncode == 0 else ""

    def _wait(self, ready: Callable[[], object], what: str) -> None:
        end = time.monotonic() + self.start_timeout_s
        while not ready():
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{dead[0]} exited while waiting for {what}: "
                                   f"{self.log(dead[0])[-2000:]}")
            if time.monotonic() > end:
                raise TimeoutError(f"waited {self.start_timeout_s:g} s for {what}; logs in "
                                   f"{self.root / 'log'}")
            time.sleep(0.2)

    def stop(self) -> None:
        """Cancel every job, stop the daemons, kill what the jobs left behind (by pid only), and
        remove the folder unless `keep`."""
        if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            try:
                self._quiet("scancel", "--user", "root")
            except subprocess.TimeoutExpired:
                pass
        for name in reversed(DAEMONS):
            p = self.procs.get(name)
            if p is not None and p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(timeout=5)
        for pid in self.leftovers():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not self.keep:
            shutil.rmtree(self.root, ignore_errors=True)

    def leftovers(self) -> list[int]:
        """Pids of live processes started for this cluster (its marker is in their
        environment): job steps, slurmstepd, anything a job spawned."""
        mark = f"{MARKER}={self.root}".encode()
        out = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                if mark in (entry / "environ").read_bytes().split(b"\0"):
                    out.append(int(entry.name))
            except OSError:  # gone, or not ours to read
                continue
        return out

    # ---- using it ------------------------------------------------------------------------------

    def run(self, *argv: str, timeout_s: float = 30, cwd: str | Path | None = None) -> str:
        """A client command against this cluster; its stdout. Raises with its stderr on failure."""
        r = subprocess.run([_program(argv[0]), *argv[1:]], capture_output=True, text=True,
                           env=self.env, timeout=timeout_s, cwd=cwd)
        if r.returncode:
            raise RuntimeError(f"{' '.join(argv)} failed (exit {r.returncode}): {r.stderr.strip()}")
        return r.stdout

    def submit(self, script: str | Path, cwd: str | Path) -> int:
        """sbatch a script file (from `cwd`); the job id."""
        out = self.run("sbatch", "--parsable", str(script), cwd=cwd)
        return int(out.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """The job's record (`scontrol show job -o`): JobState, Reason, Restarts, ..."""
        return parse_record(self.run("scontrol", "show", "job", "-o", str(job_id)))

    def release(self, job_id: int) -> None:
        """Start a requeued job (seen PENDING, reason BeginTime) as soon as it is safe.

        SLURM holds a requeued job for the credential lifetime + 1 s (job_mgr.c) because slurmd
        refuses a launch credential stamped in the same second as the old attempt's revocation:
        the job then fails with "Job credential revoked". The revocation precedes the requeue, so
        waiting until `RELEASE_AFTER_S` wall-clock seconds have turned over is enough."""
        now = time.time()
        time.sleep(math.floor(now) + RELEASE_AFTER_S - now)
        self.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")

    def next_check(self) -> float:
        """Seconds until slurmctld next checks time limits (and sends --signal warnings)."""
        return CHECK_PERIOD_S - (time.time() - self.started) % CHECK_PERIOD_S

    def log(self, name: str) -> str:
        """A daemon's output and log file so far (name: munged, slurmctld or slurmd)."""
        paths = [self.root / "log" / f"{name}.out", self.root / "log" / f"{name}.log"]
        return "".join(p.read_text(errors="replace") for p in paths if p.exists())
