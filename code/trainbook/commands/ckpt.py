"""trainbook ckpt: inspect, verify and convert the trainer's checkpoints (a step-NNNNNN.pt file
or a step-NNNNNN DCP folder written by `train --ckpt-dir`).

`inspect` prints the step, the files, the bytes of each component (weights, optimizer state,
random state, data position, history, configs), dtypes, the configs and whether checksums are
recorded. `verify` checks the recorded sha256 of every file, loads with weights_only=True,
checks the weights against the model config and for inf/NaN, the optimizer state against the
parameters, the training config and the step against the history: exit status 1 on any
problem, 0 when every check passes. `convert` writes a DCP folder as one file (`--to single`),
one file as a DCP folder (`--to dcp`, to move a DDP run to FSDP/TP/PP), the weights as
safetensors (`--to safetensors`) or as a Hugging Face folder (`--to hf`).

  python -m trainbook ckpt inspect ckpt/step-000100.pt
  python -m trainbook ckpt verify ckpt/step-000100
  python -m trainbook ckpt convert ckpt/step-000100 --to single --out one/step-000100.pt
  python -m trainbook ckpt convert ckpt/step-000100.pt --to safetensors --out model.safetensors
  python -m trainbook ckpt convert ckpt/step-000100.pt --to hf --out hf-model

Chapter: book/failures/checkpointing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..failures.ckpt_tools import TARGETS
from ._args import check_writable

HELP = "inspect, verify (checksums, safe load, config) or convert a training checkpoint"
ACTIONS = ("inspect", "verify", "convert")
FOLDERS = ("dcp", "hf")  # targets written as a folder


def add_arguments(p: argparse.ArgumentParser) -> None:
    # a positional action, not nested subparsers, so an unknown option is reported by name
    p.add_argument("action", nargs="?", metavar="{inspect,verify,convert}",
                   help="inspect: what it holds; verify: check it (exit 1 on a problem); "
                        "convert: write it in another format")
    p.add_argument("path", nargs="?", metavar="PATH",
                   help="a checkpoint: a step-NNNNNN.pt file or a step-NNNNNN DCP folder")
    p.add_argument("--to", choices=TARGETS, default=None,
                   help="convert: single (a DCP folder as one file), dcp (one file as a DCP "
                        "folder), safetensors (the weights), hf (a Hugging Face folder)")
    p.add_argument("--out", default=None, help="convert: the file or folder to write")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def check_args(args: argparse.Namespace) -> None:
    """Everything wrong with the command line, found before any work."""
    if args.action not in ACTIONS:
        raise ValueError(f"give an action: one of {', '.join(ACTIONS)}, then a checkpoint path "
                         f"(got {args.action!r}; see `python -m trainbook ckpt --help`)")
    if args.action == "convert":
        if args.to is None or args.out is None:
            raise ValueError("ckpt convert needs --to (single, dcp, safetensors or hf) and "
                             "--out (where to write)")
        folder = args.to in FOLDERS
        check_writable(args.out, "--out", folder=folder)
        out = Path(args.out)
        if folder and out.is_dir() and any(out.iterdir()):
            raise ValueError(f"--out {args.out} is a folder with files in it; give a new or "
                             "empty folder, so old files cannot mix with the converted ones")
    elif args.to is not None or args.out is not None:
        raise ValueError(f"--to and --out are for ckpt convert, not ckpt {args.action}")
    if args.path is None:
        raise ValueError(f"ckpt {args.action} needs a checkpoint path: a step-NNNNNN.pt file "
                         "or step-NNNNNN folder written by train --ckpt-dir")
    if not Path(args.path).exists():
        raise ValueError(f"no checkpoint at {args.path}: give a step-NNNNNN.pt file or "
                         "step-NNNNNN folder written by train --ckpt-dir")
    if args.action == "convert" and Path(args.out).resolve() == Path(args.path).resolve():
        raise ValueError("--out is the checkpoint itself; give another path")


def _print_inspect(info: dict) -> None:
    from ..report import table

    print(f"{info['path']}: {info['kind']}, step {info['step']}, "
          f"{info['bytes_on_disk']:,} bytes on disk; checksums: {info['checksums']}")
    m = info["model"]
    print(f"model {m['name']} ({m['flavour']}): d_model {m['d_model']}, {m['n_layers']} layers, "
          f"{m['n_heads']} heads ({m['n_kv_heads']} kv), d_ff {m['d_ff']}, vocab "
          f"{m['vocab_size']}")
    print("train: " + ", ".join(f"{k} {v}" for k, v in info["train"].items()))
    if info["loader"]:
        print(f"data position: epoch {info['loader']['epoch']}, micro-batch "
              f"{info['loader']['step']} of it, data-parallel size "
              f"{info['loader']['world_size']}; last loss {info['last_loss']}")
    print(table(info["components"], ["component", "tensors", "bytes", "dtypes", "holds"]))


def run(args: argparse.Namespace) -> int:
    from ..failures import ckpt_tools

    check_args(args)
    if args.action == "inspect":
        info = ckpt_tools.inspect(args.path)
        print(json.dumps(info, indent=1, default=str)) if args.json else _print_inspect(info)
        return 0
    if args.action == "verify":
        report = ckpt_tools.verify(args.path)
        if args.json:
            print(json.dumps(report, indent=1))
        else:
            for c in report["checks"]:
                print(f"{'ok  ' if c['ok'] else 'FAIL'} {c['check']}: {c['detail']}")
            print(f"{args.path}: {'verified' if report['ok'] else 'NOT usable as it is'}")
        return 0 if report["ok"] else 1
    out = ckpt_tools.convert(args.path, args.to, args.out)
    print(json.dumps({"wrote": str(out), "to": args.to}) if args.json else
          f"wrote {out} ({args.to})")
    return 0
