"""trainbook params: exact parameter counts of a model, by component.

Chapter: book/compute/flops.
"""

from __future__ import annotations

import argparse
import json

from .. import configs
from ..report import table
from ._args import check_model_file

HELP = "parameter counts by component for a preset or a Hugging Face config.json"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help=f"preset ({', '.join(configs.PRESETS)}) or path to a config.json")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    check_model_file(args.model)
    cfg = configs.resolve(args.model)
    counts = configs.param_counts(cfg)
    if args.json:
        print(json.dumps({"model": cfg.name, "config": cfg.to_dict(), "params": counts}, indent=2))
        return 0
    total = counts["total"]
    rows = [{"component": k, "parameters": v, "share": f"{v / total:.1%}"}
            for k, v in counts.items()]
    print(f"{cfg.name} ({cfg.flavour} flavour, {cfg.n_layers} layers, d_model {cfg.d_model})")
    print(table(rows))
    return 0
