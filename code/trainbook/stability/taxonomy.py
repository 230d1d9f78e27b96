"""A taxonomy of training failures, as data: what each looks like on the monitors, its cause,
where this book reproduces it, and the fix; and a decision procedure from symptom to fix.

`FAILURES` is the list of `Failure` records; `failure_table` renders it, `decision_table` the
procedure (`DECISIONS`). Every record that names a reproduction names a chapter (a path under
book/) and a package function (a dotted name); `check_records` resolves both, so a moved
chapter or a renamed function fails the tests. A failure the book does not reproduce would say
where it will be in `future` instead (none today: hangs are planted in Part 6's hangs chapter).

`signature_runs` trains small versions of the cheap failures side by side on the CPU proxy of
the loss-spikes chapter, each recorded by the monitors that show it: a healthy run, a divergence
(far too high a learning rate, no warmup, no clipping), attention-logit growth, a data spike (a
planted junk stretch), a silent data corruption (`BitFlip`: one bit of one weight flipped after
an update, then the step replayed from a checkpoint, where it does not recur) and fp16 without
and with loss scaling (the mixed-precision chapter's emulated fp16 runs, with their loss scale).

Chapter: book/stability/taxonomy.
"""

from __future__ import annotations

import importlib
import math
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from ..formats import quantize
from ..precision.loss_scaling import LossScaler
from ..precision.lowp_training import Variant, train_variant
from ..train.hooks import Hook, StepContext
from .instability import LogitProbe, proxy_config
from .spikes import monitored_run, planted_corpus, restart_and_skip

BOOK = Path(__file__).resolve().parents[3] / "book"


@dataclass(frozen=True)
class Failure:
    """One kind of training failure. `chapter` is a path under book/ without the suffix
    ('stability/loss-spikes') and `function` a dotted name in the package; both None, with
    `future` saying where it will be reproduced, when this book does not reproduce it yet."""

    name: str
    signature: str  # what the monitors show
    cause: str
    fix: str
    chapter: str | None = None
    function: str | None = None
    future: str | None = None

    def __post_init__(self):
        if (self.chapter is None) != (self.function is None):
            raise ValueError(f"{self.name}: give both a chapter and a function, or neither")
        if self.chapter is None and not self.future:
            raise ValueError(f"{self.name}: a failure not reproduced here says where it will be "
                             "(future)")


