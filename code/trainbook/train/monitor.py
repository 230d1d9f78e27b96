"""The trainer's monitors (`--monitor spikes,nan`): hooks that watch the training stream.

`SpikeMonitor` scores each step's loss and relative update norm against the trailing window of
healthy steps (a z-score: how many standard deviations above the recent mean) and flags a step
where either passes its threshold; the history row gets `loss_z`, `update_z` and `spike`.
`NanMonitor` stops the run at the first step whose loss or gradients are not finite, after
finding where the first inf or NaN came from: `find_nonfinite` runs the step's micro-batches
again with hooks on every module and reports the first tensor, in execution order, that holds
one (a module's weight, input or output; in backward, the gradient arriving at a module or the
one it passes on), with its module, shape and count of bad elements.

`GradNorms` (`--monitor grad-norms`) adds each block's gradient norm before clipping to the
history row as `gnorm.<block>`, so a growing norm can be traced to the block it grows in.

`Fingerprint` (`--monitor fingerprint`) adds a cheap digest of the parameters after every
step to the history row: their float64 sum and sum of squares and a hash of a strided sample,
so two runs can be compared step by step and the first step where they differ found.

Chapter: book/stability/loss-spikes (spikes); book/stability/debugging (NaN);
book/stability/clipping (grad-norms); book/failures/exact-resume (fingerprint).
"""

from __future__ import annotations

import hashlib
import math
import warnings
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from .hooks import Hook, StepContext, StopTraining

MONITORS = ("spikes", "nan", "grad-norms", "fingerprint")


class SpikeMonitor(Hook):
    """Flag steps whose loss or relative update norm ||dtheta|| / ||theta|| is more than
    `threshold` standard deviations above the mean of the last `window` unflagged steps.

    Nothing is scored during the first `warmup` steps or before the window holds `min_history`
    steps (the early loss falls too fast to have a stationary mean). Flagged steps do not enter
    the window, so a spike does not hide the one after it."""

    def __init__(self, window: int = 50, threshold: float = 6.0, warmup: int = 20,
                 min_history: int = 10, stop: bool = False):
        if window < 2 or min_history < 2 or min_history > window:
            raise ValueError(f"need 2 <= min_history <= window, got {min_history}, {window}")
        if not threshold > 0 or warmup < 0:
            raise ValueError(f"need threshold > 0 and warmup >= 0, got {threshold}, {warmup}")
        self.window, self.threshold, self.warmup = window, threshold, warmup
        self.min_history, self.stop = min_history, stop
        self.loss: deque = deque(maxlen=window)
        self.update: deque = deque(maxlen=window)
        self.spikes: list[int] = []
        self._before: list[torch.Tensor] = []

    @staticmethod
    def zscore(history: deque, value: float) -> float:
        """(value - mean) / std of the history; inf for a non-finite value."""
        if not math.isfinite(value):
            return math.inf
        n = len(history)
        mean = sum(history) / n
        var = sum((h - mean) ** 2 for h in history) / (n - 1)
        return (value - mean) / max(math.sqrt(var), 1e-12 * max(abs(mean), 1e-12))

    def score(self, step: int, loss: float, update: float) -> tuple[float, float, bool]:
        """Score one step (its loss and relative update norm) against the window; returns the
        loss z-score, the update z-score and whether the step is a spike. An unflagged step
        with a finite loss joins the window. The trainer calls this every step; `replay` feeds
        it a recorded run."""
        scored = step > self.warmup and len(self.loss) >= self.min_history
        lz = self.zscore(self.loss, loss) if scored else 0.0
        uz = self.zscore(self.update, update) if scored else 0.0
        spike = scored and (lz > self.threshold or uz > self.threshold)
        if spike:
            self.spikes.append(step)
        elif math.isfinite(loss):
            self.loss.append(loss)
            self.update.append(update)
        return lz, uz, spike

    def prime(self, history: list[dict]) -> None:
        """Score the rows of a resumed run's history (those with an `update_norm`), so that a
        monitor started on resume holds the window it would have held without the restart."""
        for rec in history:
            if "update_norm" in rec:
                self.score(rec["step"], rec["loss"], rec["update_norm"])

    def before_update(self, ctx: StepContext) -> None:
        self._before = [p.detach().clone() for p in ctx.model.parameters()]

    def after_update(self, ctx: StepContext) -> None:
        with torch.no_grad():
            moved = sum(float((p.detach() - b).float().pow(2).sum())
                        for p, b in zip(ctx.model.parameters(), self._before))
            size = sum(float(b.float().pow(2).sum()) for b in self._before)
        self._before = []
        update = math.sqrt(moved / max(size, 1e-30))
        rec = ctx.record
        rec["update_norm"] = update
        rec["loss_z"], rec["update_z"], rec["spike"] = self.score(ctx.step, ctx.loss, update)
        if rec["spike"] and self.stop:
            raise StopTraining(f"spike at step {ctx.step}: loss z {rec['loss_z']:.1f}, "
                               f"update z {rec['update_z']:.1f} (threshold {self.threshold:g})")


