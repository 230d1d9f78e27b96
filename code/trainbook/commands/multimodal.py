"""trainbook multimodal: image tokens of real vision encoders (CLIP, SigLIP, ViT) and what they
do to a language model's sequence length, FLOPs per sample in LLaVA's two stages and activation
memory.

Chapter: book/frontier/multimodal.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .. import configs
from ..frontier import vision_cost as C
from ..report import table
from ._args import check_model_file, non_negative_int

HELP = "image tokens per image of CLIP/SigLIP/ViT encoders and their cost in a language model " \
       "(sequence length, FLOPs per sample in LLaVA's stages 1 and 2, activation memory)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-2-7b",
                   help=f"the language model: preset ({', '.join(configs.PRESETS)}) or path to a "
                        "config.json (default: llama-2-7b, the shape of LLaVA-1.5's Vicuna-7B)")
    p.add_argument("--text-tokens", type=non_negative_int, default=128,
                   help="text tokens per sample beside the image (default: 128)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def report(model: str | Path | configs.ModelConfig = "llama-2-7b", text_tokens: int = 128
           ) -> dict:
    """Everything the command prints, as a dict (the --json output)."""
    cfg = configs.resolve(model)
    rows = C.table(cfg, text_tokens)
    longest = max(r["seq"] for r in rows)
    return {"model": cfg.name, "text_tokens": text_tokens, "rows": rows,
            "fits_max_seq_len": longest <= cfg.max_seq_len, "max_seq_len": cfg.max_seq_len}


def run(args: argparse.Namespace) -> int:
    check_model_file(args.model)
    r = report(args.model, args.text_tokens)
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    print(f"{r['model']}: one image and {r['text_tokens']} text tokens per sample "
          "(LLaVA: CLS dropped; stage 1 = projector only, stage 2 = projector + LM; bf16 "
          "activations, production estimate)")
    print(table([{k: (f"{v:.1%}" if "share" in k else (f"{v:.2f}" if isinstance(v, float)
                                                          else v))
                  for k, v in row.items() if k != "source"} for row in r["rows"]]))
    if not r["fits_max_seq_len"]:
        print(f"note: the longest sequence exceeds the model's max_seq_len {r['max_seq_len']}")
    return 0
