"""The language-modelling loss from scratch: cross-entropy, its gradient, and how to average it.

`cross_entropy` is built from a log-softmax that subtracts the row maximum (logsumexp), so it
never overflows, and it reproduces `F.cross_entropy` with `ignore_index` and `label_smoothing`;
`naive_cross_entropy` is the textbook softmax that overflows in fp32 above logits of about 88.
`cross_entropy_grad` is the closed form of the gradient w.r.t. the logits (softmax minus the
target distribution, over the number of counted tokens), PaLM's z-loss included. Perplexity and
bits per byte convert into each other through the tokenizer's tokens per byte. The last part is
gradient accumulation: averaging per-micro-batch means weights tokens unequally when micro-batches
hold different numbers of target tokens; dividing every micro-batch's summed loss by the step's
token count is exact.

Chapter: book/pretraining/loss.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from ..data import BPETokenizer, ByteTokenizer, Dataset
from ..train.engine import Plain

IGNORE_INDEX = -100  # F.cross_entropy's default, and the reference model's (model.lm_loss)
PALM_Z_LOSS = 1e-4  # PaLM (Chowdhery et al. 2022), Section 5: z_loss = 1e-4 * log^2 Z
REDUCTIONS = ("mean", "sum", "none")


def _check_logits(logits: torch.Tensor, targets: torch.Tensor | None = None) -> None:
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits need a class dimension last, got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    if targets is not None and targets.shape != logits.shape[:-1]:
        raise ValueError(f"targets of shape {tuple(targets.shape)} do not match logits of shape "
                         f"{tuple(logits.shape)}: targets are logits.shape[:-1]")


def logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """log sum_c exp(z_c) over the last dimension, as m + log sum exp(z - m) with m = max z:
    every exponent is <= 0, so nothing overflows, and the largest term is exactly 1."""
    _check_logits(logits)
    m = logits.max(dim=-1, keepdim=True).values
    return (m + (logits - m).exp().sum(dim=-1, keepdim=True).log()).squeeze(-1)


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """log p_c = z_c - logsumexp(z), stable at any logit scale."""
    return logits - logsumexp(logits).unsqueeze(-1)


def naive_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log(exp(z_y) / sum exp(z)) as written in textbooks: inf/inf = nan once a logit passes
    log(float32 max) = 88.7. Shown to be avoided; no ignore_index."""
    _check_logits(logits, targets)
    e = logits.exp()
    p = e.gather(-1, targets.unsqueeze(-1)).squeeze(-1) / e.sum(-1)
    return -p.log().mean()


def _at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.promote_types(t.dtype, torch.float32))  # bf16/fp16 up, fp64 kept


def _valid(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    _check_logits(logits, targets)
    valid = targets != ignore_index
    bad = valid & ((targets < 0) | (targets >= logits.shape[-1]))
    if bad.any():
        raise ValueError(f"targets must be class ids in [0, {logits.shape[-1]}) or ignore_index "
                         f"{ignore_index}, got {targets[bad][0].item()}")
    return valid


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX,
                  label_smoothing: float = 0.0, reduction: str = "mean") -> torch.Tensor:
    """F.cross_entropy from scratch: logits (..., C), targets (...) of class ids.

    Per token: (1 - eps) * (-log p_y) + eps * mean_c(-log p_c), i.e. the cross-entropy against
    the smoothed target q = (1 - eps) one_hot(y) + eps / C. Targets equal to ignore_index count
    for nothing: 'mean' divides by the number of the others (nan when there are none, as
    PyTorch), 'none' gives them 0."""
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    valid = _valid(logits, targets, ignore_index)
    logp = log_softmax(_at_least_fp32(logits))
    nll = -logp.gather(-1, targets.where(valid, 0).unsqueeze(-1)).squeeze(-1)
    per_token = (1 - label_smoothing) * nll + label_smoothing * (-logp.mean(-1))
    per_token = per_token.where(valid, 0.0)
    if reduction == "none":
        return per_token
    if reduction == "sum":
        return per_token.sum()
    return per_token.sum() / valid.sum()