def replay(history: list[dict], **monitor: float) -> list[int]:
    """The steps a SpikeMonitor with these settings (window, threshold, warmup, min_history)
    would flag on a recorded run: rows with step, loss and update_norm (what the monitor
    records). The same scoring as in training, so thresholds can be compared on one run."""
    if not history or not all({"step", "loss", "update_norm"} <= set(r) for r in history):
        raise ValueError("replay needs history rows with step, loss and update_norm: train "
                         "with --monitor spikes (or a SpikeMonitor hook)")
    mon = SpikeMonitor(**monitor)
    for rec in history:
        mon.score(rec["step"], rec["loss"], rec["update_norm"])
    return mon.spikes


@dataclass
class NonFinite:
    """Where the first inf or NaN appeared. `module`: its qualified name ('' for the model) and
    `cls` its class; `phase`: 'forward' or 'backward'; `where`: which tensor of the module held
    it first: 'weight' (a parameter, already bad before this step), 'input' (it arrived from
    code outside any module: the parent's own forward), 'output' (the module made it),
    'grad_output' (backward: it arrived from outside any module), 'grad_input' (the module's
    backward made it), 'grad of <name>' (a parameter's gradient) or 'norm' (every gradient
    finite, their norm not; `cls` then holds the largest |g|); `index` of that tensor in its
    tuple; the tensor's `shape`, how many of
    its `numel` elements are NaN (`nan`) and inf (`inf`); `order` of the hook call; the
    step's `micro_batch`."""

    module: str
    phase: str
    kind: str
    order: int
    micro_batch: int = 0
    where: str = "output"
    cls: str = ""
    index: int = 0
    shape: tuple[int, ...] = ()
    nan: int = 0
    inf: int = 0
    numel: int = 0

    @property
    def parent(self) -> str:
        """The module whose own forward code holds the culprit when it came from outside any
        module ('input', 'grad_output'): the enclosing module."""
        return self.module.rsplit(".", 1)[0] if "." in self.module else ""

    def __str__(self) -> str:
        if self.where == "norm":
            return (f"every gradient is finite, but their norm is not: the sum of squares passes "
                    f"float32's 3.4e38 (largest |g| {self.cls}); a clip coefficient of "
                    "max_norm / inf, or inf / inf without clipping, makes them 0 or NaN")
        name = f"{self.module or 'the model'} ({self.cls})" if self.cls else \
            (self.module or "the model")
        what = {"weight": "a parameter of", "input": "the input of", "output": "the output of",
                "grad_output": "the gradient arriving at the output of",
                "grad_input": "the gradient w.r.t. the input of"}.get(
                    self.where, f"the {self.where} of")  # 'grad of weight': a parameter's
        if self.index:
            what = what.replace("the ", f"element {self.index} of the ", 1)
        if not self.module and self.where == "output" and self.index == 1:
            what = "the loss returned by"  # model(x, y) -> (output, loss)
        text = f"first {self.kind} in the {self.phase} pass: {what} {name}"
        if self.numel:
            text += (f", shape {tuple(self.shape)}, {self.nan:,} NaN and {self.inf:,} inf of "
                     f"{self.numel:,} elements")
        if self.where in ("input", "grad_output"):
            text += (f"; it was made outside any submodule, by the forward code of "
                     f"{self.parent or 'the model'} itself")
        if self.where == "weight":
            text += "; the weights were already bad (a previous update or the checkpoint)"
        return text


def _tensors(t: object) -> list[torch.Tensor]:
    """The floating-point tensors of a tensor or a (nested) tuple or list, in order; None and
    integer tensors (token ids) are placeholders (None), so indices stay those of the tuple."""
    if isinstance(t, (tuple, list)):
        return [x for item in t for x in _tensors(item)]
    return [t if isinstance(t, torch.Tensor) and t.is_floating_point() else None]


