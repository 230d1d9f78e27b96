"""trainbook benchtrain: training speed of the reference model against Hugging Face transformers.

For each model, builds the reference model and a transformers copy holding the same weights
(GPT2LMHeadModel or LlamaForCausalLM), then times training steps (forward, backward, AdamW) of
both in one process, rounds interleaved, warm-up excluded, and prints the median tokens/s of each
and the ratio ours / transformers (>= 1: the reference model is at least as fast). fp32 on CPU,
bf16 autocast on GPU. Needs transformers (pip install "trainbook[hf]"). On a CPU shared with
other work, --threads 1 gives steadier numbers than threads fighting over cores.
Example: python -m trainbook benchtrain --threads 1 --output benchtrain-cpu.json

Chapter: book/compute/throughput.
"""

from __future__ import annotations

import argparse
import json
import platform
from contextlib import nullcontext
from pathlib import Path

import torch

from ..bench import hf, matmul
from ..launch import threads
from ..report import table
from ._args import check_model_file, check_writable, command_line, non_negative_int, positive_int

HELP = "training tokens/s of the reference model vs Hugging Face transformers, same weights"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", nargs="+", default=list(hf.DEFAULT_MODELS), metavar="MODEL",
                   help=f"presets, bench sizes ({', '.join(hf.BENCH_SIZES)}) or config.json "
                        "paths; gpt2 or llama flavour, no MoE "
                        f"(default: {' '.join(hf.DEFAULT_MODELS)})")
    d = hf.DEFAULTS
    p.add_argument("--batch", type=positive_int, default=d["batch"],
                   help=f"sequences per step (default {d['batch']})")
    p.add_argument("--seq-len", type=positive_int, default=d["seq_len"],
                   help=f"tokens per sequence (default {d['seq_len']})")
    p.add_argument("--steps", type=positive_int, default=d["steps"],
                   help=f"training steps per timed round (default {d['steps']})")
    p.add_argument("--repeats", type=positive_int, default=d["repeats"],
                   help=f"timed rounds per model, ours and transformers interleaved "
                        f"(default {d['repeats']})")
    p.add_argument("--warmup", type=non_negative_int, default=d["warmup"],
                   help=f"untimed steps per model first (default {d['warmup']})")
    p.add_argument("--device", default="auto", help="auto (GPU if visible), cpu, cuda or cuda:N")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="CPU threads for torch (default: torch's choice)")
    p.add_argument("--output", metavar="FILE", help="write the results as JSON to FILE")
    p.add_argument("--json", action="store_true", help="print the results as JSON, no progress bar")


def results(args: argparse.Namespace, rows: list[dict], device: torch.device) -> dict:
    """The results document: what ran, where, with which versions, and one row per model."""
    meta = matmul.metadata(device, hf.precision(device), command_line(args))
    meta.update(kind="benchtrain", transformers=hf.require_transformers().__version__,
                python=platform.python_version(), batch=args.batch, seq_len=args.seq_len,
                steps=args.steps, repeats=args.repeats, warmup=args.warmup)
    return {**meta, "rows": rows}


def run(args: argparse.Namespace) -> int:
    for m in args.models:
        check_model_file(m)
    cfgs = [hf.resolve(m) for m in args.models]  # every input checked before any work
    if len({c.name for c in cfgs}) != len(cfgs):
        raise ValueError(f"--models names a model twice: {' '.join(args.models)}")
    device = None
    for cfg in cfgs:
        device = hf.check_inputs(cfg, args.batch, args.seq_len, args.steps, args.repeats,
                                 args.device, args.warmup)
    if args.output and Path(args.output).is_dir():
        raise ValueError(f"--output {args.output} is a folder; give a file name")
    check_writable(args.output, "--output")
    with threads(args.threads) if args.threads else nullcontext():
        from tqdm.auto import tqdm
        rows = []
        with tqdm(total=len(cfgs) * args.repeats, desc="benchtrain", unit="round",
                  disable=args.json) as bar:
            for cfg in cfgs:
                bar.set_postfix_str(cfg.name)
                r = hf.train_speed(cfg, args.batch, args.seq_len, args.steps, args.repeats,
                                   device, warmup=args.warmup, on_repeat=bar.update)
                rows.append(r.to_dict())
        doc = results(args, rows, device)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(doc, indent=2) + "\n")
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    print(f"{doc['device_name']}, {doc['dtype']}, torch {doc['torch']}, "
          f"transformers {doc['transformers']}; {args.batch} x {args.seq_len} tokens per step, "
          f"median of {args.repeats} rounds of {args.steps} steps")
    print(table([{"model": r["model"], "params": r["params"],
                  "ours tok/s": round(r["ours_tokens_per_s"]),
                  "transformers tok/s": round(r["hf_tokens_per_s"]),
                  "ours / transformers": r["ratio"]} for r in rows]))
    print("ours / transformers > 1: the reference model trains faster; < 1: transformers does")
    if args.output:
        print(f"results written to {args.output}")
    return 0
