"""trainbook moe-params: total against active parameters and FLOPs per token of a mixture of
experts, from its config.json (Mixtral, DeepSeek-V3 and any model the reference config reads),
and, for the shipped models, the published figures recomputed.

Chapter: book/frontier/moe.
"""

from __future__ import annotations

import argparse
import json

from ..frontier import moe_accounting as A
from ..report import table
from ._args import positive_int

HELP = "total vs active parameters and FLOPs/token of an MoE (mixtral-8x7b, deepseek-v3, or a " \
       "config.json), with published figures recomputed"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help=f"{' or '.join(A.MODELS)} (config.json values shipped with trainbook), "
                        "or the path of a Hugging Face config.json (deepseek_v3, mixtral, "
                        "llama, mistral, qwen2, qwen3)")
    p.add_argument("--seq-len", type=positive_int, default=4096,
                   help="tokens per sequence for the attention FLOPs (default: 4096)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")


def report(model: str, seq_len: int = 4096) -> dict:
    """Everything the command prints, as a dict (the --json output)."""
    hf = A.load(model)
    counts = A.counts(hf)
    out = {"model": model, "model_type": hf.get("model_type"), "params": counts,
           "flops_per_token": A.flops_per_token(hf, seq_len), "seq_len": seq_len}
    if model in A.MODELS:
        out["published"] = A.published_check([model])
    return out


def run(args: argparse.Namespace) -> int:
    out = report(args.model, args.seq_len)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    c, f = out["params"], out["flops_per_token"]
    print(f"{out['model']} ({out['model_type']}): {c['total'] / 1e9:.2f} B total, "
          f"{c['active'] / 1e9:.2f} B active per token "
          f"({c['active_no_embedding'] / 1e9:.2f} B without the embedding)")
    print(table([{"component": k, "parameters": v, "billions": f"{v / 1e9:.3f}"}
                 for k, v in c.items()]))
    print(f"training FLOPs per token at sequence length {args.seq_len}: "
          f"{f['moe'] / 1e9:.1f} GFLOP; a dense model of the same total: "
          f"{f['dense_equivalent'] / 1e9:.1f} GFLOP ({f['ratio']:.1f}x)")
    if "published" in out:
        print(table([{k: r[k] for k in ("quantity", "printed (B)", "ours, as printed", "agrees",
                                        "where")} for r in out["published"]]))
    return 0
