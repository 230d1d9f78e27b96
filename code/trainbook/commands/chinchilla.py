"""trainbook chinchilla: the compute-optimal model size and token count for a FLOP budget.

Minimises the Chinchilla parametric law L(N, D) = E + A/N^alpha + B/D^beta under C = 6 N D
(Hoffmann et al. 2022, equation 4) with the paper's Approach 3 constants (--fit hoffmann) or
the Epoch AI refit of Besiroglu et al. 2024 (--fit epoch, the default), and prints N_opt,
D_opt, tokens per parameter and the predicted final loss (nats per token on MassiveText).

Chapter: book/compute/scaling-laws.
"""

from __future__ import annotations

import argparse
import json

from ..compute import scaling
from ..report import table

HELP = "compute-optimal parameters and tokens for a FLOP budget (Chinchilla scaling law)"


def _flops(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        import argparse
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number; write FLOPs like 5.76e23") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--flops", type=_flops, required=True, nargs="+", metavar="C",
                   help="training budget(s) in FLOPs, e.g. 5.76e23 (Chinchilla/Gopher) "
                        "or 1e24 2e25")
    p.add_argument("--fit", default="epoch", choices=list(scaling.FITS),
                   help="constants of the law: epoch (Besiroglu et al. 2024 refit, default), "
                        "hoffmann (Hoffmann et al. 2022 Approach 3 as printed) or hoffmann-tex "
                        "(its unrounded values)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    rows = [scaling.compute_optimal(c, args.fit) for c in args.flops]
    if args.json:
        print(json.dumps(rows if len(rows) > 1 else rows[0], indent=2))
        return 0
    fit = scaling.get_fit(args.fit)
    print(f"fit {fit.name}: E={fit.E:g}, A={fit.A:g}, B={fit.B:g}, alpha={fit.alpha:g}, "
          f"beta={fit.beta:g} ({fit.source})")
    print(table([{"FLOPs": f"{r['flops']:.3g}", "params (N_opt)": f"{r['params']:.3g}",
                  "tokens (D_opt)": f"{r['tokens']:.3g}",
                  "tokens/param": round(r["tokens_per_param"], 1),
                  "predicted loss": round(r["loss"], 3)} for r in rows]))
    return 0
