"""Masked and denoising objectives: BERT's masked LM, T5's span corruption, prefix LM, UL2.

The batch transforms the trainer runs live in `trainbook.train.objective` (the runtime cannot
import this part); this module re-exports them and adds what only the chapter needs: T5's
length arithmetic (`span_corruption_lengths`), UL2's mixture of denoisers with its mode tokens,
scoring a trained model on common ground (bits per byte of a continuation and of an infilled
gap, whatever it was trained for), and the comparison run.

Chapter: book/pretraining/objectives.
"""

from __future__ import annotations

import contextlib
import io
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
import torch.nn.functional as F

from .. import configs
from ..compute.flops import training_flops_per_token
from ..data import build_dataset
from ..launch import threads
from ..train import TrainConfig, train
from ..train.objective import (
    ATTENTION,
    IGNORE,
    attention_mask,
    bert_mask,
    decoder_span_length,
    noise_counts,
    objective_batches,
    prefix_lengths,
    random_spans_noise_mask,
    span_corrupt,
    special_tokens,
)

__all__ = ["ATTENTION", "UL2_DENOISERS", "Denoiser", "attention_mask", "attention_pattern",
           "bert_mask", "compare_objectives", "decoder_span_length", "loss_tokens",
           "noise_counts", "objective_batches", "prefix_lengths", "random_spans_noise_mask",
           "render", "score_bits", "span_corrupt", "span_corruption_lengths", "special_tokens",
           "ul2_example", "ul2_ids"]


def span_corruption_lengths(inputs_length: int, noise_density: float = 0.15,
                            mean_span_length: float = 3.0) -> tuple[int, int]:
    """(raw tokens needed, targets length) so span corruption fills `inputs_length` exactly, as
    T5's random_spans_helper computes them (one sentinel per span in inputs and targets, one
    EOS on each): the longest raw length whose inputs fit, and the noise_density 0.5 hack."""
    if inputs_length < 2 or not 0 < noise_density < 1 or mean_span_length <= 0:
        raise ValueError(f"need inputs_length >= 2, 0 < noise_density < 1 and "
                         f"mean_span_length > 0, got {inputs_length}, {noise_density}, "
                         f"{mean_span_length}")

    def lengths(tokens_length):  # T5's _tokens_length_to_inputs_length_targets_length
        noise = int(round(tokens_length * noise_density))
        spans = int(round(noise / mean_span_length))
        return tokens_length - noise + spans + 1, noise + spans + 1

    tokens_length = inputs_length - 1
    while lengths(tokens_length + 1)[0] <= inputs_length:
        tokens_length += 1
    inputs, targets = lengths(tokens_length)
    if noise_density == 0.5 and targets > inputs:  # T5: targets as long as the inputs
        tokens_length, targets = tokens_length - 1, targets - 1
    return tokens_length, targets


def attention_pattern(kind: str, seq_len: int, prefix: int = 0) -> torch.Tensor:
    """The (seq_len, seq_len) bool pattern the trainer uses for one row: causal, bidirectional,
    or a bidirectional prefix of `prefix` positions (built by the trainer's own function)."""
    if kind not in ("causal", "bidirectional", "prefix") or not 0 <= prefix <= seq_len:
        raise ValueError(f"kind must be causal, bidirectional or prefix and 0 <= prefix <= "
                         f"seq_len, got {kind!r}, {prefix}")
    if kind == "causal" or kind == "prefix" and prefix <= 1:
        return torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    targets = torch.zeros(1, seq_len, dtype=torch.long)  # a row's targets say its pattern
    targets[0, :prefix - 1 if kind == "prefix" else 1] = IGNORE
    return attention_mask(targets, kind)[0, 0]


@dataclass(frozen=True)
class Denoiser:
    """One UL2 denoiser: mode token, mean span length mu, corruption rate r; "S" is a prefix LM
    whose target is the last part (T5's random_prefix_noise_mask with density r)."""

    mode: str
    mean_span: float
    rate: float


# Tay et al. 2022 (UL2), the seven denoisers of the final mixture: R (mu=3, r=0.15), (8, 0.15);
# S (mu=L/4, r=0.25, one span); X (3, 0.5), (8, 0.5), (64, 0.15), (64, 0.5)
UL2_DENOISERS = (Denoiser("R", 3, 0.15), Denoiser("R", 8, 0.15), Denoiser("S", 0, 0.25),
                 Denoiser("X", 3, 0.5), Denoiser("X", 8, 0.5), Denoiser("X", 64, 0.15),
                 Denoiser("X", 64, 0.5))
MODES = ("R", "S", "X")


