"""Planted numerical bugs: each a small model with the bug and its fixes, found by the tools.

- `log0`: probabilities masked with 0 and then logged (log(softmax(z) * mask)): -inf in the
  forward pass, 0/0 = NaN in LogBackward. Fixes: mask the logits before log_softmax, with -inf
  (finite gradients, but -inf stays in the output for a later 0 * -inf) or the dtype's most
  negative finite value (finite everywhere).
- `div0`: a mean over a mask that is empty: a loss normalised by the count of its micro-batch's
  counted tokens, when every target of the micro-batch is ignored (0/0). Fix: never divide by
  less than one token (or normalise by the step's tokens, as Part 2's loss chapter does).
- `fp16-softmax`: softmax as exp(s) / sum(exp(s)) in fp16: exp overflows for s > ln(65504) =
  11.09, and inf / inf = NaN. Fixes: subtract the row maximum first, or compute it in fp32.
- `sqrt-neg`: a one-pass variance E[x^2] - E[x]^2 is negative by rounding for a constant row,
  and its square root NaN; eps hides it for small values only. Fix: the two-pass variance.

`make(bug, fix)` returns a model and a micro-batch that triggers the bug; `hunt` runs the
detector (`train.monitor.find_nonfinite`) and anomaly mode on it. `Plant` puts three of them
into the reference model through the trainer's hooks, for `python -m trainbook nan-hunt --plant`.

Chapter: book/stability/debugging.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..train.hooks import Batches, Hook
from ..train.monitor import find_nonfinite
from .debugging import anomaly

IGNORE = -100  # F.cross_entropy's ignore_index
FIXES = {"log0": ("bug", "fill-inf", "fill-min"), "div0": ("bug", "clamp"),
         "fp16-softmax": ("bug", "max-subtract", "fp32"), "sqrt-neg": ("bug", "eps", "two-pass")}
BUGS = tuple(FIXES)
FP16_EXP_LIMIT = math.log(65504.0)  # exp(s) overflows fp16 above this: 11.09


class MaskedLogSoftmax(nn.Module):
    """Log-probabilities restricted to the `allowed` vocabulary entries."""

    def __init__(self, allowed: torch.Tensor, fix: str = "bug"):
        super().__init__()
        self.register_buffer("allowed", allowed)
        self.fix = fix

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        if self.fix == "bug":
            return torch.log(torch.softmax(z, -1) * self.allowed)
        fill = -math.inf if self.fix == "fill-inf" else torch.finfo(z.dtype).min
        return z.masked_fill(~self.allowed.bool(), fill).log_softmax(-1)


class TokenMeanLoss(nn.Module):
    """Cross-entropy per counted token divided by the micro-batch's count of counted tokens."""

    def __init__(self, fix: str = "bug"):
        super().__init__()
        self.fix = fix

    def forward(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        ce = F.cross_entropy(logits.flatten(0, -2), y.flatten(), reduction="none")
        count = (y.flatten() != IGNORE).sum()
        return ce.sum() / (count if self.fix == "bug" else count.clamp(min=1))


class Softmax16(nn.Module):
    """Softmax over the last dimension computed in fp16, returned in fp16."""

    def __init__(self, fix: str = "bug"):
        super().__init__()
        self.fix = fix

    def forward(self, s: torch.Tensor) -> torch.Tensor:
        if self.fix == "fp32":
            return torch.softmax(s.float(), -1).half()
        s = s.half()
        if self.fix == "max-subtract":
            s = s - s.amax(-1, keepdim=True)
        e = s.exp()
        return e / e.sum(-1, keepdim=True)


class OnePassNorm(nn.Module):
    """Normalisation over the last dimension: (x - mean) / sqrt(var + eps)."""

    def __init__(self, fix: str = "bug", eps: float = 1e-5):
        super().__init__()
        self.fix, self.eps = fix, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        if self.fix == "two-pass":
            var = (x - mean).pow(2).mean(-1, keepdim=True)
        else:
            var = x.pow(2).mean(-1, keepdim=True) - mean.pow(2)
        return (x - mean) / torch.sqrt(var + (0.0 if self.fix == "bug" else self.eps))


class BugModel(nn.Module):
    """embed -> [attention with `softmax`] -> [`norm`] -> head -> [`mask`] -> `loss`: each bug
    plugs its module into one slot. forward(x, y) -> (output, loss), like the reference model."""

    def __init__(self, vocab: int = 32, d: int = 16, mask: nn.Module | None = None,
                 loss: nn.Module | None = None, softmax: nn.Module | None = None,
                 norm: nn.Module | None = None):
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, d), nn.Linear(d, vocab)
        if softmax is not None:
            self.q, self.k, self.v = (nn.Linear(d, d, bias=False) for _ in range(3))
            self.softmax = softmax
        self.norm, self.mask, self.loss = norm, mask, loss

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.embed(x)
        if hasattr(self, "softmax"):
            s = self.q(h) @ self.k(h).transpose(-2, -1) / math.sqrt(h.shape[-1])
            h = h + (self.softmax(s).float() @ self.v(h))
        if self.norm is not None:
            h = self.norm(h)
        out = self.head(h)
        if self.mask is not None:
            out = self.mask(out)
            return out, F.nll_loss(out.flatten(0, -2), y.flatten())
        if self.loss is not None:
            return out, self.loss(out, y)
        return out, F.cross_entropy(out.flatten(0, -2), y.flatten())


