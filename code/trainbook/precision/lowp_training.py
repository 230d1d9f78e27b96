"""Training the reference model under precision variants, on any CPU: the runs of the mixed-
precision chapter, and the stored results with what made them.

A `Variant` says what changes from fp32 training: the linear layers' numerics (`train.emulate`'s
bf16 or fp16 recipe on the blocks and the head, which is what autocast runs in low precision),
a loss multiplier (a power of two: what averaging over 2^k times more tokens per backward pass,
or accumulating over 2^k micro-batches, does to every gradient's scale), dynamic loss scaling
(`LossScaler`), and how the weights are stored (`LowPrecisionWeights`: an fp32 master copy, or
bf16 rounded to nearest, with Kahan compensation, or stochastically).

Everything else is the trainer's: `TrainConfig`, its model, initialisation, batches, AdamW
parameter groups, schedule, clipping and evaluation, so the fp32 variant equals
`trainbook.train.train` on the same config bit for bit, in one thread as both run here
(tests/test_mixed_precision.py). Runs
are stored as JSON under book/precision/data/ with the command, date, versions and machine
(`write_runs`) and read back by the chapter (`read_runs`).

Chapter: book/precision/mixed-precision.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import pandas as pd
import torch

from ..bench.gpu_truth import header
from ..data import ByteTokenizer, ShardedLoader, build_dataset
from ..launch import threads
from ..model import Transformer
from ..train import TrainConfig, evaluate, lr_at, make_optimizer, model_config
from ..train.emulate import convert_linears
from ..train.init import init_weights
from .loss_scaling import LossScaler
from .lowp_weights import MODES, LowPrecisionWeights

__all__ = ["CONFIG", "STORED", "Variant", "read_runs", "save_runs", "summarise",
           "trained_model", "train_variant", "write_runs", "write_stored"]


@dataclass(frozen=True)
class Variant:
    """One way to train: `recipe` None (fp32 matmuls) or a `train.emulate` recipe applied to the
    blocks' and the head's linear layers; `loss_multiplier` (a power of two) multiplies the loss
    before backward and divides the gradients after it; `scaling` turns on dynamic loss scaling
    (LossScaler with `init_scale` and `growth_interval`); `weights` is a LowPrecisionWeights
    mode."""

    name: str
    recipe: str | None = None
    loss_multiplier: float = 1.0
    scaling: bool = False
    weights: str = "master"
    init_scale: float = 2.0**16
    growth_interval: int = 2000

    def __post_init__(self):
        m, _ = math.frexp(self.loss_multiplier)
        if not (math.isfinite(self.loss_multiplier) and m == 0.5):
            raise ValueError(f"loss_multiplier must be a power of two (exact to undo), "
                             f"got {self.loss_multiplier}")
        if self.weights not in MODES:
            raise ValueError(f"weights must be one of {', '.join(MODES)}, got {self.weights!r}")
        if self.recipe is not None:
            from ..train.emulate import recipe
            recipe(self.recipe)  # an unknown name says which exist


def _check_config(cfg: TrainConfig) -> None:
    if cfg.tokenizer != "bytes" or cfg.objective != "clm" or cfg.grad_accum != 1:
        raise ValueError("precision variants train the byte-level reference model with the "
                         "clm objective and one micro-batch per step: set tokenizer='bytes', "
                         "objective='clm', grad_accum=1")
    if cfg.optimizer != "adamw":
        raise ValueError(f"precision variants wrap the trainer's AdamW; got optimizer "
                         f"{cfg.optimizer!r}")


@threads(1)
def train_variant(variant: Variant, cfg: TrainConfig, eval_batches: int = 8) -> dict:
    """Train as `cfg` says (bytes, one process, CPU) with `variant`'s numerics. Returns the
    per-step loss, learning rate, loss scale, whether the step was skipped (an inf or NaN
    gradient under loss scaling), the share of updates round-to-nearest would lose, the final
    validation loss (inf if the gradients became non-finite without scaling) and seconds."""
    _check_config(cfg)
    return _train(variant, cfg, eval_batches)[0]


@threads(1)
def trained_model(variant: Variant, cfg: TrainConfig) -> torch.nn.Module:
    """The model after training `cfg` (to cfg.stop_after, if set) with `variant`: what the
    chapters take tensors and gradients from."""
    _check_config(cfg)
    return _train(variant, cfg, 1, evaluate_at_end=False)[1]


def _train(variant: Variant, cfg: TrainConfig, eval_batches: int,
           evaluate_at_end: bool = True) -> tuple[dict, torch.nn.Module]:
    data = build_dataset(ByteTokenizer(), cfg.seq_len, cfg.corpus)
    mcfg = model_config(cfg, ByteTokenizer().vocab_size)
    torch.manual_seed(cfg.seed)  # as the trainer: the same weights, then the same batches
    random.seed(cfg.seed)
    model = Transformer(mcfg)
    init_weights(model, cfg.init, cfg.mup_base_width)
    if variant.recipe:
        convert_linears(model, variant.recipe, skip=("router",), include=("blocks", "head"))
    opt = LowPrecisionWeights(make_optimizer(model, cfg), variant.weights, seed=cfg.seed)
    scaler = LossScaler(variant.init_scale, growth_interval=variant.growth_interval) \
        if variant.scaling else None
    loader = ShardedLoader(data.train, cfg.batch_size, seed=cfg.seed)
    last = cfg.steps if cfg.stop_after is None else min(cfg.steps, cfg.stop_after)
    hist = {k: [] for k in ("loss", "lr", "scale", "skipped", "lost")}
    t0, diverged = time.perf_counter(), False
    for step in range(last):
        lr = lr_at(step, cfg)
        for g in opt.param_groups:
            g["lr"] = lr * g.get("lr_scale", 1.0)
        x, y = loader.next_batch()
        loss = model(x, y)[1]
        scaled = loss * variant.loss_multiplier
        (scaler.scale(scaled) if scaler else scaled).backward()
        scale = scaler.get_scale() if scaler else 1.0
        skipped = scaler.unscale_(opt) if scaler else False
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        for g in grads:
            g.div_(variant.loss_multiplier)  # exact: a power of two
        if not scaler and not all(bool(torch.isfinite(g).all()) for g in grads):
            diverged = True
            break
        lost = math.nan
        if not skipped:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or math.inf)
            lost = opt.step()
        if scaler:
            scaler.update()
        opt.zero_grad(set_to_none=True)
        for k, v in zip(hist, (loss.item(), lr, scale, skipped, lost)):
            hist[k].append(v)
    val = math.nan if not evaluate_at_end else math.inf if diverged else \
        evaluate(model, data.val, cfg.batch_size, eval_batches, torch.device("cpu"))
    return {"variant": variant.name, "seed": cfg.seed, **hist, "val_loss": val,
            "diverged": diverged, "seconds": time.perf_counter() - t0}, model


def write_runs(path: str | Path, measurement: str, variants: list[Variant], cfg: TrainConfig,
               seeds: list[int], command: str) -> Path:
    """Train every variant for every seed and store the runs as JSON: the command that
    regenerates the file, the date, versions and machine (`bench.gpu_truth.header`), the
    config, the variants and each run's history."""
    if not variants or not seeds:
        raise ValueError("give at least one variant and one seed")
    if len({v.name for v in variants}) != len(variants):
        raise ValueError("variant names must be distinct")
    _check_config(cfg)
    runs = [train_variant(v, replace(cfg, seed=s)) for v in variants for s in seeds]
    return save_runs(path, measurement, command, cfg, runs, seeds,
                     variants=[asdict(v) for v in variants])