FAILURES: list[Failure] = [
    Failure("divergence",
            "loss rises within a few steps to ln V or above and stays; gradient norm large; "
            "often NaN after",
            "learning rate far above the stable range for this model, warmup and clipping",
            "lower the peak learning rate; warm up; clip the global gradient norm",
            "stability/clipping", "trainbook.stability.clipping_runs.divergence_runs"),
    Failure("attention-logit growth",
            "largest attention logit grows for thousands of steps (to 10^3 and more); loss "
            "flattens, then rises or spikes; attention entropy collapses",
            "q.k is bilinear in W_q and W_k: at a high learning rate both grow and the softmax "
            "saturates",
            "QK-norm; a lower learning rate; beta2 0.95 rather than 0.999",
            "stability/loss-spikes", "trainbook.stability.instability.lr_sweep"),
    Failure("output-logit divergence (slow, late)",
            "mean output logit drifts down steadily, log Z away from 0; late in a long run the "
            "loss creeps up, worse in bf16",
            "the loss is invariant to a common shift of the logits; Adam keeps pushing "
            "unused tokens' logits down; no weight decay to stop it",
            "z-loss (1e-4 log^2 Z); weight decay; fp32 logits and loss",
            "stability/loss-spikes", "trainbook.stability.instability.LogitProbe"),
    Failure("recoverable spike",
            "loss jumps for a few steps (loss z-score far above 6) and returns to its trend; "
            "update norm barely moves",
            "a stretch of unusual batches (junk, a rare domain) meeting the current state",
            "nothing, if it recovers; keep the spike monitor on and log the data position",
            "stability/loss-spikes", "trainbook.stability.spikes.detector_trial"),
    Failure("lingering spike",
            "after the spike the loss settles above the healthy curve and stays there",
            "the bad stretch moved the weights (and Adam's moments) far from where they were",
            "restart from a checkpoint before the spike and skip the batches around it",
            "stability/loss-spikes", "trainbook.stability.spikes.restart_and_skip"),
    Failure("gradient explosion",
            "gradient norm jumps by orders of magnitude on one batch; with SGD the update "
            "follows it, with Adam much less",
            "one batch with a huge loss gradient (a repeated token, a padding bug)",
            "clip the global gradient norm (computed over all shards)",
            "stability/clipping", "trainbook.stability.clipping_runs.bad_batch"),
    Failure("fp16 overflow",
            "inf gradients: the loss scale halves and the step is skipped; a few at the start "
            "are normal",
            "a gradient (or activation) above fp16's 65504 at the current loss scale",
            "dynamic loss scaling (GradScaler); bf16",
            "precision/mixed-precision", "trainbook.precision.loss_scaling.LossScaler"),
    Failure("fp16 underflow",
            "loss stalls or trains slower than bf16 with finite gradients, no skipped steps",
            "gradients below 2^-24 flush to zero in fp16 (small losses, many accumulated "
            "micro-batches)",
            "loss scaling; bf16",
            "precision/mixed-precision", "trainbook.precision.mixed.underflow"),
    Failure("loss-scale collapse",
            "the loss scale halves step after step towards 0; every step skipped; loss flat",
            "an inf or NaN that does not come from the scale (an overflowing activation, a NaN "
            "in the forward pass): no scale makes it finite",
            "find the first non-finite tensor (--monitor nan) and fix it; do not raise the "
            "scale",
            "stability/taxonomy", "trainbook.stability.taxonomy.scale_collapse"),
    Failure("NaN from masking",
            "NaN loss at the first batch where a row is fully masked or a masked probability "
            "is logged",
            "log(softmax * mask) gives log 0 = -inf and 0 * inf = NaN in backward; a mean over "
            "zero counted tokens is 0/0",
            "mask the logits with the dtype's most negative finite value before softmax; never "
            "divide by fewer than one token",
            "stability/debugging", "trainbook.stability.debugging_bugs.make"),
    Failure("gradient-accumulation normalisation bug",
            "nothing on any monitor: the gradient differs from the same batch without "
            "accumulation, more so with variable-length sequences",
            "averaging per-micro-batch mean losses weights tokens unequally",
            "divide every micro-batch's summed loss by the step's token count",
            "pretraining/loss", "trainbook.pretrain.loss.accumulated_grad"),
    Failure("data bug: repeated n-grams",
            "loss jumps while the string is new, then falls faster than on random junk as the "
            "model learns to copy it, with larger gradient norms",
            "repeated strings (boilerplate, a broken shard, padding) that the model learns to "
            "copy, with large gradients",
            "deduplicate and filter the data; skip the shard",
            "stability/loss-spikes", "trainbook.stability.spikes.planted_corpus"),
    Failure("data bug: bad mixing order",
            "loss jumps each time the data source changes; validation on the mixture worse "
            "than on the source just seen",
            "a data mix sampled in blocks by source (unshuffled shards) instead of interleaved",
            "interleave sources by their weights at every step; check the loader's order",
            "pretraining/data-tokenization", "trainbook.pretrain.mixture.blend"),
    Failure("silent data corruption",
            "a spike or NaN that does not recur when the step is replayed from a checkpoint "
            "on the same batches; DP replicas disagree",
            "faulty hardware flips a bit in a weight, an activation or a gradient without an "
            "error",
            "replay from the last checkpoint; find and drain the node (health checks)",
            "stability/taxonomy", "trainbook.stability.taxonomy.BitFlip"),
    Failure("hangs and desynchronisation",
            "throughput drops to 0 with no error; one rank waits in a collective; the NCCL "
            "watchdog times out",
            "a rank took another code path (a data-dependent branch, a failed load), or a "
            "node or link failed",
            "timeouts on every collective, flight recorder and stack dumps",
            "failures/hangs", "trainbook.failures.hangs.plant"),
]

