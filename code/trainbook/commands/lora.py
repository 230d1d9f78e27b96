"""trainbook lora: LoRA's trainable and total parameters for a model, as peft prints them, and
the memory of full fine-tuning, LoRA and QLoRA of it on one GPU. The model is built on the meta
device (nothing is allocated), so a 70B model costs a second. --targets takes the reference
model's names (q k v o gate up down), transformers' (q_proj ... down_proj) or all-linear;
--quant nf4 counts a 4-bit base as peft counts it (at its logical size).

Chapter: book/alignment/lora.
"""

from __future__ import annotations

import argparse
import json

from .. import configs, hardware
from ..align import lora, lora_memory
from ..compute import memory
from ..report import table
from ._args import check_model_file, finite_float, positive_float, positive_int

HELP = "LoRA/QLoRA parameter counts (as peft prints them) and fine-tuning memory on one GPU"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help=f"preset ({', '.join(configs.PRESETS)}) or path to a config.json")
    p.add_argument("--rank", type=positive_int, default=lora_memory.DEFAULTS["r"],
                   help=f"LoRA rank r (default {lora_memory.DEFAULTS['r']})")
    p.add_argument("--alpha", type=positive_float, default=None,
                   help="LoRA alpha; the update is scaled by alpha/r (default 2 r)")
    p.add_argument("--targets", nargs="+", default=[lora.ALL_LINEAR],
                   help="layers to adapt: q k v o gate up down, q_proj ... down_proj, or "
                        "all-linear (default; every linear layer but the output head)")
    p.add_argument("--quant", choices=("none", "nf4"), default="none",
                   help="nf4: QLoRA: every linear layer of the blocks stored in NF4 with double "
                        "quantisation (as transformers' 4-bit loading does), adapters on the "
                        "targeted ones")
    p.add_argument("--dropout", type=finite_float, default=0.0,
                   help="LoRA dropout probability in [0, 1) (default 0, peft's default)")
    p.add_argument("--micro-batch", type=positive_int, default=lora_memory.DEFAULTS["micro_batch"],
                   help="sequences per step for the memory estimate (default 1)")
    p.add_argument("--seq-len", type=positive_int, default=lora_memory.DEFAULTS["seq_len"],
                   help="tokens per sequence for the memory estimate (default 2048)")
    p.add_argument("--recompute", choices=memory.RECOMPUTE,
                   default=lora_memory.DEFAULTS["recompute"],
                   help="activation recomputation (default full: gradient checkpointing)")
    p.add_argument("--gpu", default="h100-sxm",
                   help=f"GPU to check the fit on ({', '.join(hardware.SPECS)})")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def run(args: argparse.Namespace) -> int:
    check_model_file(args.model)
    cfg = configs.resolve(args.model)
    hardware.get(args.gpu)  # an unknown GPU fails before any work
    lora.check_hyper(args.rank, args.alpha or 1.0, args.dropout)
    configs.check_seq_len(cfg, args.seq_len)
    if args.seq_len > cfg.max_seq_len:
        raise ValueError(f"--seq-len {args.seq_len} exceeds {cfg.name}'s max_seq_len "
                         f"{cfg.max_seq_len}; use a shorter sequence")
    alpha = args.alpha or 2.0 * args.rank
    shapes = lora_memory.target_shapes(cfg, args.targets, args.rank)
    trainable, total = shapes.trainable, shapes.params + shapes.trainable
    kw = dict(r=args.rank, targets=args.targets, micro_batch=args.micro_batch,
              seq_len=args.seq_len, recompute=args.recompute, dropout=args.dropout)
    rows = lora_memory.memory_table([cfg], args.gpu, shapes=shapes, **kw)
    method = "qlora" if args.quant == "nf4" else "lora"
    setup = {"rank": args.rank, "alpha": alpha, "scaling": alpha / args.rank,
             "targets": lora.normalize_targets(args.targets), "quant": args.quant,
             "dropout": args.dropout, "micro_batch": args.micro_batch, "seq_len": args.seq_len,
             "recompute": args.recompute, "adapted_layers": shapes.per_layer * cfg.n_layers}
    if args.json:
        print(json.dumps({"model": cfg.name, "method": method, "setup": setup,
                          "trainable": trainable, "total": total,
                          "trainable_percent": 100 * trainable / total,
                          "peft_line": lora.peft_line(trainable, total),
                          "memory_gib": rows}, indent=2))
        return 0
    print(f"{cfg.name}: {method.upper() if method == 'qlora' else 'LoRA'} r={args.rank} "
          f"alpha={alpha:g} (scaling {alpha / args.rank:g}) on {setup['adapted_layers']} "
          f"layers ({', '.join(setup['targets'])})")
    print(lora.peft_line(trainable, total))
    print(f"memory per GPU, micro-batch {args.micro_batch}, seq {args.seq_len}, recompute "
          f"{args.recompute} (GiB):")
    keys = ("method", "weights", "grads", "optimizer", "activations", "logits", "transient",
            "peak", "fits")
    print(table([{k: r[k] for k in keys} for r in rows]))
    return 0
