"""trainbook train: the reference trainer (one process, or under torchrun with DDP)."""

import argparse
import dataclasses
import json

from ..train import TrainConfig, config_fields

HELP = "train the reference model on the shipped corpus (works under torchrun)"


def add_arguments(p):
    """One option per TrainConfig field, documented by the field's own help text."""
    for f in config_fields():
        flag, help = "--" + f.name.replace("_", "-"), f"{f.metadata['help']} (default: {f.default})"
        if f.type == "bool":
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help)
        else:
            conv = int if f.type.startswith("int") else float if f.type.startswith("float") else str
            p.add_argument(flag, type=conv, default=f.default, help=help)
    p.add_argument("--json-out", help="write the config, summary and per-step history to this JSON file")


def run(args) -> int:
    import torch.distributed as dist

    from ..train import train

    result = train(TrainConfig(**{f.name: getattr(args, f.name) for f in config_fields()}))
    if args.json_out and (not dist.is_initialized() or dist.get_rank() == 0):
        summary = {"config": dataclasses.asdict(result.config),
                   "model_config": result.model_config.to_dict(),
                   "flops_per_token": result.flops_per_token, "peak_flops": result.peak_flops,
                   "peak_source": result.peak_source, "val_loss": result.val_loss,
                   "world_size": result.world_size, "history": result.history}
        with open(args.json_out, "w") as fh:
            json.dump(summary, fh, indent=1)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0