DECISIONS: list[dict[str, str]] = [
    {"symptom": "loss NaN or inf",
     "first check": "which tensor was non-finite first",
     "tool": "--monitor nan; python -m trainbook nan-hunt",
     "fix": "fix that op: masking, a division, fp16 range"},
    {"symptom": "loss spike that recurs on replay from a checkpoint",
     "first check": "the batches of the spike: junk, repeats, a new source",
     "tool": "--monitor spikes; the data position in the checkpoint",
     "fix": "restart and skip (--resume-from, --skip-batches); filter the data"},
    {"symptom": "loss spike or NaN that does not recur on replay",
     "first check": "hardware: which rank, which node",
     "tool": "replay from the checkpoint; compare DP replicas",
     "fix": "drain the node; resume from the checkpoint"},
    {"symptom": "loss rises and does not come back",
     "first check": "learning rate against the stable range; warmup; clipping",
     "tool": "an LR sweep of a small proxy (instability.lr_sweep)",
     "fix": "lower lr, longer warmup, clip; QK-norm"},
    {"symptom": "largest attention logit growing",
     "first check": "per-layer attention logits",
     "tool": "LogitProbe",
     "fix": "QK-norm; lower lr; beta2 0.95"},
    {"symptom": "log Z or mean logit drifting",
     "first check": "weight decay on the head; z-loss on?",
     "tool": "LogitProbe (log_z, logit_mean)",
     "fix": "z-loss 1e-4; weight decay; fp32 loss"},
    {"symptom": "loss scale falling step after step",
     "first check": "a non-finite value in the forward pass",
     "tool": "--monitor nan; debugging.module_stats",
     "fix": "fix the overflowing op; bf16"},
    {"symptom": "loss stalls, gradients finite",
     "first check": "gradients underflowing (fp16), Adam epsilon against gradient RMS",
     "tool": "mixed.underflow; instability.gradient_rms",
     "fix": "loss scaling or bf16; smaller epsilon"},
    {"symptom": "gradient norm jumps on one batch",
     "first check": "that batch",
     "tool": "clipping_runs.LayerGradNorms",
     "fix": "clip the global norm; fix the data"},
    {"symptom": "throughput 0, no error",
     "first check": "which rank is in which collective",
     "tool": "collective timeouts, flight recorder (Part 6)",
     "fix": "fix the divergent code path; replace the node"},
]


def failure_table() -> pd.DataFrame:
    """FAILURES as a table, one row per failure, 'where' as chapter: function (or future)."""
    rows = []
    for f in FAILURES:
        where = f"{f.chapter}: {f.function.rsplit('.', 1)[-1]}" if f.chapter else f.future
        rows.append({"failure": f.name, "signature on the monitors": f.signature,
                     "cause": f.cause, "reproduced in": where, "fix": f.fix})
    return pd.DataFrame(rows).set_index("failure")


def decision_table() -> pd.DataFrame:
    """The decision procedure: symptom -> first check -> tool -> fix."""
    return pd.DataFrame(DECISIONS).set_index("symptom")