def make(bug: str, fix: str = "bug", seed: int = 0,
         pad_value: float = 0.1) -> tuple[BugModel, torch.Tensor, torch.Tensor]:
    """A model with `bug` (fixed as `fix` says) and a micro-batch (x, y) that triggers it.
    sqrt-neg: the padding token's embedding row is the constant `pad_value`."""
    if bug not in FIXES:
        raise ValueError(f"unknown bug {bug!r}; choose one of {', '.join(BUGS)}")
    if fix not in FIXES[bug]:
        raise ValueError(f"{bug} has fixes {', '.join(FIXES[bug])}; got {fix!r}")
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    vocab, B, T = 32, 4, 8
    x = torch.randint(1, vocab, (B, T), generator=g)
    if bug == "log0":  # the last 8 entries are not allowed; targets never are
        allowed = torch.arange(vocab) < vocab - 8
        return BugModel(mask=MaskedLogSoftmax(allowed, fix)), x, x % (vocab - 8)
    if bug == "div0":  # the micro-batch has no counted target: all padding
        return BugModel(loss=TokenMeanLoss(fix)), x, torch.full_like(x, IGNORE)
    if bug == "fp16-softmax":  # q = k = 1.8 x: scores |x|^2 3.24 / 4 over 11.09 for many rows
        model = BugModel(softmax=Softmax16(fix))
        with torch.no_grad():
            model.embed.weight.normal_(generator=g)
            for lin in (model.q, model.k):
                lin.weight.copy_(1.8 * torch.eye(16))
        return model, x, x
    model = BugModel(norm=OnePassNorm(fix))  # sqrt-neg: token 0 pads every row's end
    with torch.no_grad():
        model.embed.weight[0] = pad_value
    x[:, T // 2:] = 0
    return model, x, x


def hunt(bug: str, fix: str = "bug", **kw: float) -> dict:
    """Run one planted bug: is the loss finite, are the gradients, what the detector and
    anomaly mode report (None: nothing found)."""
    model, x, y = make(bug, fix, **kw)
    _, loss = model(x, y)
    loss.backward()
    grads = all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    return {"bug": bug, "fix": fix, "loss": loss.item(), "loss_finite": bool(loss.isfinite()),
            "grads_finite": bool(grads), "found": find_nonfinite(model, x, y),
            "anomaly": anomaly(model, x, y)}


# ------------------------------------------------------------------------------------------------
# The same bugs planted in the reference model, through the trainer's hooks (nan-hunt --plant)
# ------------------------------------------------------------------------------------------------

PLANTS = ("log0", "div0", "fp16-softmax")


def restricted_head(plant: Plant) -> Callable:
    """A forward hook for the head: log(softmax(logits) * allowed) once `plant` has set the
    allowed tokens (the step's targets), the log-of-zero bug. A hook, not a wrapper module, so
    the model's parameter names and checkpoints stay the reference's."""

    def hook(_mod, _inp, logits):
        if plant.allowed is None:
            return None
        return torch.log(torch.softmax(logits.float(), -1) * plant.allowed.to(logits.device))

    return hook


def naive_fp16_core(plant: Plant) -> Callable:
    """An attention core whose softmax runs in fp16 without subtracting the maximum, once
    `plant` is active; the model's own core before."""

    def core(self, q, k, v):
        if not plant.active:
            return type(self).core(self, q, k, v)
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scale = self.softmax_scale or q.shape[-1] ** -0.5
        s = (q.half() @ k.half().transpose(-2, -1)) * scale
        T = s.shape[-1]
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=s.device).triu(1), -math.inf)
        return (Softmax16("bug")(s) @ v.half()).to(q.dtype)

    return core


class Plant(Hook):
    """Plant a bug into the reference model from step `step` on: log0 (the head's vocabulary
    restricted to the step's targets through log(softmax * mask)), div0 (at `step`, every
    target of the first micro-batch ignored: PyTorch's mean cross-entropy is then 0/0) or
    fp16-softmax (every attention's softmax in fp16 without the max subtraction)."""

    def __init__(self, kind: str, step: int = 1):
        if kind not in PLANTS:
            raise ValueError(f"unknown plant {kind!r}; choose one of {', '.join(PLANTS)}")
        if step < 1:
            raise ValueError(f"the plant's step must be >= 1, got {step}")
        self.kind, self.step = kind, step
        self.active, self.allowed, self.vocab = False, None, 0

    def on_model(self, model: nn.Module) -> None:
        self.vocab = model.cfg.vocab_size
        if self.kind == "log0":
            model.head.register_forward_hook(restricted_head(self))
        elif self.kind == "fp16-softmax":
            for block in model.layers():
                block.attn.core = types.MethodType(naive_fp16_core(self), block.attn)

    def on_batches(self, step: int, batches: Batches) -> Batches | None:
        self.active = step >= self.step
        if self.kind == "log0":
            seen = torch.zeros(self.vocab)
            for _, y in batches:
                seen[y[y >= 0].flatten().cpu()] = 1.0
            self.allowed = seen if self.active else None
        if self.kind == "div0" and step == self.step:
            x, y = batches[0]
            return [(x, torch.full_like(y, IGNORE)), *batches[1:]]
        return None
