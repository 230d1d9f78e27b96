"""FP8 training of the reference model, and what it saves: the runs, the memory, a speed model.

- `train_fp8` runs the trainer (`--dtype fp8-emulated --fp8-recipe R`, or fp32, or the bf16
  recipe on the same layers) on a config; a name ending in "+head" also converts the output
  head (a hook); `write_fp8_runs` stores several recipes and seeds with what made them
  (`lowp_training.save_runs`).
- `activation_saving`: the bytes a production Llama block saves for backward, against the same
  with the linear layers' inputs cached in FP8 (DeepSeek-V3 Section 3.3).
- `speedup_model`: the step-time speed-up to expect from FP8 matmuls on a GPU of the hardware
  table, from the FLOP split of `compute.flops` (only the block linears are FP8; attention's
  T x T matmuls, the head and everything that is not a matmul stay) and the casts' extra
  memory traffic. A model: `gpu_fp8_records` reads what `gpumeasure` measured, where it has.

Chapter: book/precision/fp8.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pandas as pd
import torch

from .. import hardware
from ..compute.activations import production_layer_bytes
from ..compute.flops import training_flops
from ..configs import ModelConfig
from ..launch import threads
from ..train import TrainConfig, train
from ..train.emulate import RECIPES, convert_linears
from ..train.hooks import Hook
from .lowp_training import save_runs

__all__ = ["CONFIG", "NAMES", "SEEDS", "ConvertHead", "activation_saving", "gpu_fp8_records",
           "run_names", "speedup_model", "train_fp8", "write_fp8_runs", "write_stored"]

CONVERTED = ("attn_qkv", "attn_out", "mlp")  # the block linears' FLOPs (compute.flops names)
# The chapter's stored runs: the reference model (tiny-llama: width 128, 4 heads, 2 kv heads,
# d_ff 352; 2 layers here), bytes, 300 steps of 16 x 64 tokens, three seeds (write_stored()).
CONFIG = TrainConfig(tokenizer="bytes", n_layers=2, seq_len=64, batch_size=16, steps=300,
                     warmup_steps=20, eval_batches=8, progress=False, log_every=0)
NAMES = ["fp32", "bf16", "tensorwise", "delayed", "rowwise", "blockwise", "mxfp8", "bf16+head",
         "tensorwise+head"]
SEEDS = [0, 1, 2]


class ConvertHead(Hook):
    """A trainer hook that runs the output head's matmuls with `recipe`'s numerics too."""

    def __init__(self, recipe: str):
        if recipe not in RECIPES:
            raise ValueError(f"unknown recipe {recipe!r}; choose one of {', '.join(RECIPES)}")
        self.recipe = recipe

    def on_model(self, model: torch.nn.Module) -> None:
        if not convert_linears(model, self.recipe, skip=("router",), include=("head",)):
            raise ValueError("the model has no nn.Linear 'head' to convert")


def run_names() -> tuple[str, ...]:
    """What `train_fp8` accepts: fp32, every emulate recipe, and any of them + '+head'."""
    return ("fp32", *RECIPES, *(f"{r}+head" for r in RECIPES))


@threads(1)
def train_fp8(name: str, cfg: TrainConfig) -> dict:
    """Train `cfg` with the numerics `name` says: 'fp32', a recipe of `train.emulate` on the
    blocks' linear layers (the trainer's --dtype fp8-emulated --fp8-recipe), and with '+head'
    on the output head as well. Returns the per-step losses, the validation loss, seconds."""
    if name not in run_names():
        raise ValueError(f"unknown run {name!r}; choose one of {', '.join(run_names())}")
    rcp, head = name.removesuffix("+head"), name.endswith("+head")
    run_cfg = replace(cfg, dtype="fp32") if rcp == "fp32" else \
        replace(cfg, dtype="fp8-emulated", fp8_recipe=rcp)
    run_cfg = replace(run_cfg, progress=False, log_every=0)
    res = train(run_cfg, hooks=[ConvertHead(rcp)] if head else [])
    return {"variant": name, "seed": cfg.seed, "loss": res.losses(), "val_loss": res.val_loss,
            "seconds": sum(r["step_time_s"] for r in res.history)}


def write_fp8_runs(path: str | Path, names: list[str], cfg: TrainConfig, seeds: list[int],
                   command: str) -> Path:
    """Train every name for every seed and store the runs (`lowp_training.save_runs`)."""
    if not names or not seeds:
        raise ValueError("give at least one run name and one seed")
    for n in names:
        if n not in run_names():
            raise ValueError(f"unknown run {n!r}; choose from {', '.join(run_names())}")
    runs = [train_fp8(n, replace(cfg, seed=s)) for n in names for s in seeds]
    return save_runs(path, "fp8-training", command, cfg, runs, seeds, names=list(names))


def activation_saving(cfg: ModelConfig, micro_batch: int, seq_len: int) -> dict[str, float]:
    """Bytes one block saves for backward (compute.activations' production model, bf16), and
    the same with the inputs of the QKV, gate/up and down projections cached in FP8 (1 byte
    instead of 2; the attention output stays in bf16 for attention's own backward)."""
    bf16 = production_layer_bytes(cfg, micro_batch, seq_len, "bf16")
    saved = micro_batch * seq_len * (2 * cfg.d_model + cfg.d_ff)  # one byte less per element
    return {"bf16": bf16, "fp8 inputs": bf16 - saved, "saving": saved / bf16}


def speedup_model(cfg: ModelConfig, seq_len: int, gpu: str = "h100-sxm",
                  other_share: float = 0.0, fused_casts: bool = False,
                  head: bool = False, causal: bool = True) -> dict[str, float]:
    """Step-time speed-up of FP8 over bf16 matmuls, modelled per token on `gpu`.

    The bf16 step: every matmul FLOP at the bf16 peak (compute.flops.training_flops: forward and
    backward; attention's T x T matmuls over the causal half, as FlashAttention computes them,
    unless `causal` is False), plus other work (norms, softmax, optimizer, communication not
    hidden) that is `other_share` of that step. The FP8 step: the block linears' FLOPs (and
    the head's, with `head`) at the FP8 peak, the rest unchanged, plus the casts: every
    converted matmul's activation and gradient operand read for its amax, read again and
    written in FP8 (5 bytes per element of bf16 data at the HBM bandwidth; `fused_casts`: 1
    byte, the FP8 write, the amax and the cast folded into the producing kernel). The same
    fraction of peak is assumed for both dtypes, so the ratio is the model's upper estimate."""
    if not 0 <= other_share < 1:
        raise ValueError(f"other_share is a share of the bf16 step in [0, 1), got {other_share}")
    spec = hardware.get(gpu)
    p16, p8 = spec.peak_flops("bf16"), spec.peak_flops("fp8")
    flops = training_flops(cfg, seq_len, causal=causal)
    parts = CONVERTED + (("logits",) if head else ())
    fp8_flops = sum(flops[k] for k in parts) / seq_len
    rest = flops["total"] / seq_len - fp8_flops
    matmul16 = (fp8_flops + rest) / p16
    other = matmul16 * other_share / (1 - other_share)
    d, hd, L = cfg.d_model, cfg.head_dim, cfg.n_layers
    experts = cfg.top_k if cfg.is_moe else 1
    # per token and layer: x of QKV and gate/up (d each), of o (h hd), of down (d_ff, per
    # active expert); gradients at the outputs of QKV ((h + 2 kv) hd), o (d), gate/up and down
    elems = L * (2 * d + cfg.n_heads * hd + experts * cfg.d_ff
                 + (cfg.n_heads + 2 * cfg.n_kv_heads) * hd + d + experts * (2 * cfg.d_ff + d))
    if head:
        elems += d + cfg.vocab_size
    casts = elems * (1 if fused_casts else 5) / (spec.hbm_gbps * 1e9)
    t16, t8 = matmul16 + other, fp8_flops / p8 + rest / p16 + other + casts
    return {"fp8 share of matmul FLOPs": fp8_flops / (fp8_flops + rest),
            "bf16 step (us/token)": t16 * 1e6, "fp8 step (us/token)": t8 * 1e6,
            "casts (us/token)": casts * 1e6, "speed-up": t16 / t8,
            "Amdahl limit": t16 / (t16 - fp8_flops / p16 + fp8_flops / p8)}


def gpu_fp8_records(root: str | Path = "data/gpu") -> pd.DataFrame:
    """Every measured row of `gpumeasure`'s fp8-linear.json under root/<device>/ (empty when
    no GPU has been measured yet): device, shape, bf16 and FP8 milliseconds, speed-up."""
    rows = []
    for path in sorted(Path(root).glob("*/fp8-linear.json")):
        rec = json.loads(path.read_text())
        if rec.get("status") != "measured" or not rec.get("result"):
            continue
        for r in rec["result"]["rows"]:
            rows.append({"device": rec["device"]["name"], "date": rec["date_utc"],
                         "torch": rec["versions"]["torch"], **r})
    return pd.DataFrame(rows)


def write_stored(folder: str | Path = "book/precision/data") -> Path:
    """Regenerate the chapter's stored runs, folder/fp8-training.json (NAMES, CONFIG, SEEDS)."""
    command = ('python -c "from trainbook.precision.fp8_training import write_stored; '
               'write_stored()"')
    return write_fp8_runs(Path(folder) / "fp8-training.json", NAMES, CONFIG, SEEDS, command)
