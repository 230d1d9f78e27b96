"""trainbook collapse: model collapse on text. Train the reference model on a slice of
tinyshakespeare, sample a corpus of the same size from it, train the next generation on that,
and so on, replacing the data, mixing a share of the real slice back in, or accumulating real and
synthetic data; each generation is scored on real held-out text and its samples' diversity.
Writes the rows with provenance as JSON (book/frontier/data/synthetic-collapse.json is one).

Chapter: book/frontier/synthetic-data.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from ..frontier import collapse as C
from ..report import table
from ._args import check_writable, non_negative_int, positive_float, positive_int

HELP = "model collapse on text: generations of the reference model trained on their " \
       "predecessor's samples (replace, mix, accumulate), scored on real held-out text"
INTS = ("chars", "generations", "d_model", "n_layers", "n_heads", "d_ff", "seq_len",
        "batch_size", "steps", "heldout")


def _modes(text: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in modes if m not in C.MODES]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"unknown mode {', '.join(map(repr, bad)) or repr(text)}"
                                         f"; choose from {','.join(C.MODES)}")
    return modes


def _share(text: str) -> float:
    value = positive_float(text)
    if not value < 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1), got {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    default = C.TextRecipe()
    for name in INTS:
        p.add_argument("--" + name.replace("_", "-"), type=positive_int,
                       default=getattr(default, name),
                       help=f"default: {getattr(default, name)}")
    p.add_argument("--temperature", type=positive_float, default=default.temperature,
                   help=f"sampling temperature (default: {default.temperature}; 1 samples the "
                        "model's own distribution)")
    p.add_argument("--lr", type=positive_float, default=default.lr,
                   help=f"peak learning rate (default: {default.lr})")
    p.add_argument("--seed", type=non_negative_int, default=None,
                   help="seed of every generation's initialisation and data order (default: 0)")
    p.add_argument("--modes", type=_modes, default=C.MODES,
                   help=f"comma-separated, from {','.join(C.MODES)} (default: all)")
    p.add_argument("--real-fraction", type=_share, default=0.5,
                   help="mode mix: share of each generation's corpus that is real text "
                        "(default: 0.5)")
    p.add_argument("--out", required=True, help="JSON file to write (e.g. collapse.json)")
    p.add_argument("--json", action="store_true",
                   help="print the rows as JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    if not args.out.endswith(".json"):
        raise ValueError(f"--out {args.out}: give a file name ending in .json")
    check_writable(args.out, "--out")
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(C.TextRecipe)
              if getattr(args, f.name, None) is not None}
    recipe = C.TextRecipe(**values)
    C.real_text(recipe)  # the slice and the held-out text fit in the corpus
    path = C.write_text_collapse(args.out, recipe, args.modes, args.real_fraction)
    rows = C.read_text_collapse(path)["rows"]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(table([{k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in r.items()}
                 for r in rows]))
    print(f"wrote {path}")
    return 0
