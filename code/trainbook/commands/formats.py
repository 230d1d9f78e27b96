"""trainbook formats: the number formats of training, computed from their bit fields.

Prints the element formats (fp32, tf32, fp16, bf16, fp8, fp6, fp4, E8M0: layout, max, smallest
normal and subnormal, eps, digits, binades) and the block formats (MXFP8/6/4, NVFP4: element,
scale, block, bits per element). `--value X` shows what X becomes in each format; `--overflow`
measures what each cast of PyTorch (and ml_dtypes, if installed) does past the max, on
`--device`.

Chapter: book/precision/formats.
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from .. import formats as F
from ..precision import formats as PF
from ..report import table
from ._args import finite_float

HELP = "number formats (fp32 ... fp4, MX, NVFP4): ranges, precision, rounding, overflow"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--value", type=finite_float, default=None,
                   help="show what this number becomes in each format (rounded to nearest "
                        "even; the format's own overflow rule)")
    p.add_argument("--overflow", action="store_true",
                   help="measure what each library cast does with values past the max, inf "
                        "and NaN")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where --overflow runs torch's casts (cuda: a GPU's own kernels)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")


def _block_rows() -> list[dict]:
    return [{"format": b.name, "element": b.element, "scale": b.scale, "block": b.block,
             "tensor scale": "fp32" if b.tensor_scale else "-",
             "bits/element": b.bits_per_element} for b in F.BLOCK_FORMATS.values()]


def value_rows(value: float) -> list[dict]:
    """What `value` becomes in each element format: the stored value, its relative error,
    the spacing of the format at value, and a note (overflow, flushed, subnormal, unsigned)."""
    x = torch.tensor([value], dtype=torch.float64)
    rows = []
    for f in F.FORMATS.values():
        unsigned = not f.signed and value <= 0
        stored = math.nan if unsigned else F.quantize(x, f).item()
        finite = math.isfinite(stored)
        if unsigned:
            note = "unsigned: no such value"
        elif not finite or abs(value) > f.max:
            note = "overflow"
        elif value and stored == 0:
            note = "flushed to zero"
        elif 0 < abs(stored) < f.min_normal:
            note = "subnormal"
        else:
            note = ""
        error = (abs(stored - value) / abs(value) if value else 0.0) if finite else None
        rows.append({"format": f.name, "stored": stored, "relative error": error,
                     "spacing here": (PF.spacing(x, f).item()
                                      if abs(value) <= f.max and not unsigned else None),
                     "note": note})
    return rows


def _short(rows: list[dict]) -> list[dict]:
    """Floats to 4 significant digits (3.403e+38, not 39 digits), for the text tables."""
    return [{k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in r.items()} for r in rows]


def run(args: argparse.Namespace) -> int:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device here; use --device cpu")
    out: dict = {"formats": PF.format_table(), "block formats": _block_rows()}
    if args.value is not None:
        out["value"] = {"input": args.value, "rows": value_rows(args.value)}
    if args.overflow:
        try:
            out["overflow"] = PF.overflow_table(device=args.device)
        except ValueError:  # ml_dtypes missing: torch's casts only
            out["overflow"] = PF.overflow_table(("torch",), device=args.device)
    if args.json:
        print(json.dumps(out, indent=2, default=str))
        return 0
    cols = ["format", "bits", "layout", "max", "min normal", "min subnormal", "eps",
            "decimal digits", "binades", "inf", "NaN"]
    print("Element formats (computed from the bit fields; eps is the gap after 1):")
    print(table(_short(out["formats"]), cols))
    print("\nBlock formats (bits per element include the shared scale):")
    print(table(out["block formats"]))
    if "value" in out:
        print(f"\n{args.value!r} in each format:")
        print(table(_short(out["value"]["rows"])))
    if "overflow" in out:
        print(f"\nWhat each cast does ({args.device}); the rule for finite overflow and for inf:")
        cols = ["library", "dtype", "max", "max + gap/2", "2 max", "inf", "nan", "overflow",
                "inf becomes"]
        print(table(_short(out["overflow"]), cols))
    return 0