def ul2_ids(vocab_size: int) -> dict[str, int]:
    """Mode token ids [R], [S], [X] at the top of the vocabulary; sentinels count down below
    them (sentinel i is vocab_size - 4 - i)."""
    if vocab_size < 5:
        raise ValueError(f"vocab_size {vocab_size} leaves no room for 3 modes and sentinels")
    return {f"[{m}]": vocab_size - 1 - i for i, m in enumerate(MODES)}


def ul2_example(tokens: torch.Tensor, denoiser: Denoiser, vocab_size: int,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One UL2 (inputs, targets) from a 1-d token sequence: the mode token, then T5 span
    corruption with the denoiser's (mu, r) for R and X, or for S the prefix as inputs and the
    rest as targets (T5's prefix_lm split, uniform over its range)."""
    if denoiser.mode not in MODES or tokens.dim() != 1:
        raise ValueError(f"need a 1-d token sequence and a mode in {MODES}, got shape "
                         f"{tuple(tokens.shape)} and mode {denoiser.mode!r}")
    mode = torch.tensor([ul2_ids(vocab_size)[f"[{denoiser.mode}]"]])
    if denoiser.mode == "S":
        split = int(prefix_lengths(1, len(tokens), denoiser.rate, generator, mirrored=False)[0])
        return torch.cat([mode, tokens[:split]]), tokens[split:]
    mask = random_spans_noise_mask(len(tokens), denoiser.rate, denoiser.mean_span, generator)
    inputs, targets = span_corrupt(tokens, mask, vocab_size - len(MODES))
    return torch.cat([mode, inputs]), targets


def render(ids: Sequence[int] | torch.Tensor, tokenizer: Any, names: dict[int, str]) -> str:
    """Token ids as text, special ids by name (a sentinel shown as <i>)."""
    out, run = [], []
    for i in (ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)):
        if i < tokenizer.vocab_size:
            run.append(i)
            continue
        out += [tokenizer.decode(run), names.get(i, f"<{i}>")]
        run = []
    return "".join(out + [tokenizer.decode(run)])


def _scoring_rows(objective: str, blocks: torch.Tensor, vocab_size: int, left: int, gap: int,
                  right: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(inputs, targets, scored) that score tokens [left, left + gap) of each block, seeing
    `left` tokens before and (where the objective can) `right` tokens after."""
    N = blocks.shape[0]
    if objective in ("clm", "prefix"):
        z = blocks[:, :left + gap]  # left context only: a causal or prefix model reads on
        x, y = z[:, :-1], z[:, 1:].clone()
        y[:, :left - 1] = IGNORE
        return x, y, y != IGNORE
    if objective == "mlm":  # chain rule: predict gap token j with j.. masked, right visible
        base = blocks[:, :left + gap + right]
        x = base.repeat_interleave(gap, 0).clone()
        y = torch.full_like(x, IGNORE)
        for j in range(gap):
            rows = torch.arange(N) * gap + j
            x[rows, left + j:left + gap] = vocab_size - 1  # [MASK]
            y[rows, left + j] = base[:, left + j]
        return x, y, y != IGNORE
    s0 = torch.full((N, 1), vocab_size - 1)  # span: inputs [left, s0, right], targets [s0, gap]
    z = torch.cat([blocks[:, :left], s0, blocks[:, left + gap:left + gap + right], s0,
                   blocks[:, left:left + gap]], 1)
    x, y = z[:, :-1], z[:, 1:].clone()
    y[:, :left + right] = IGNORE
    scored = y != IGNORE
    scored[:, left + right] = False  # the target's s0 sets the prefix; it is no text
    return x, y, scored


@torch.no_grad()
def score_bits(model: torch.nn.Module, objective: str, blocks: torch.Tensor, left: int,
               gap: int, right: int = 0, token_bytes: torch.Tensor | None = None,
               batch: int = 64) -> float:
    """Bits per byte of tokens [left, left + gap) of each block given `left` tokens before and
    `right` after, each objective in its own format: clm and prefix read the left context only,
    mlm fills [MASK]s one at a time (the chain rule), span predicts the sentinel's span.
    `token_bytes` gives each id's length in bytes (default 1: a byte tokenizer)."""
    if objective not in ATTENTION:
        raise ValueError(f"objective must be one of {', '.join(ATTENTION)}, got {objective!r}")
    width = {"clm": left + gap - 1, "prefix": left + gap - 1, "mlm": left + gap + right,
             "span": left + gap + right + 1}[objective]  # the rows' length
    if left < 1 or gap < 1 or right < 0 or left + gap + right > blocks.shape[1] or \
            width > model.cfg.max_seq_len:
        raise ValueError(f"left {left} + gap {gap} + right {right} must fit blocks of "
                         f"{blocks.shape[1]} tokens, and the rows ({width} tokens) the model's "
                         f"context of {model.cfg.max_seq_len}")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    x, y, scored = _scoring_rows(objective, blocks.cpu(), model.cfg.vocab_size, left, gap, right)
    nats, nbytes = 0.0, 0.0
    for i in range(0, len(x), batch):
        xb, yb, sb = (t[i:i + batch].to(device) for t in (x, y, scored))
        logits, _ = model(xb, yb)  # the targets set the attention pattern
        nll = F.cross_entropy(logits.float().transpose(1, 2), yb, reduction="none")
        nats += float(nll[sb].sum())
        nbytes += float(sb.sum()) if token_bytes is None else \
            float(token_bytes.to(device)[yb[sb]].sum())
    model.train(was_training)
    return nats / math.log(2) / nbytes


def loss_tokens(objective: str, blocks: torch.Tensor, vocab_size: int) -> float:
    """Loss-bearing tokens per sequence, counted on real batches built by the trainer's
    transform (packed blocks of seq_len + 1 tokens)."""
    x, y = blocks[:, :-1], blocks[:, 1:]
    (_, yo), = objective_batches(objective, [(x, y)], vocab_size)
    return float((yo != IGNORE).sum()) / len(blocks)


def compare_objectives(objectives: Sequence[str] = ("clm", "mlm", "span", "prefix"),
                       eval_blocks: int = 32, infill: int = 3, **train_kwargs: Any
                       ) -> tuple[pd.DataFrame, dict[str, list[float]]]:
    """Train the same model on the same data for the same steps with each objective, then put
    them on common ground: bits per byte of a continuation (second half of a block from the
    first) and of `infill`-token gaps at five places in each block, with the context on both
    sides and with the left side only; and the cost per token (loss-bearing tokens per
    sequence, training FLOPs per loss-bearing token). The first `eval_blocks` validation
    blocks are scored."""
    bad = [o for o in objectives if o not in ATTENTION]
    if bad or not objectives or eval_blocks < 1 or infill < 1:
        raise ValueError(f"objectives must be some of {', '.join(ATTENTION)}, eval_blocks and "
                         f"infill >= 1, got {list(objectives)}, {eval_blocks}, {infill}")
    base = {"model": "tiny-llama", "tokenizer": "bytes", "progress": False, "log_every": 0}
    base.update(train_kwargs)
    rows, histories = [], {}
    with threads(1):  # tiny models are overhead-bound: spare the threads
        for objective in objectives:
            cfg = TrainConfig(**{**base, "objective": objective})
            t0 = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()):
                res = train(cfg)
            seconds = time.perf_counter() - t0
            T, V = cfg.seq_len, res.model_config.vocab_size
            offsets = [(T - infill) * k // 6 for k in range(1, 6)]  # gaps' starts: 1/6 .. 5/6
            val = build_dataset(res.tokenizer, T, cfg.corpus).val[:eval_blocks]
            token_bytes = None if cfg.tokenizer == "bytes" else torch.tensor(
                [len(res.tokenizer.decode([i]).encode()) for i in range(res.tokenizer.vocab_size)]
                + [1] * (V - res.tokenizer.vocab_size), dtype=torch.float)
            left, gap = T // 2, T - 1 - T // 2
            cont = score_bits(res.model, objective, val, left, gap, 0, token_bytes)
            spots = {"both": [(lo, T - 1 - infill - lo) for lo in offsets],
                     "left": [(lo, 0) for lo in offsets]}  # right context: all, or none
            fill = {k: sum(score_bits(res.model, objective, val, lo, infill, r, token_bytes)
                           for lo, r in v) / len(v) for k, v in spots.items()}
            n_loss = loss_tokens(objective, val, V)
            rows.append({"objective": objective, "vocab": V,
                         "params": configs.param_counts(res.model_config)["total"],
                         "train_loss": sum(res.losses()[-10:]) / len(res.losses()[-10:]),
                         "loss_tokens": n_loss,
                         "raw_tokens": decoder_span_length(T + 1)[0] if objective == "span"
                         else T,
                         "flops_per_loss_token": training_flops_per_token(res.model_config, T)
                         * T / n_loss,
                         "continuation_bpb": cont, "infill_bpb": fill["both"],
                         "infill_left_only_bpb": fill["left"], "seconds": seconds})
            histories[objective] = res.losses()
    return pd.DataFrame(rows).set_index("objective"), histories