def _kind(t: object) -> str | None:
    """'nan', 'inf' or None for a tensor (or a tuple of them)."""
    ts = [x for x in _tensors(t) if x is not None]
    if any(torch.isnan(x).any() for x in ts):
        return "nan"
    if any(torch.isinf(x).any() for x in ts):
        return "inf"
    return None


def _first_bad(t: object) -> tuple[int, torch.Tensor] | None:
    """(index, tensor) of the first non-finite tensor in t."""
    for i, x in enumerate(_tensors(t)):
        if x is not None and not torch.isfinite(x).all():
            return i, x
    return None


def _check_parameter_grads(model: nn.Module, found: list, order: int) -> None:
    """After a backward whose flows between modules were finite: a parameter's gradient (x^T g
    can overflow from finite x and g), else the norm of all of them (a sum of squares past
    float32's 3.4e38 from finite gradients, which clip_grad_norm_ turns into NaN)."""
    if found:
        return
    for name, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            if p.grad is not None and not torch.isfinite(p.grad).all():
                nan = int(torch.isnan(p.grad).sum())
                found.append(NonFinite(name, "backward", "nan" if nan else "inf", order,
                                       where=f"grad of {pname}", cls=type(mod).__name__,
                                       shape=tuple(p.grad.shape), nan=nan,
                                       inf=int(torch.isinf(p.grad).sum()), numel=p.grad.numel()))
                return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
    if not torch.isfinite(norm):
        top = max(float(g.abs().max()) for g in grads)
        found.append(NonFinite("", "backward", "inf", order, where="norm", cls=f"{top:.3g}"))


def find_nonfinite(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                   autocast: Callable[[], AbstractContextManager] | None = None,
                   backward: bool = True) -> NonFinite | None:
    """Run forward (and backward) of one micro-batch with a hook on every module; the first
    tensor, in the order they were computed, that is not finite: a module's weight, input or
    output, then in backward the gradient arriving at a module's output or the one it passes
    to its input. Leaves gradients as they were. None if everything is finite."""
    found: list[NonFinite] = []
    order = [0]

    def report(name, mod, phase, where, tensors):
        order[0] += 1
        hit = _first_bad(tensors)
        if hit is None or found:
            return
        i, t = hit
        nan = int(torch.isnan(t).sum())
        found.append(NonFinite(name, phase, "nan" if nan else "inf", order[0], where=where,
                               cls=type(mod).__name__, index=i, shape=tuple(t.shape), nan=nan,
                               inf=int(torch.isinf(t).sum()), numel=t.numel()))

    def pre_hook(name):
        def hook(mod, inp):
            report(name, mod, "forward", "weight",
                   [p.detach() for p in mod.parameters(recurse=False)])
            report(name, mod, "forward", "input", inp)
        return hook

    def forward_hook(name):
        def hook(mod, _inp, out):
            report(name, mod, "forward", "output", out)
        return hook

    def backward_hook(name):
        def hook(mod, grad_in, grad_out):
            report(name, mod, "backward", "grad_output", grad_out)
            report(name, mod, "backward", "grad_input", grad_in)
        return hook

    handles = []
    for name, mod in model.named_modules():
        handles.append(mod.register_forward_pre_hook(pre_hook(name)))
        handles.append(mod.register_forward_hook(forward_hook(name)))
        if backward:
            handles.append(mod.register_full_backward_hook(backward_hook(name)))
    saved = [p.grad for p in model.parameters()]
    try:
        with warnings.catch_warnings():
            # modules fed token ids (embeddings) have no input gradient: expected here
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            with autocast() if autocast else nullcontext():
                _, loss = model(x, y)
            if not found and backward and loss.requires_grad:
                for p in model.parameters():
                    p.grad = None
                loss.backward()
                _check_parameter_grads(model, found, order[0])
    finally:
        for h in handles:
            h.remove()
        for p, g in zip(model.parameters(), saved):
            p.grad = g
    return found[0] if found else None


