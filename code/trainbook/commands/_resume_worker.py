"""The worker behind failures.resume's 'accum' kills and torchrun launches: train() on a JSON
TrainConfig, with a KillAt hook that SIGKILLs its own process between two micro-batches. Not a
command: the leading underscore keeps it out of the command list.

Chapter: book/failures/exact-resume.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch.distributed as dist

from ..failures.resume import KillAt
from ..train import TrainConfig, train


def main(argv: list[str] | None = None) -> int:
    """The worker: train() on a JSON TrainConfig, with a KillAt hook if asked."""
    p = argparse.ArgumentParser(prog="python -m trainbook.commands._resume_worker")
    p.add_argument("--config", required=True, help="a TrainConfig as JSON")
    p.add_argument("--kill-at", default=None, help="STEP:MICRO (none: run to the end)")
    p.add_argument("--kill-rank", type=int, default=0)
    p.add_argument("--json-out", required=True)
    args = p.parse_args(argv)
    hooks = []
    if args.kill_at:
        step, micro = (int(x) for x in args.kill_at.split(":"))
        hooks.append(KillAt(step, micro, args.kill_rank))
    result = train(TrainConfig(**json.loads(Path(args.config).read_text())), hooks=hooks)
    if not dist.is_initialized() or dist.get_rank() == 0:
        Path(args.json_out).write_text(json.dumps({"history": result.history}))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