def z_loss(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX,
           coef: float = PALM_Z_LOSS) -> torch.Tensor:
    """PaLM's auxiliary loss coef * log^2 Z, Z = sum_c exp(z_c), averaged over counted tokens.
    Cross-entropy is blind to a constant added to every logit; this term is not: it pulls
    log Z towards 0, so the logits cannot drift as a whole."""
    if coef < 0:
        raise ValueError(f"the z-loss coefficient must be >= 0, got {coef}")
    valid = _valid(logits, targets, ignore_index)
    lse = logsumexp(_at_least_fp32(logits))
    return coef * (lse.pow(2) * valid).sum() / valid.sum()


def cross_entropy_grad(logits: torch.Tensor, targets: torch.Tensor,
                       ignore_index: int = IGNORE_INDEX, label_smoothing: float = 0.0,
                       z_coef: float = 0.0) -> torch.Tensor:
    """d(mean cross-entropy + z-loss)/d(logits) in closed form, no autograd:
    (softmax - q) / n for each counted token, q the (smoothed) target, n the number of counted
    tokens; plus 2 z_coef log Z softmax / n for the z-loss; 0 for ignored tokens."""
    if not 0.0 <= label_smoothing <= 1.0 or z_coef < 0:
        raise ValueError(f"need label_smoothing in [0, 1] and z_coef >= 0, "
                         f"got {label_smoothing}, {z_coef}")
    valid = _valid(logits, targets, ignore_index)
    z = _at_least_fp32(logits)
    p = log_softmax(z).exp()
    C = z.shape[-1]
    q = F.one_hot(targets.where(valid, 0), C).to(z.dtype) * (1 - label_smoothing) \
        + label_smoothing / C
    g = p - q + 2 * z_coef * logsumexp(z).unsqueeze(-1) * p
    return g * valid.unsqueeze(-1) / valid.sum()


def smoothing_floor(label_smoothing: float, vocab_size: int) -> float:
    """The lowest label-smoothed loss reachable (nats/token), even on perfectly predictable text:
    the entropy of q = (1 - eps) one_hot + eps / V, reached at p = q."""
    if not 0.0 <= label_smoothing <= 1.0 or vocab_size < 1:
        raise ValueError(f"need label_smoothing in [0, 1] and vocab_size >= 1, "
                         f"got {label_smoothing}, {vocab_size}")
    eps, V = label_smoothing, vocab_size
    q = torch.full((V,), eps / V, dtype=torch.float64)
    q[0] += 1 - eps
    return float(-torch.special.xlogy(q, q).sum())


# --- perplexity and bits per byte --------------------------------------------------------------

def perplexity(nats_per_token: float) -> float:
    """exp(loss): the effective number of equally likely next tokens. Per token, so it depends on
    what a token is."""
    return math.exp(nats_per_token)


def bits_per_byte(nats_per_token: float, tokens_per_byte: float) -> float:
    """Loss per byte of text in bits: (nats/token) x (tokens/byte) / ln 2. Independent of the
    tokenizer, so models with different vocabularies compare on it."""
    if tokens_per_byte <= 0:
        raise ValueError(f"tokens_per_byte must be positive, got {tokens_per_byte}")
    return nats_per_token * tokens_per_byte / math.log(2)


def nats_per_token(bpb: float, tokens_per_byte: float) -> float:
    """The inverse of bits_per_byte: the per-token loss a tokenizer needs for a given bpb."""
    if tokens_per_byte <= 0:
        raise ValueError(f"tokens_per_byte must be positive, got {tokens_per_byte}")
    return bpb * math.log(2) / tokens_per_byte