def resolve(dotted: str) -> Any:
    """The package object a dotted name names ('trainbook.stability.spikes.restart_and_skip')."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name, None)
            if obj is None:
                raise ValueError(f"{dotted}: {'.'.join(parts[:cut])} has no {name!r}")
        return obj
    raise ValueError(f"{dotted}: no module of the package matches it")


def check_records(records: list[Failure] | None = None, book: Path = BOOK) -> list[str]:
    """What is wrong with the records: a chapter with no notebook or page under `book`, a
    function that does not resolve, a duplicate name. Empty when all is well."""
    problems, seen = [], set()
    for f in FAILURES if records is None else records:
        if f.name in seen:
            problems.append(f"{f.name}: listed twice")
        seen.add(f.name)
        if f.chapter is None:
            continue
        if not any((book / f"{f.chapter}{ext}").is_file() for ext in (".ipynb", ".md")):
            problems.append(f"{f.name}: no chapter book/{f.chapter}.ipynb or .md")
        try:
            resolve(f.function)
        except ValueError as e:
            problems.append(f"{f.name}: {e}")
    return problems


class BitFlip(Hook):
    """Silent data corruption, planted: after the update of step `step`, flip bit `bit` of the
    fp32 representation of one element of parameter `param` (the first element whose bit is 0,
    so the flip makes it larger when `bit` is in the exponent; bit 30, the exponent's top bit,
    multiplies a weight below 2 in magnitude by 2^128). Once only: a replay of the step does
    not see it, as a transient hardware fault would not recur."""

    def __init__(self, param: str, step: int, bit: int = 30):
        if not 0 <= bit <= 31 or step < 1:
            raise ValueError(f"need 0 <= bit <= 31 and step >= 1, got bit {bit}, step {step}")
        self.param, self.step, self.bit = param, step, bit
        self.done: tuple[float, float] | None = None  # (value before, value after)

    def after_update(self, ctx: StepContext) -> None:
        if self.done is not None or ctx.step != self.step:
            return
        params = dict(ctx.model.named_parameters())
        if self.param not in params:
            raise ValueError(f"no parameter {self.param!r}; the model has "
                             f"{', '.join(list(params)[:6])}, ...")
        p = params[self.param]
        with torch.no_grad():
            bits = p.data.view(-1).view(torch.int32)
            free = (((bits >> self.bit) & 1) == 0).nonzero()
            if not len(free):
                raise ValueError(f"every element of {self.param} has bit {self.bit} set")
            i = int(free[0])
            before = p.data.view(-1)[i].item()
            bits[i] ^= 1 << self.bit
            self.done = (before, p.data.view(-1)[i].item())


def scale_collapse(steps: int = 60, overflow_from: int = 30, growth_interval: int = 5,
                   init_scale: float = 2.0**16, seed: int = 0) -> pd.DataFrame:
    """Dynamic loss scaling (the mixed-precision chapter's LossScaler) against an overflow that
    is not the scale's doing: a linear layer whose output is stored in fp16 (formats.quantize,
    overflowing to inf; a straight-through gradient), trained by SGD. From step `overflow_from`
    on, one input is 1e6, so the activation is inf in the forward pass whatever the scale: every
    step is skipped and the scale halves each time. Per step: loss, the scale the step used,
    whether it was skipped."""
    if not 1 < overflow_from <= steps:
        raise ValueError(f"need 1 < overflow_from <= steps, got {overflow_from}, {steps}")
    g = torch.Generator().manual_seed(seed)
    w = torch.nn.Parameter(0.1 * torch.randn(16, 16, generator=g))
    opt = torch.optim.SGD([w], lr=0.01)
    scaler = LossScaler(init_scale, growth_interval=growth_interval)
    rows = []
    for step in range(1, steps + 1):
        x = torch.randn(32, 16, generator=g)
        if step >= overflow_from:
            x[0, 0] = 1e6
        h = x @ w
        h = h + (quantize(h.detach(), "fp16", overflow="inf") - h.detach())  # fp16 storage
        loss = h.pow(2).mean()
        scale = scaler.get_scale()
        scaler.scale(loss).backward()
        stepped = scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        rows.append({"step": step, "loss": loss.item(), "loss_scale": scale,
                     "skipped": not stepped})
    return pd.DataFrame(rows)


def _rows(history: list[dict], keys: tuple[str, ...]) -> pd.DataFrame:
    return pd.DataFrame([{k: r.get(k, math.nan) for k in keys} for r in history])


def signature_runs(steps: int = 120, spike_at: int = 80, **overrides: Any
                   ) -> dict[str, pd.DataFrame]:
    """Small runs of the cheap failures, each a per-step table: step, loss, grad_norm and the
    monitor that shows it (attn_logit_max, update_norm, loss_scale, skipped). 'healthy';
    'divergence' (lr 3, constant, no warmup, no clipping); 'attention logits' (lr 0.3, no
    QK-norm; 'healthy' holds the same at the default lr); 'data spike' (random junk in steps
    spike_at..spike_at+5) and 'repeated string' (one 8-character string repeated, there);
    'SDC' (BitFlip after step spike_at, then restart_and_skip replays from the checkpoint
    before it: column 'attempt' 0 is the corrupted run, 1 the replay);
    'fp16' and 'fp16 + loss scaling' (the fp16 recipe with every gradient scaled by 2^-8, as
    256 accumulated micro-batches would)."""
    if not 20 < spike_at < steps - 10:
        raise ValueError(f"spike_at must leave room on both sides: 20 < {spike_at} < "
                         f"steps - 10 = {steps - 10}")
    cfg = proxy_config(steps=steps, **overrides)
    keys = ("step", "loss", "grad_norm", "attn_logit_max", "update_norm", "spike")
    out = {}
    for name, c in (("healthy", cfg), ("attention logits", replace(cfg, lr=0.3)),
                    ("divergence", replace(cfg, lr=3.0, warmup_steps=0, grad_clip=0.0,
                                           schedule="constant"))):
        out[name] = _rows(monitored_run(c, hooks=[LogitProbe()]).history, keys)
    with tempfile.TemporaryDirectory() as tmp:
        for name, kind in (("data spike", "random"), ("repeated string", "repeat")):
            bad = planted_corpus(Path(tmp) / f"{kind}.txt", spike_at, spike_at + 5, cfg.seq_len,
                                 cfg.batch_size, cfg.seed, kind)
            out[name] = _rows(monitored_run(replace(cfg, corpus=str(bad))).history, keys)
    flip = BitFlip("blocks.0.mlp.down.weight", spike_at)
    rec = restart_and_skip(cfg, ckpt_every=10, rewind=10, skip=0, max_restarts=1, hooks=[flip])
    frames = [_rows(a, keys).assign(attempt=i) for i, a in enumerate(rec.attempts)]
    out["SDC"] = pd.concat(frames, ignore_index=True)
    lowp = replace(cfg, steps=steps)
    for name, scaling in (("fp16", False), ("fp16 + loss scaling", True)):
        r = train_variant(Variant(name, "fp16", 2.0**-8, scaling=scaling, growth_interval=5),
                          lowp, eval_batches=2)
        n = len(r["loss"])
        out[name] = pd.DataFrame({"step": range(1, n + 1), "loss": r["loss"],
                                  "loss_scale": r["scale"], "skipped": r["skipped"]})
    return out

