"""Sharded checkpoints across layouts and world sizes: DCP saves on N ranks, loads on M.

`load_under` builds the reference model and optimizer under a layout (FSDP, TP, or one
process) with the trainer's own builders and loads a DCP checkpoint into it with the trainer's
`load_sharded`; `full_state` gathers what a layout holds into whole tensors under reference
names, so `same_state` can compare two layouts bit for bit. `save_then_load` and
`train_on_ranks` run under `trainbook.launch.run`: train under one layout, load under another.

Chapter: book/failures/checkpointing.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from ..train import TrainConfig, layout_for, make_optimizer, train
from ..train.checkpoint import load_checkpoint, load_sharded, staged


def full_state(parts: list, optimizer: torch.optim.Optimizer) -> dict:
    """The whole model and optimizer state as plain CPU tensors under reference names,
    gathered from whatever layout holds it (every rank must call it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from ..train.checkpoint import as_one_module

    # cpu_offload would leave the full state on rank 0 only; every rank gets it here
    opts = StateDictOptions(full_state_dict=True, cpu_offload=False)
    model_sd, optim_sd = get_state_dict(as_one_module(parts), optimizer, options=opts)
    return staged({"model": dict(model_sd), "optim": optim_sd})


def load_under(folder: str, **layout: int) -> tuple[list, torch.optim.Optimizer, dict]:
    """Build the reference model and optimizer under a layout (options of TrainConfig such as
    dp_shard=2 or tp=2; none: one process) and load the DCP checkpoint at `folder` into them
    with the trainer's load_sharded: (this rank's model parts, optimizer, extra state)."""
    from ..configs import ModelConfig
    from ..model import Transformer
    from ..train.parallelize import build_mesh, parallelize

    extra = load_checkpoint(Path(folder) / "extra.pt")
    whole = dict(dp_shard=1, tp=1, pp=1, dp_replicate=1, layout=None)
    cfg = replace(TrainConfig(**extra["train_config"]), **{**whole, **layout})
    world = dist.get_world_size() if dist.is_initialized() else 1
    mcfg = ModelConfig(**extra["model_config"])
    lay = layout_for(cfg, world, mcfg)
    model = Transformer(mcfg)
    parts = parallelize(model, lay, build_mesh(lay, "cpu")) if lay.gpus > 1 else [model]
    optimizer = make_optimizer(torch.nn.ModuleList(parts), cfg)
    return parts, optimizer, load_sharded(folder, parts, optimizer)


def sharded_state(folder: str, **layout: int) -> dict:
    """The full state (full_state) of the DCP checkpoint at `folder` as loaded under a layout
    (load_under): on every rank, whatever the layout, the same tensors."""
    parts, optimizer, _ = load_under(folder, **layout)
    return full_state(parts, optimizer)


def save_then_load(cfg_kwargs: dict, load_layout: dict) -> dict:
    """(On the ranks of launch.run.) Train a TrainConfig with a ckpt_dir under its layout, then
    load its newest checkpoint under `load_layout` (load_under): the losses, the checkpoint's
    path and the full state as loaded."""
    from ..train import latest_checkpoint

    losses = train_on_ranks(cfg_kwargs)
    latest = latest_checkpoint(cfg_kwargs["ckpt_dir"])
    return {"losses": losses, "path": str(latest),
            "state": sharded_state(str(latest), **load_layout)}


def train_on_ranks(cfg_kwargs: dict) -> list[float]:
    """Train a TrainConfig on the ranks of the current process group (under launch.run);
    the loss history."""
    from ..launch import threads

    with threads(1):
        return train(TrainConfig(**cfg_kwargs)).losses()


def same_state(a: dict, b: dict) -> list[str]:
    """The keys where two full states (full_state) differ, bit for bit; [] when equal."""
    def flat(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from flat(v, f"{prefix}{k}.")
            elif isinstance(v, torch.Tensor):
                yield f"{prefix}{k}", v
    fa, fb = dict(flat(a)), dict(flat(b))
    return sorted(k for k in fa.keys() | fb.keys()
                  if k not in fa or k not in fb or not torch.equal(fa[k], fb[k]))