@torch.no_grad()
def heldout(model: nn.Module, dataset: Dataset, batch_size: int = 32) -> dict[str, float]:
    """Loss over every validation block (not a sample), and the bytes its targets cover: packed
    blocks overlap by one token, so their targets are one contiguous stretch of the token stream,
    decoded here to count its bytes exactly."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    tok: ByteTokenizer | BPETokenizer = dataset.tokenizer
    blocks = dataset.val
    was_training = model.training
    model.eval()
    total, n = 0.0, 0
    device = next(model.parameters()).device
    for i in range(0, len(blocks), batch_size):
        b = blocks[i:i + batch_size].to(device)
        logits, _ = model(b[:, :-1])
        total += F.cross_entropy(logits.float().flatten(0, 1), b[:, 1:].flatten(),
                                 reduction="sum").item()
        n += b[:, 1:].numel()
    model.train(was_training)
    n_bytes = len(tok.decode(blocks[:, 1:].flatten().tolist()).encode("utf-8"))
    loss = total / n
    return {"tokens": n, "bytes": n_bytes, "tokens_per_byte": n / n_bytes,
            "nats_per_token": loss, "perplexity": perplexity(loss),
            "bits_per_byte": bits_per_byte(loss, n / n_bytes)}


# --- gradient accumulation with variable-length sequences ---------------------------------------

def padded_batch(lengths: Sequence[int], seq_len: int, vocab_size: int,
                 generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (inputs, targets) of shape (len(lengths), seq_len); row i has lengths[i] target
    tokens and IGNORE_INDEX after them (right padding, as an SFT or unpacked batch)."""
    if not lengths or any(not 1 <= n <= seq_len for n in lengths):
        raise ValueError(f"need at least one length, each in [1, seq_len={seq_len}], "
                         f"got {list(lengths)}")
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    x = torch.randint(0, vocab_size, (len(lengths), seq_len), generator=generator)
    y = torch.randint(0, vocab_size, (len(lengths), seq_len), generator=generator)
    y[torch.arange(seq_len) >= torch.tensor(lengths)[:, None]] = IGNORE_INDEX
    return x, y


def _flat_grad(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def batch_grad(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The reference: the gradient of the per-token mean loss over the whole batch at once."""
    model.zero_grad(set_to_none=True)
    logits, _ = model(x)
    cross_entropy(logits, y).backward()
    return _flat_grad(model)


NORMALISATIONS = ("mean-of-means", "tokens")


def accumulated_grad(model: nn.Module, micro: Sequence[tuple[torch.Tensor, torch.Tensor]],
                     normalise: str) -> torch.Tensor:
    """The gradient accumulated over micro-batches. 'mean-of-means': each micro-batch's mean loss
    / number of micro-batches (what trainers do by default); 'tokens': each micro-batch's summed
    loss / the target tokens of the whole step, counted before the first backward."""
    if normalise not in NORMALISATIONS:
        raise ValueError(f"normalise must be one of {NORMALISATIONS}, got {normalise!r}")
    if not micro:
        raise ValueError("need at least one micro-batch")
    model.zero_grad(set_to_none=True)
    step_tokens = sum(int((y != IGNORE_INDEX).sum()) for _, y in micro)
    for x, y in micro:
        logits, _ = model(x)
        if normalise == "tokens":
            loss = cross_entropy(logits, y, reduction="sum") / step_tokens
        else:
            loss = cross_entropy(logits, y) / len(micro)
        loss.backward()
    return _flat_grad(model)


def trainer_grad(model: nn.Module, micro: Sequence[tuple[torch.Tensor, torch.Tensor]]
                 ) -> torch.Tensor:
    """The gradient the reference trainer accumulates: `train.engine.Plain.step` on these
    micro-batches (one process, fp32)."""
    if not micro:
        raise ValueError("need at least one micro-batch")
    model.zero_grad(set_to_none=True)
    engine = Plain(model, model, False, nullcontext, torch.amp.GradScaler("cpu", enabled=False))
    engine.step(list(micro))
    return _flat_grad(model)


def relative_error(g: torch.Tensor, reference: torch.Tensor) -> float:
    """||g - reference|| / ||reference||."""
    if g.shape != reference.shape:
        raise ValueError(f"shapes differ: {tuple(g.shape)} vs {tuple(reference.shape)}")
    return float((g - reference).norm() / reference.norm())
