"""sbatch scripts for the trainer, one node or many: srun starts one torchrun agent per node, the
agents meet at a rendezvous on the first node of the allocation, and the ranks train with
`--ckpt-dir ... --resume`, so every attempt of the job continues from the newest checkpoint.

What the generated script does, each choice measured on a real controller (book/failures/slurm):

- **Rendezvous.** `MASTER_ADDR` is the first host of `scontrol show hostnames
  "$SLURM_JOB_NODELIST"`; the port is derived from the job id (15000-24999, below Linux's
  ephemeral range), so two jobs on one node do not clash; `--rdzv_id` is the job id.
- **Pre-timeout checkpoint.** `#SBATCH --signal=B:USR1@LEAD` sends USR1 to the batch shell alone,
  LEAD seconds (SLURM: up to 60 s more) before the time limit. Its trap sends SIGTERM to every
  process of the job's steps (`scancel --signal=TERM $SLURM_JOB_ID`): the torchrun agents
  handle SIGTERM and pass it on, the trainer's guard finishes the step, checkpoints and exits 0.
  The trap waits for that, then requeues. The alternatives fail, measured: without `B:` every
  process of the step gets USR1 and the torchrun agent dies of it (USR1's default action) before
  its workers can checkpoint; `kill -TERM` of srun makes srun kill the step at once.
- **Requeue.** `--requeue` and `scontrol requeue $SLURM_JOB_ID`: the same job id runs the script
  again from the top (SLURM_RESTART_COUNT counts the attempts), `--open-mode=append` keeps every
  attempt's log in one file.
- **CPU binding.** `--cpus-per-task` gives the node's torchrun task its cores; OpenMP threads are
  cores / ranks per node; on GPU nodes torchrun's `--numa-binding` (torch >= 2.11) puts each rank
  on the CPUs near its GPU.
- **Sweeps.** A job array, one member per value of one trainer option, each with its own
  checkpoint folder (the guard's lock refuses two runs in one folder).

Chapter: book/failures/slurm.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..train.checkpoint import checkpoint_path

NUMA_BINDINGS = ("none", "node", "socket", "exclusive", "core-complex")
# how the batch shell passes the pre-timeout signal on: the generator's default, and the
# alternative the chapter measures (srun treats SIGTERM as "kill the step")
FORWARD = {"scancel": 'scancel --signal=TERM "$SLURM_JOB_ID"',
           "srun-term": 'kill -TERM "$TRAIN_PID"'}
EARLY_S = 60  # sbatch(1): "the signal may be sent up to 60 seconds earlier than specified"
SET_BY_SCRIPT = ("--ckpt-dir", "--resume", "--no-resume", "--resume-from")
_OPTION = re.compile(r"--[a-z][a-z0-9-]*")


def parse_time(text: str) -> int:
    """A SLURM time limit in seconds: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS
    (sbatch's formats)."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+(?::\d+){0,2})", str(text).strip())
    if not m:
        raise ValueError(f"time limit {text!r} is not a SLURM time; write e.g. 30 (minutes), "
                         "04:00:00 or 2-00:00:00")
    days, rest = m.groups()
    parts = [int(x) for x in rest.split(":")]
    if days is not None:  # D-HH, D-HH:MM, D-HH:MM:SS
        h, mi, s = parts + [0] * (3 - len(parts))
    else:  # MM, MM:SS, HH:MM:SS
        h, mi, s = {1: [0, parts[0], 0], 2: [0, *parts], 3: parts}[len(parts)]
    hours_given = days is not None or len(parts) == 3
    if s >= 60 or (hours_given and mi >= 60):
        raise ValueError(f"time limit {text!r}: minutes and seconds must be below 60")
    seconds = int(days or 0) * 86400 + h * 3600 + mi * 60 + s
    if seconds < 60:
        raise ValueError(f"time limit {text!r} is under a minute; SLURM counts in minutes, "
                         "give at least 1 (one minute)")
    return seconds


def parse_sweep(text: str) -> tuple[str, tuple[str, ...]]:
    """'lr=1e-3,3e-3' -> ('--lr', ('1e-3', '3e-3')): one trainer option and its values."""
    name, sep, values = str(text).partition("=")
    option = "--" + name.strip().lstrip("-").replace("_", "-")
    vals = tuple(v.strip() for v in values.split(",") if v.strip())
    if not sep or not _OPTION.fullmatch(option) or not vals:
        raise ValueError(f"sweep {text!r}: write OPTION=V1,V2,..., e.g. lr=1e-3,3e-3,1e-2 "
                         "(one trainer option, comma-separated values)")
    if option in SET_BY_SCRIPT:
        raise ValueError(f"sweep {text!r}: {option} is set by the script; sweep a training "
                         "option such as lr or seed")
    bad = [v for v in vals if not re.fullmatch(r"[A-Za-z0-9._+-]+", v)]
    if bad:
        raise ValueError(f"sweep value {bad[0]!r} has characters a folder name cannot carry; "
                         "use letters, digits and . _ + -")
    if len(set(vals)) != len(vals):
        raise ValueError(f"sweep {text!r} repeats a value; give each value once")
    return option, vals


@dataclass(frozen=True)
class JobSpec:
    """What the sbatch script asks for and runs. `train_args` are the trainer's options
    (`python -m trainbook train ...`) without --ckpt-dir and --resume, which the script sets."""

    train_args: tuple[str, ...] = ()
    ckpt_dir: str = "ckpt"
    nodes: int = 1
    gpus_per_node: int = 8  # 0: CPU nodes (gloo)
    nproc_per_node: int | None = None  # ranks per node; default: one per GPU
    cpus_per_task: int | None = None  # cores of each node's torchrun task
    time: str = "24:00:00"
    signal_lead_s: int = 300  # 0: no pre-timeout signal
    requeue: bool = True
    partition: str | None = None
    account: str | None = None
    job_name: str = "train"
    output: str = "%x-%j.out"
    sweep: tuple[str, tuple[str, ...]] | None = None  # (option, values): a job array
    max_parallel: int | None = None  # array members running at once (%N)
    port: int | None = None  # None: 15000 + job id mod 10000
    numa_binding: str | None = None  # None: node on GPU nodes, none on CPU nodes
    launcher: str = "torchrun"
    exclusive: bool = False
    extra_sbatch: tuple[str, ...] = field(default=())  # more #SBATCH lines, e.g. --qos=high

    def __post_init__(self) -> None:
        for name in ("nodes", "nproc_per_node", "cpus_per_task", "port", "max_parallel"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
        if self.gpus_per_node < 0:
            raise ValueError(f"gpus_per_node must be >= 0 (0: CPU nodes), got "
                             f"{self.gpus_per_node}")
        if self.gpus_per_node == 0 and self.nproc_per_node is None:
            raise ValueError("CPU nodes (gpus_per_node 0) need nproc_per_node: how many ranks "
                             "each node runs")
        if self.port is not None and not 1024 <= self.port <= 65535:
            raise ValueError(f"port must be in 1024..65535, got {self.port}")
        limit = parse_time(self.time)
        if self.signal_lead_s < 0:
            raise ValueError(f"signal_lead_s must be >= 0 (0: no signal), got "
                             f"{self.signal_lead_s}")
        if self.signal_lead_s > 65535:
            raise ValueError(f"signal_lead_s {self.signal_lead_s} is past sbatch's limit of "
                             "65535 s")
        if self.signal_lead_s and self.signal_lead_s >= limit:
            raise ValueError(f"a signal {self.signal_lead_s} s before a time limit of "
                             f"{self.time} ({limit} s) leaves the job no time to train; lower "
                             "the signal lead or raise the time limit")
        if self.numa_binding is not None and self.numa_binding not in NUMA_BINDINGS:
            raise ValueError(f"numa_binding must be one of {', '.join(NUMA_BINDINGS)}, got "
                             f"{self.numa_binding!r}")
        if self.max_parallel is not None and self.sweep is None:
            raise ValueError("max_parallel limits a sweep's array: give a sweep too")
        for arg in self.train_args:
            if arg.split("=")[0] in SET_BY_SCRIPT:
                raise ValueError(f"train argument {arg} is set by the script (--ckpt-dir "
                                 "CKPT_DIR --resume on every attempt); leave it out and give "
                                 "the folder as the script's ckpt_dir (slurm --ckpt-dir)")
            if self.sweep and arg.split("=")[0] == self.sweep[0]:
                raise ValueError(f"{arg} is swept; leave it out of the train arguments")
        if not re.fullmatch(r"[A-Za-z0-9._-]+", self.job_name):
            raise ValueError(f"job name {self.job_name!r}: use letters, digits and . _ -")

    @property
    def ranks_per_node(self) -> int:
        return self.nproc_per_node or self.gpus_per_node


def final_step(spec: JobSpec) -> int:
    """The step the run ends at: the train arguments' --steps, or the trainer's default."""
    from ..train.config import TrainConfig

    args, value = list(spec.train_args), None
    for i, arg in enumerate(args):
        if arg.startswith("--steps="):
            value = arg.split("=", 1)[1]
        elif arg == "--steps" and i + 1 < len(args):
            value = args[i + 1]
    if value is None:
        return TrainConfig.steps
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"--steps {value!r} in the train arguments is not a whole number >= 1")
    return int(value)


def _sbatch_lines(spec: JobSpec, batch_signal: bool) -> list[tuple[str, str]]:
    """(#SBATCH option, why) pairs."""
    lines = [(f"--job-name={spec.job_name}", ""), (f"--nodes={spec.nodes}", ""),
             ("--ntasks-per-node=1", "one torchrun agent per node; it starts the ranks")]
    if spec.gpus_per_node:
        lines.append((f"--gpus-per-node={spec.gpus_per_node}", ""))
    if spec.cpus_per_task:
        lines.append((f"--cpus-per-task={spec.cpus_per_task}", "the node's cores, for its ranks"))
    lines.append((f"--time={spec.time}", ""))
    for opt in ("partition", "account"):
        if getattr(spec, opt):
            lines.append((f"--{opt}={getattr(spec, opt)}", ""))
    if spec.exclusive:
        lines.append(("--exclusive", "whole nodes: no other job's ranks beside ours"))
    if spec.signal_lead_s:
        where = "B:" if batch_signal else ""
        why = ("USR1 to the batch shell only" if batch_signal else "USR1 to every process of "
               "every step") + f", {spec.signal_lead_s} s (up to {spec.signal_lead_s + EARLY_S}"\
            " s) before the limit"
        lines.append((f"--signal={where}USR1@{spec.signal_lead_s}", why))
    lines.append(("--requeue" if spec.requeue else "--no-requeue",
                  "a requeued job runs this script again" if spec.requeue else ""))
    lines += [("--open-mode=append", "every attempt's log in one file"),
              (f"--output={spec.output}", "")]
    if spec.sweep:
        n = len(spec.sweep[1])
        throttle = f"%{spec.max_parallel}" if spec.max_parallel else ""
        lines.append((f"--array=0-{n - 1}{throttle}", f"one member per {spec.sweep[0]} value"))
    lines += [(x, "") for x in spec.extra_sbatch]
    return lines


def sbatch_script(spec: JobSpec, command: str | None = None, batch_signal: bool = True,
                  forward: str = "scancel") -> str:
    """The sbatch script for `spec`. `command` is recorded in its header. `batch_signal` and
    `forward` exist for the chapter's measurements of the alternatives (USR1 to every process;
    SIGTERM to srun); the defaults are the ones that checkpoint."""
    if forward not in FORWARD:
        raise ValueError(f"forward must be one of {', '.join(FORWARD)}, got {forward!r}")
    ranks = spec.ranks_per_node
    numa = spec.numa_binding or ("node" if spec.gpus_per_node else "none")
    width = max(len(opt) for opt, _ in _sbatch_lines(spec, batch_signal)) + 10
    out = ["#!/bin/bash", f"# generated by: {command or 'trainbook.failures.slurm.sbatch_script'}"]
    out += [(f"#SBATCH {opt}".ljust(width) + f"# {why}").rstrip() if why else f"#SBATCH {opt}"
            for opt, why in _sbatch_lines(spec, batch_signal)]
    threads = f"$(( ${{SLURM_CPUS_PER_TASK:-{ranks}}} / {ranks} ))"
    port = str(spec.port) if spec.port else "$(( 15000 + SLURM_JOB_ID % 10000 ))"
    out += ["", "set -uo pipefail",
            "export PYTHONUNBUFFERED=1  # log lines reach the file as they happen",
            f"export OMP_NUM_THREADS={threads}  # cores per rank",
            'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            f"MASTER_PORT={port}",
            f"CKPT_DIR={shlex.quote(spec.ckpt_dir)}"]
    sweep_args: list[str] = []
    if spec.sweep:
        option, values = spec.sweep
        out += [f"VALUES=({' '.join(values)})  # {option}",
                'VALUE="${VALUES[$SLURM_ARRAY_TASK_ID]}"',
                f'CKPT_DIR="$CKPT_DIR/{option.lstrip("-")}-$VALUE"']
        sweep_args = [option, '"$VALUE"']
    out += ['echo "job $SLURM_JOB_ID attempt ${SLURM_RESTART_COUNT:-0} on $SLURM_JOB_NODELIST:'
            ' rendezvous $MASTER_ADDR:$MASTER_PORT, checkpoints in $CKPT_DIR"']
    if spec.signal_lead_s and batch_signal:
        final = checkpoint_path("$CKPT_DIR", final_step(spec), sharded=True).name
        requeue = ['  if compgen -G "$CKPT_DIR/' + final + '*" > /dev/null; then',
                   '    echo "the run is complete: no requeue"; exit 0',
                   "  fi",
                   '  scontrol requeue "$SLURM_JOB_ID"  # the next attempt resumes from it']\
            if spec.requeue else []
        out += ["", "on_usr1() {  # the time limit is near",
                '  echo "USR1 at $(date +%s): checkpoint, then '
                + ('requeue"' if spec.requeue else 'stop"'),
                f"  {FORWARD[forward]}  # every rank: finish the step, checkpoint, exit 0",
                '  wait "$TRAIN_PID"  # the checkpoint is written',
                *requeue, "  exit 0", "}", "trap on_usr1 USR1"]
    torchrun = [spec.launcher, '--nnodes "$SLURM_NNODES"', f"--nproc_per_node {ranks}",
                "--rdzv_backend c10d", '--rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT"',
                '--rdzv_id "$SLURM_JOB_ID"']
    if numa != "none":
        torchrun.append(f"--numa-binding {numa}")
    train = ["-m trainbook train", *map(shlex.quote, spec.train_args), *sweep_args,
             '--ckpt-dir "$CKPT_DIR"', "--resume"]
    out += ["", "srun --kill-on-bad-exit=1 \\", "  " + _wrap([*torchrun, *train], "    ") + " &",
            "TRAIN_PID=$!  # the shell runs traps only between commands: wait, do not block",
            'wait "$TRAIN_PID"', ""]
    return "\n".join(out)


def _pairs(words: Sequence[str]) -> list[str]:
    """An option and its value as one unit ('--steps 100'), so a line break never parts them."""
    out: list[str] = []
    for w in words:
        if out and out[-1].startswith("-") and " " not in out[-1] and not w.startswith("-"):
            out[-1] += " " + w
        else:
            out.append(w)
    return out


def _wrap(words: Sequence[str], indent: str, width: int = 88) -> str:
    """Words joined by spaces, broken with a backslash before `width` columns, never between an
    option and its value."""
    lines, line = [], ""
    for w in _pairs(words):
        if line and len(indent) + len(line) + 1 + len(w) > width - 2:
            lines.append(line)
            line = w
        else:
            line = f"{line} {w}" if line else w
    lines.append(line)
    return (" \\\n" + indent).join(lines)
