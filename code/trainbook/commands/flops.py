"""trainbook flops: training FLOPs of a model, by component, with recomputation and 6N beside it.

Counts matmul FLOPs exactly for the reference model built from the config (trainbook.model):
forward, backward (2x forward) and recomputation. Totals per token, per sequence, per step
(--batch sequences) and for a run of --tokens tokens. 6N and PaLM's 6N + 12LHQT for comparison.

Chapter: book/compute/flops.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .. import configs
from ..compute import flops
from ..compute.cost import parse_count
from ..report import table
from ._args import check_model_file

HELP = "training FLOPs by component (exact matmul count), recomputation, 6N and PaLM's count"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help=f"preset ({', '.join(configs.PRESETS)}) or path to a config.json")
    p.add_argument("--seq-len", type=int, required=True,
                   help="tokens per sequence T (the attention term grows with it)")
    p.add_argument("--recompute", choices=flops.RECOMPUTE, default="none",
                   help="activation recomputation: none; selective (attention QK^T and AV "
                        "recomputed); full (every block's forward recomputed). Default: none")
    p.add_argument("--causal", action="store_true",
                   help="count only the causal half of the T x T attention matmuls "
                        "(default: the full square, as the math kernel and PaLM's MFU count)")
    p.add_argument("--batch", type=int, default=1,
                   help="sequences per optimizer step, for the per-step total (default: 1)")
    p.add_argument("--tokens", default=None,
                   help="training tokens for the run total, e.g. 300e9, 300B or 15T")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def report(model: str | Path | configs.ModelConfig, seq_len: int, recompute: str = "none",
           causal: bool = False, batch: int = 1, tokens: float | None = None) -> dict:
    """Everything the command prints, as a dict (the --json output)."""
    cfg = configs.resolve(model)
    configs.check_seq_len(cfg, seq_len)
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"--batch must be a positive integer, got {batch!r}")
    fwd = flops.forward_flops(cfg, seq_len, causal)
    model_f = flops.training_flops(cfg, seq_len, "none", causal)
    hw = flops.training_flops(cfg, seq_len, recompute, causal)
    rows = [{"component": k, "forward": fwd[k], "model (fwd+bwd)": model_f[k],
             f"hardware ({recompute})": hw[k], "share": model_f[k] / model_f["total"]}
            for k in fwd if k != "total" and fwd[k]]
    n = flops.matmul_params(cfg)
    per_token = {"model": model_f["total"] / seq_len, "hardware": hw["total"] / seq_len,
                 "6N": 6 * n, "palm_6N_12LHQT": flops.training_flops_per_token(cfg, seq_len)}
    out = {"model": cfg.name, "seq_len": seq_len, "recompute": recompute, "causal": causal,
           "batch": batch, "matmul_params": n, "components": rows,
           "per_sequence": {"model": model_f["total"], "hardware": hw["total"]},
           "per_token": per_token,
           "per_step": {"model": batch * model_f["total"], "hardware": batch * hw["total"]}}
    if tokens is not None:
        tokens = parse_count(tokens)
        out["tokens"] = tokens
        out["run"] = {k: v * tokens for k, v in per_token.items()}
    return out


def run(args: argparse.Namespace) -> int:
    check_model_file(args.model)
    tokens = parse_count(args.tokens) if args.tokens is not None else None
    r = report(args.model, args.seq_len, args.recompute, args.causal, args.batch, tokens)
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    print(f"{r['model']}: matmul FLOPs for one sequence of {r['seq_len']} tokens "
          f"({'causal half' if r['causal'] else 'full T x T square'} of attention)")
    rows = [{**row, "share": f"{row['share']:.1%}"} for row in r["components"]]
    print(table(rows))
    print()
    totals = [{"count": "per token", **{k: float(v) for k, v in r["per_token"].items()}},
              {"count": f"per step ({r['batch']} seq)", "model": float(r["per_step"]["model"]),
               "hardware": float(r["per_step"]["hardware"])}]
    if "run" in r:
        totals.append({"count": f"run ({r['tokens']:.3g} tokens)", **r["run"]})
    print(table([{k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in t.items()}
                 for t in totals], ["count", "model", "hardware", "6N", "palm_6N_12LHQT"]))
    print(f"\nmodel = forward + backward; hardware adds recomputation ({r['recompute']}); "
          f"6N with N = {r['matmul_params']:,} matmul parameters (output head included).")
    return 0
