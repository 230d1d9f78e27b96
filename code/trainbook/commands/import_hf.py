"""trainbook import-hf: a Hugging Face model folder as a reference-model checkpoint.

Reads a local folder that transformers' save_pretrained wrote (config.json and
model.safetensors, or safetensors shards and their index) for a Llama, Mistral, Qwen2, Qwen3 or
GPT-2 model; refuses, with the reason, what the reference model cannot compute (mixture of
experts, RoPE scaling, other activations). A sliding window W caps the context at W tokens, where
it equals full attention. Writes one checkpoint file (atomic, with its sha256 in SHA256SUMS):
the weights in fp32, the model config and the folder's tokenizer.json, which `export-hf`,
`eval` and `ckpt inspect` read. Then compares the logits of the imported model with
transformers' own on a random batch (skip with --no-check). Nothing is downloaded.

  python -m trainbook import-hf ./Qwen2.5-0.5B --out qwen.pt
  python -m trainbook eval qwen.pt --items 200

Chapter: book/alignment/evaluation
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ._args import check_writable

HELP = "read a local Hugging Face Llama/Mistral/Qwen2/Qwen3/GPT-2 folder into a checkpoint file"


def add_arguments(p: argparse.ArgumentParser) -> None:
    # optional in the parser so that a missing folder is reported by check_args in one line
    p.add_argument("folder", nargs="?", metavar="FOLDER",
                   help="a model folder written by save_pretrained")
    p.add_argument("--out", required=True, help="the checkpoint file to write (e.g. model.pt)")
    p.add_argument("--no-check", action="store_true",
                   help="skip comparing logits with transformers' load of the folder")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def check_args(args: argparse.Namespace) -> None:
    """Everything wrong with the command line (and the folder's config), before any weight."""
    from ..align import hf_io

    check_writable(args.out, "--out")
    if args.folder is None:
        raise ValueError("import-hf needs FOLDER: give the folder save_pretrained wrote, e.g. "
                         "python -m trainbook import-hf ./my-model --out model.pt")
    folder = Path(args.folder)
    if not folder.is_dir():
        raise ValueError(f"FOLDER {args.folder}: no such folder; give the folder save_pretrained "
                         "wrote (with config.json and model.safetensors)")
    if Path(args.out).resolve().is_relative_to(folder.resolve()):
        raise ValueError(f"--out {args.out} is inside the model folder; write it elsewhere")
    hf_io.import_config(hf_io.read_hf_config(folder))  # refuses what cannot be represented


def run(args: argparse.Namespace) -> int:
    import torch

    from ..align import hf_io
    from ..train.checkpoint import save_checkpoint
    from .export_hf import logit_check

    check_args(args)
    model = hf_io.import_hf(args.folder)
    tok_file = Path(args.folder) / "tokenizer.json"
    state = {"model": model.state_dict(), "model_config": model.cfg.to_dict(), "step": 0,
             "source": str(Path(args.folder).resolve()),
             "tokenizer_json": tok_file.read_text() if tok_file.is_file() else None}
    digest = save_checkpoint(args.out, state)
    gap = None if args.no_check else logit_check(model, Path(args.folder))
    params = sum(p.numel() for p in model.parameters())
    out = {"wrote": str(args.out), "sha256": digest, "model_config": model.cfg.to_dict(),
           "parameters": params, "tokenizer": tok_file.is_file(),
           "max_logit_difference": gap, "dtype": str(torch.float32)}
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        c = model.cfg
        print(f"wrote {args.out}: {c.flavour} flavour, {c.n_layers} layers, d_model {c.d_model}, "
              f"{c.n_heads} heads ({c.n_kv_heads} kv), vocabulary {c.vocab_size}, context "
              f"{c.max_seq_len}, {params:,} parameters"
              + ("" if tok_file.is_file() else "; no tokenizer.json in the folder"))
        if gap is not None:
            print(f"largest logit difference from transformers: {gap:.2e} (fp32)")
    return 0