def save_runs(path: str | Path, measurement: str, command: str, cfg: TrainConfig,
              runs: list[dict], seeds: list[int], **extra: object) -> Path:
    """Store runs as JSON with what made them: the command that regenerates the file, the
    date, versions and machine (`bench.gpu_truth.header`), the config and the seeds."""
    doc = header(measurement, command, torch.device("cpu"), "small")
    doc.update(config=asdict(cfg) | {"cache_dir": None}, seeds=list(seeds), **extra, runs=runs)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return path


def read_runs(path: str | Path) -> tuple[dict, list[dict]]:
    """(the file's header, config and anything else stored; the runs) of a `save_runs` file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no stored runs at {path}; write them with the command in the "
                         "chapter (precision.lowp_training.write_runs)")
    doc = json.loads(path.read_text())
    for k in ("command", "date_utc", "versions", "device", "config", "seeds", "runs"):
        if k not in doc:
            raise ValueError(f"{path} is not a save_runs file: it has no {k!r}")
    runs = doc.pop("runs")
    return doc, runs


def summarise(runs: list[dict], tail: int = 20) -> pd.DataFrame:
    """One row per variant (in order of appearance): the mean and spread over seeds of the
    final validation loss, the mean training loss of the last `tail` steps, the skipped steps,
    and the share of updates round to nearest would lose in the first and last `tail` steps."""
    rows = []
    for r in runs:  # runs of the trainer (fp8_training) have no skipped or lost steps
        lost = pd.Series(r.get("lost", []), dtype=float)
        rows.append({"variant": r["variant"], "seed": r["seed"], "val_loss": r["val_loss"],
                     "train_loss": float(pd.Series(r["loss"][-tail:]).mean()),
                     "skipped": int(sum(r.get("skipped", []))), "lost_first": lost[:tail].mean(),
                     "lost_last": lost[-tail:].mean(), "diverged": r.get("diverged", False)})
    df = pd.DataFrame(rows)
    order = list(dict.fromkeys(df.variant))
    out = df.groupby("variant", sort=False).agg(
        val_loss=("val_loss", "mean"), val_std=("val_loss", "std"),
        train_loss=("train_loss", "mean"), skipped=("skipped", "sum"),
        lost_first=("lost_first", "mean"), lost_last=("lost_last", "mean"),
        seeds=("seed", "count"))
    return out.loc[order]


# The stored runs of the chapter: the reference model (Llama flavour, bytes, 2 layers of width
# 64), 300 steps of 16 x 64 tokens, three seeds. `write_stored(name)` regenerates a file.
CONFIG = TrainConfig(tokenizer="bytes", d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                     d_ff=176, seq_len=64, batch_size=16, steps=300, warmup_steps=20,
                     eval_batches=8, progress=False, log_every=0)
MULTIPLIER = 2.0**-8  # 256 micro-batches of 1,024 tokens accumulated: every gradient / 256
STORED = {
    "mixed-training": dict(cfg=CONFIG, seeds=[0, 1, 2], variants=[
        Variant("fp32"),
        Variant("bf16", "bf16"),
        Variant("bf16, x 2^-8", "bf16", MULTIPLIER),
        Variant("fp16", "fp16"),
        Variant("fp16, x 2^-8", "fp16", MULTIPLIER),
        Variant("fp16, x 2^-8, loss scaling", "fp16", MULTIPLIER, scaling=True)]),
    "mixed-lowp-weights": dict(cfg=replace(CONFIG, lr=1e-3), seeds=[0, 1, 2], variants=[
        Variant("fp32 master", "bf16"),
        Variant("bf16, nearest", "bf16", weights="nearest"),
        Variant("bf16, Kahan", "bf16", weights="kahan"),
        Variant("bf16, stochastic", "bf16", weights="stochastic")]),
}


def write_stored(name: str, folder: str | Path = "book/precision/data") -> Path:
    """Regenerate one of the chapter's stored files (`STORED`) as folder/<name>.json."""
    if name not in STORED:
        raise ValueError(f"unknown stored runs {name!r}; choose one of {', '.join(STORED)}")
    spec = STORED[name]
    command = ('python -c "from trainbook.precision.lowp_training import write_stored; '
               f"write_stored('{name}')\"")
    return write_runs(Path(folder) / f"{name}.json", name, spec["variants"], spec["cfg"],
                      spec["seeds"], command)
