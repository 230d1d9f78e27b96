"""Module-level functions for launcher tests (spawned ranks import them by name)."""

import time

import torch
import torch.distributed as dist


def rank_sum():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    print(f"rank {dist.get_rank()} of {dist.get_world_size()}")
    return t.item()


def fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom on purpose")
    return "fine"


def hang_on_rank_one():
    if dist.get_rank() == 1:
        time.sleep(60)
    t = torch.zeros(1)
    dist.all_reduce(t)  # rank 0 waits here for rank 1
    return t.item()


def cli_json(argvs):
    """Run each `trainbook` command line on this rank, in the launcher's process group (the
    commands join it instead of torchrun's); (exit status, parsed JSON or None) per command."""
    import contextlib
    import io
    import json

    from trainbook.__main__ import main

    out = []
    for argv in argvs:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            code = main(argv)
        out.append((code, json.loads(buf.getvalue()) if buf.getvalue().strip() else None))
    return out