class NanMonitor(Hook):
    """Stop at the first step whose loss or gradient norm is not finite, naming the module that
    made the first inf or NaN. Under fp16 loss scaling, inf gradients with a finite loss are the
    scaler's business (it skips the step and lowers the scale), not a failure. Costs nothing on a
    healthy step: it reads the loss and gradient norm the trainer has already computed, and only
    a bad step is run again, with hooks."""

    def __init__(self, fp16_scaling: bool = False):
        self.fp16_scaling = fp16_scaling
        self.found: NonFinite | None = None
        self.step: int | None = None  # the bad step, its micro-batch and autocast, to re-run
        self.batch: tuple[torch.Tensor, torch.Tensor] | None = None
        self.autocast: Callable[[], AbstractContextManager] | None = None

    def before_update(self, ctx: StepContext) -> None:
        bad_loss = not math.isfinite(ctx.loss)
        bad_grad = not math.isfinite(ctx.grad_norm) and not self.fp16_scaling
        if not (bad_loss or bad_grad):
            return
        self.step, self.autocast = ctx.step, ctx.autocast
        for i, (x, y) in enumerate(ctx.batches):
            hit = find_nonfinite(ctx.model, x, y, ctx.autocast)
            if hit is not None:
                hit.micro_batch = i
                self.found, self.batch = hit, (x, y)
                break
        what = "loss" if bad_loss else "gradient norm"
        where = f": {self.found}" if self.found else \
            " (not reproduced when the micro-batches ran again: look for non-determinism)"
        raise StopTraining(f"non-finite {what} at step {ctx.step}{where}")


def block_of(name: str) -> str:
    """The block a parameter belongs to: 'blocks.3.attn.q.weight' -> 'blocks.3',
    'embed.weight' -> 'embed', 'head.weight' -> 'head'."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "blocks" else parts[0]


class GradNorms(Hook):
    """Each step's gradient norm per block (the embedding, every transformer block, the final
    norm, the head), before clipping, into the history as `gnorm.<block>`. The trainer has
    clipped when hooks run, but clipping scales every gradient by one factor: each block's share
    of the total is unchanged, and the step's `grad_norm` is the total before clipping."""

    def __init__(self) -> None:
        self.blocks: dict[str, list[nn.Parameter]] = {}
        self._norms: dict[str, float] = {}

    def on_model(self, model: nn.Module) -> None:
        self.blocks = {}
        for name, p in model.named_parameters():  # a tied weight appears once
            self.blocks.setdefault(block_of(name), []).append(p)

    @torch.no_grad()
    def before_update(self, ctx: StepContext) -> None:
        sq = {block: sum(float(p.grad.float().pow(2).sum()) for p in params
                         if p.grad is not None) for block, params in self.blocks.items()}
        applied = math.sqrt(sum(sq.values()))  # the total norm after clipping
        unclip = ctx.grad_norm / applied if applied > 0 else 0.0
        self._norms = {block: math.sqrt(v) * unclip for block, v in sq.items()}

    def after_update(self, ctx: StepContext) -> None:
        ctx.record.update({f"gnorm.{b}": v for b, v in self._norms.items()})


class Fingerprint(Hook):
    """After every step, a digest of the parameters in the history row: `fp_sum` and
    `fp_sumsq` (float64 sum and sum of squares over every element) and `fp_hash` (16 hex digits
    of a blake2b over every `stride`-th element of each tensor, at most `sample` per tensor, as
    raw bytes). Equal runs give equal digests; a difference in one bit of a sampled element, or
    in any element at the sums' precision, changes them. On a GPU the sums are two reductions
    over the weights (cheaper than an optimizer step) and the hash reads a few kB."""

    def __init__(self, sample: int = 1024):
        if sample < 1:
            raise ValueError(f"sample must be >= 1, got {sample}")
        self.sample = sample

    @torch.no_grad()
    def digest(self, model: nn.Module) -> dict:
        """The fingerprint of a model's parameters now."""
        total = squares = 0.0
        h = hashlib.blake2b(digest_size=8)
        for p in model.parameters():
            flat = p.detach().reshape(-1)
            wide = flat.double()
            total += float(wide.sum())
            squares += float(wide.square().sum())
            picked = flat[::max(1, flat.numel() // self.sample)][:self.sample]
            h.update(picked.cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return {"fp_sum": total, "fp_sumsq": squares, "fp_hash": h.hexdigest()}

    def after_update(self, ctx: StepContext) -> None:
        ctx.record.update(self.digest(ctx.model))


def make_monitors(names: str, fp16_scaling: bool = False) -> list[Hook]:
    """The monitors a comma-separated `--monitor` value names ('' for none)."""
    chosen = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in MONITORS]
    if unknown:
        raise ValueError(f"unknown monitor {unknown[0]!r}; choose from {', '.join(MONITORS)} "
                         "(comma-separated)")
    make = {"spikes": SpikeMonitor, "nan": lambda: NanMonitor(fp16_scaling),
            "grad-norms": GradNorms, "fingerprint": Fingerprint}
    return [make[n]() for n in chosen]
