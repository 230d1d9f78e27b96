"""trainbook slurm: write the sbatch script that trains under SLURM, one node or many.

srun starts one torchrun agent per node; the agents meet at a rendezvous on the first node of the
allocation; the trainer runs with --ckpt-dir DIR --resume, so a requeued job continues from its
newest checkpoint. With --signal-lead (default 300 s) the batch shell gets USR1 that long before
the time limit, tells every rank to checkpoint and exit (SIGTERM), waits, and requeues the job.
--sweep OPTION=V1,V2,... makes a job array, one member per value, each in its own folder. The
trainer's options follow `--`; they are checked here, before anything is submitted:

  python -m trainbook slurm --nodes 4 --gpus-per-node 8 --time 24:00:00 --partition gpu \\
      --ckpt-dir /shared/ckpt/run1 --output train.sbatch -- --model llama-3-8b --dtype bf16 \\
      --dp-shard 32 --steps 100000 --ckpt-every 500
  python -m trainbook slurm --gpus-per-node 0 --nproc-per-node 2 --cpus-per-task 2 --time 30 \\
      --sweep lr=1e-3,3e-3,1e-2 -- --steps 2000
  sbatch train.sbatch

Chapter: book/failures/slurm.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import shlex
import sys
from pathlib import Path

from ..failures import slurm
from ._args import check_writable, non_negative_int, positive_int

HELP = "write an sbatch script: srun + torchrun, pre-timeout checkpoint, requeue, sweeps"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=positive_int, default=1, help="nodes (default: 1)")
    p.add_argument("--gpus-per-node", type=non_negative_int, default=8,
                   help="GPUs per node; 0 for CPU nodes (default: 8)")
    p.add_argument("--nproc-per-node", type=positive_int, default=None,
                   help="ranks per node (default: one per GPU; required on CPU nodes)")
    p.add_argument("--cpus-per-task", type=positive_int, default=None,
                   help="cores for each node's ranks (default: the cluster's default)")
    p.add_argument("--time", default="24:00:00",
                   help="time limit, SLURM format: MM, HH:MM:SS or D-HH:MM:SS (default: 24:00:00)")
    p.add_argument("--signal-lead", type=non_negative_int, default=300,
                   help="seconds before the limit to checkpoint and requeue; SLURM may signal up "
                        "to 60 s earlier; 0: no signal (default: 300)")
    p.add_argument("--no-requeue", action="store_true",
                   help="checkpoint at the signal, but do not requeue")
    p.add_argument("--partition", default=None, help="partition (default: the cluster's)")
    p.add_argument("--account", default=None, help="account to charge (default: yours)")
    p.add_argument("--job-name", default="train", help="job name (default: train)")
    p.add_argument("--ckpt-dir", default="ckpt",
                   help="checkpoint folder, on storage every node sees (default: ckpt)")
    p.add_argument("--sweep", default=None, metavar="OPTION=V1,V2",
                   help="a job array over one trainer option, e.g. lr=1e-3,3e-3")
    p.add_argument("--max-parallel", type=positive_int, default=None,
                   help="sweep members running at once (default: all)")
    p.add_argument("--port", type=positive_int, default=None,
                   help="rendezvous port (default: 15000 + job id mod 10000)")
    p.add_argument("--numa-binding", choices=slurm.NUMA_BINDINGS, default=None,
                   help="torchrun's CPU binding of each rank (default: node on GPU nodes, none "
                        "on CPU nodes)")
    p.add_argument("--exclusive", action="store_true", help="ask for whole nodes")
    p.add_argument("--log", default="%x-%j.out",
                   help="the job's log file, SLURM patterns allowed (default: %%x-%%j.out)")
    p.add_argument("--output", default=None,
                   help="write the script to this file (default: print it)")
    p.add_argument("--json", action="store_true",
                   help="print a JSON object (the script, its options, the file written)")
    p.add_argument("train_args", nargs="*", default=[], metavar="-- TRAIN_ARGS",
                   help="-- then the trainer's options (python -m trainbook train --help)")


def check_train_args(args: list[str], ckpt_dir: str, world: int) -> None:
    """The trainer's options checked before anything is queued, as the trainer would on start:
    parsed by its own parser, its configuration built (ranges, combinations), the model preset
    or config.json, and the layout against the job's `world` ranks (for the bpe and bytes
    tokenizers, whose vocabulary is known without a file). A typo fails here, not in the queue
    hours later."""
    from .. import configs
    from ..__main__ import build_parser
    from ..train import TrainConfig, config_fields, layout_for, model_config
    from ._args import check_model_file

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parsed = build_parser("trainbook").parse_args(["train", *args])
    except SystemExit:
        lines = err.getvalue().strip().splitlines() or ["invalid"]
        why = lines[-1].removeprefix("error: ").split(" (see `")[0]
        raise ValueError(f"the trainer's options after --: {why} (see `python -m trainbook "
                         "train --help`)") from None
    values = {f.name: getattr(parsed, f.name) for f in config_fields()}
    try:
        cfg = TrainConfig(**{**values, "ckpt_dir": ckpt_dir, "resume": True})
        check_model_file(cfg.model)
        configs.resolve(cfg.model)
        vocab = {"bytes": 256, "bpe": cfg.vocab_size}.get(cfg.tokenizer)
        if vocab is not None:
            layout_for(cfg, world, model_config(cfg, vocab))
    except ValueError as e:
        raise ValueError(f"the trainer's options after --: {e}") from None


def spec_from_args(args: argparse.Namespace) -> slurm.JobSpec:
    """The JobSpec the options describe, its trainer options checked."""
    train_args = list(args.train_args or [])
    if train_args and train_args[0] == "--":
        train_args = train_args[1:]
    ranks = args.nproc_per_node or args.gpus_per_node
    check_train_args(train_args, args.ckpt_dir, args.nodes * max(ranks, 1))
    return slurm.JobSpec(
        train_args=tuple(train_args), ckpt_dir=args.ckpt_dir, nodes=args.nodes,
        gpus_per_node=args.gpus_per_node, nproc_per_node=args.nproc_per_node,
        cpus_per_task=args.cpus_per_task, time=args.time, signal_lead_s=args.signal_lead,
        requeue=not args.no_requeue, partition=args.partition, account=args.account,
        job_name=args.job_name, output=args.log,
        sweep=slurm.parse_sweep(args.sweep) if args.sweep else None,
        max_parallel=args.max_parallel, port=args.port, numa_binding=args.numa_binding,
        exclusive=args.exclusive)


def run(args: argparse.Namespace) -> int:
    if args.port is not None and not 1024 <= args.port <= 65535:
        raise ValueError(f"--port must be in 1024..65535, got {args.port}")
    check_writable(args.output, "--output")
    check_writable(args.ckpt_dir, "--ckpt-dir", folder=True)
    spec = spec_from_args(args)
    text = slurm.sbatch_script(spec, shlex.join(["python", "-m", "trainbook", *sys.argv[1:]])
                               if Path(sys.argv[0]).name in ("__main__.py", "trainbook")
                               else None)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(text)
        Path(args.output).chmod(0o755)
    if args.json:
        print(json.dumps({"output": args.output, "spec": dataclasses.asdict(spec),
                          "script": text}, indent=1))
    elif args.output:
        print(f"wrote {args.output}: sbatch {shlex.quote(args.output)}")
    else:
        print(text, end="")
    return 0
