"""Joining torchrun's process group, for the commands that run on every rank (collectives, zero,
tp, cp, ep). Not a command itself: the leading underscore keeps it out of the command list.

torchrun starts one process per rank and puts RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous
address in the environment, where `init_process_group` (env://) reads them. Outside torchrun
there is no group to join, so the commands say how to start them instead of failing deep inside
torch. Chapter: the "At scale" sections of book/parallelism/*.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist


def world_size(command: str) -> int:
    """The number of ranks: the current group's, else the one torchrun announced. Raises a
    ValueError with the torchrun line to use when there is neither."""
    if dist.is_initialized():
        return dist.get_world_size()
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ValueError(f"`{command}` runs on every rank of a process group: start it with "
                         f"torchrun, e.g. torchrun --standalone --nproc_per_node 2 -m trainbook "
                         f"{command} (srun + torchrun across nodes)")
    return int(os.environ["WORLD_SIZE"])


@contextmanager
def process_group(timeout_s: float = 120, backend: str | None = None) -> Iterator[str]:
    """Join torchrun's group for the body and leave it afterwards, also on an error. backend None:
    nccl when a GPU is visible (this rank on cuda:LOCAL_RANK), else gloo. Inside a group that
    already exists (`trainbook.launch.run`) it joins nothing and leaves the group to its owner.
    Yields the backend."""
    if dist.is_initialized():
        yield dist.get_backend()
        return
    if not timeout_s > 0:
        raise ValueError(f"--timeout-s must be a positive number of seconds, got {timeout_s}")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        yield backend
    finally:
        dist.destroy_process_group()


def is_main() -> bool:
    """Rank 0, the one that prints (every rank computes the same summary)."""
    return dist.get_rank() == 0
