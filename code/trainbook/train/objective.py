"""The trainer's objectives: what the model predicts from a packed batch, and what it may see.

- clm: next token, causal attention (the model as built; nothing here touches it).
- mlm: BERT's masked LM: a fixed 15% of the positions per sequence are chosen, 80% of them
  become [MASK], 10% a random token, 10% stay; the loss is on the chosen positions only, and
  attention is bidirectional.
- span: T5's span corruption laid out for a decoder (as UL2 trains decoder-only models):
  [corrupted inputs with sentinels][targets], bidirectional over the inputs, loss on the targets.
- prefix: prefix LM: bidirectional over a random prefix, next-token loss after it.

A batch stays a pair (inputs, targets) of shape (batch, seq_len) with -100 where there is no
loss, so every engine and loss function takes it unchanged. The attention pattern is read from
the targets: `prepare_model` wraps the model's forward to derive a mask from them and replaces
each attention's `core` with one that applies it. A row whose targets hold no -100 (a plain
next-token batch, as `evaluate` passes) stays causal, so the trainer's validation loss is the
same next-token loss for every objective.

Every micro-batch of an objective has the same number of loss-bearing tokens (BERT's and T5's
recipes fix it per sequence; prefix splits come in mirrored pairs), so the engine's mean of
per-micro-batch means weighs every token equally, under gradient accumulation and DDP alike.
Special tokens extend the tokenizer's vocabulary from the top, as T5's extra ids do:
[MASK] is the last id, sentinel i is `vocab_size - 1 - i` (`special_tokens` says how many).

Chapter: book/pretraining/objectives; book/start/first-run (next-token prediction).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

__all__ = ["ATTENTION", "attention_mask", "bert_mask", "decoder_span_length", "noise_counts",
           "objective_batches", "prefix_lengths", "prepare_model", "random_spans_noise_mask",
           "span_corrupt", "special_tokens"]

# objective -> how its rows attend (the trainer's choices are config.OBJECTIVES)
ATTENTION = {"clm": "causal", "mlm": "bidirectional", "span": "prefix", "prefix": "prefix"}
MLM_PROB = 0.15  # BERT (Devlin et al. 2019, Section 3.1); create_pretraining_data.py
NOISE_DENSITY, MEAN_SPAN = 0.15, 3.0  # T5's span_corruption defaults (Raffel et al. 2020)
IGNORE = -100  # F.cross_entropy's ignore_index, which lm_loss keeps


def _check_objective(objective: str) -> str:
    if objective not in ATTENTION:
        raise ValueError(f"objective must be one of {', '.join(ATTENTION)}, got {objective!r}")
    return objective


def noise_counts(length: int, noise_density: float, mean_noise_span_length: float
                 ) -> tuple[int, int]:
    """(noise tokens, noise spans) as T5's random_spans_noise_mask fixes them for `length`
    tokens: round(length * density) clamped to [1, length - 1], and round(noise / mean) >= 1,
    at most one span per non-noise token."""
    if length < 2:
        raise ValueError(f"span corruption needs at least 2 tokens, got {length}")
    if not 0 < noise_density < 1 or mean_noise_span_length < 1:
        raise ValueError(f"need 0 < noise_density < 1 and mean_noise_span_length >= 1, got "
                         f"{noise_density}, {mean_noise_span_length}")
    noise = min(max(round(length * noise_density), 1), length - 1)
    spans = max(round(noise / mean_noise_span_length), 1)
    # each noise span needs a non-noise token before it: T5's segmentation breaks without one
    # (never at T5's densities and lengths); here the spans are capped
    return noise, min(spans, length - noise)


def _segments(num_items: int, num_segments: int, rows: int, g: torch.Generator
              ) -> torch.Tensor:
    """T5's _random_segmentation, `rows` at once: `num_items` cut into `num_segments` non-empty
    pieces, every partition equally likely (num_segments - 1 cut marks among the num_items - 1
    gaps, a uniformly random subset). (rows, num_segments) lengths."""
    marks = torch.rand(rows, num_items - 1, generator=g).argsort(1) < num_segments - 1
    segment_id = torch.cat([torch.zeros(rows, 1, dtype=torch.long), marks.long()], 1).cumsum(1)
    lengths = torch.zeros(rows, num_segments, dtype=torch.long)
    return lengths.scatter_add_(1, segment_id, torch.ones_like(segment_id))


def random_spans_noise_mask(length: int, noise_density: float = NOISE_DENSITY,
                            mean_noise_span_length: float = MEAN_SPAN,
                            generator: torch.Generator | None = None,
                            batch: int | None = None) -> torch.Tensor:
    """T5's noise mask (t5/data/preprocessors.py): a fixed number of noise tokens in a fixed
    number of spans; spans alternate non-noise, noise, ..., starting with non-noise; segment
    lengths are random partitions, so all such masks are equally likely. Bool (length,), or
    (batch, length) for `batch` independent masks (T5's batch_size)."""
    noise, spans = noise_counts(length, noise_density, mean_noise_span_length)
    g = generator if generator is not None else torch.Generator().manual_seed(0)
    rows = 1 if batch is None else batch
    if rows < 1:
        raise ValueError(f"batch must be >= 1 (or None), got {batch}")
    lengths = torch.stack([_segments(length - noise, spans, rows, g),
                           _segments(noise, spans, rows, g)], 2).reshape(rows, 2 * spans)
    span_number = torch.searchsorted(lengths.cumsum(1), torch.arange(length).repeat(rows, 1),
                                     right=True)  # spans ended at or before each position
    mask = span_number % 2 == 1
    return mask[0] if batch is None else mask


def span_corrupt(tokens: torch.Tensor, noise_mask: torch.Tensor, vocab_size: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """T5's noise_span_to_unique_sentinel (inputs) and nonnoise_span_to_unique_sentinel
    (targets): each run of noise becomes one sentinel in the inputs, each run of non-noise one
    in the targets; sentinel i is id vocab_size - 1 - i, as T5 counts down from the top.
    1-d, or (batch, length) rows whose masks have equal counts (as T5's always do)."""
    if tokens.shape != noise_mask.shape or tokens.dim() not in (1, 2):
        raise ValueError(f"tokens {tuple(tokens.shape)} and noise_mask "
                         f"{tuple(noise_mask.shape)} must be the same 1-d or 2-d shape")
    rows = tokens.reshape(-1, tokens.shape[-1])

    def collapse(mask):
        mask = mask.reshape(rows.shape)
        prev = torch.cat([mask[:, :1] & False, mask[:, :-1]], 1)
        first = mask & ~prev
        sentinel = vocab_size - first.long().cumsum(1)  # first span: vocab_size - 1
        keep = ~(mask & prev)
        if (keep.sum(1) != keep[0].sum()).any():
            raise ValueError("rows' masks differ in their noise counts; corrupt them one by one")
        out = torch.where(first, sentinel, rows)[keep].view(len(rows), -1)
        return out[0] if tokens.dim() == 1 else out

    return collapse(noise_mask), collapse(~noise_mask)


def decoder_span_length(row_len: int, noise_density: float = NOISE_DENSITY,
                        mean_noise_span_length: float = MEAN_SPAN) -> tuple[int, int, int]:
    """The most raw tokens whose corrupted inputs plus targets fit in `row_len` positions (each
    span costs two sentinels, one in each): (raw tokens, inputs length, targets length)."""
    for raw in range(row_len, 1, -1):
        noise, spans = noise_counts(raw, noise_density, mean_noise_span_length)
        if raw + 2 * spans <= row_len:
            return raw, raw - noise + spans, noise + spans
    raise ValueError(f"a row of {row_len} positions is too short for span corruption")


def special_tokens(objective: str, seq_len: int) -> int:
    """Ids the objective adds on top of the tokenizer's vocabulary: [MASK] for mlm, one sentinel
    per noise span for span (T5 reserves 100 extra ids; a fixed row length needs fewer)."""
    _check_objective(objective)
    if objective == "mlm":
        return 1
    if objective == "span":
        return noise_counts(decoder_span_length(seq_len + 1)[0], NOISE_DENSITY, MEAN_SPAN)[1]
    return 0


def bert_mask(tokens: torch.Tensor, mask_id: int, vocab_size: int, prob: float = MLM_PROB,
              generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masking (create_pretraining_data.py): per row, exactly max(1, round(T * prob))
    positions; each becomes [MASK] with probability 0.8, else stays with 0.5, else a random id
    in [0, vocab_size). Returns (inputs, labels), labels -100 where not chosen."""
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be (batch, time), got shape {tuple(tokens.shape)}")
    if not 0 < prob < 1 or vocab_size < 1:
        raise ValueError(f"need 0 < prob < 1 and vocab_size >= 1, got {prob}, {vocab_size}")
    g = generator if generator is not None else torch.Generator().manual_seed(0)
    B, T = tokens.shape
    n = max(1, round(T * prob))
    chosen = torch.zeros(B, T, dtype=torch.bool)
    chosen.scatter_(1, torch.rand(B, T, generator=g).argsort(1)[:, :n], True)
    u, keep = torch.rand(B, T, generator=g), torch.rand(B, T, generator=g)
    random_ids = torch.randint(0, vocab_size, (B, T), generator=g)
    inputs = torch.where(chosen & (u < 0.8), torch.full_like(tokens, mask_id), tokens)
    inputs = torch.where(chosen & (u >= 0.8) & (keep >= 0.5), random_ids, inputs)
    return inputs, torch.where(chosen, tokens, torch.full_like(tokens, IGNORE))


def prefix_lengths(batch: int, length: int, noise_density: float = 0.5,
                   generator: torch.Generator | None = None, mirrored: bool = True
                   ) -> torch.Tensor:
    """Prefix lengths as T5's random_prefix_noise_mask draws them: uniform in
    [max(1, round((1 - 2 density)(length - 1))), length - 1]. `mirrored`: drawn for even rows
    and mirrored for odd ones (lo + hi - P), so each row stays uniform and every batch has the
    same number of loss-bearing tokens (an odd last row takes the middle)."""
    if batch < 1 or length < 2 or not 0 < noise_density <= 0.5:
        raise ValueError(f"need batch >= 1, length >= 2 and 0 < noise_density <= 0.5, got "
                         f"{batch}, {length}, {noise_density}")
    g = generator if generator is not None else torch.Generator().manual_seed(0)
    hi = length - 1
    lo = min(hi, max(1, round((1 - 2 * noise_density) * hi)))
    if not mirrored:
        return torch.randint(lo, hi + 1, (batch,), generator=g)
    first = torch.randint(lo, hi + 1, ((batch + 1) // 2,), generator=g)
    out = torch.stack([first, lo + hi - first], 1).reshape(-1)[:batch]
    if batch % 2:
        out[-1] = (lo + hi) // 2
    return out


def attention_mask(targets: torch.Tensor | None, kind: str) -> torch.Tensor | None:
    """Which keys each query may see, from the targets (batch, T): a bool (batch, 1, T, T), or
    None when every row is causal. "bidirectional": rows with any -100 see everything. "prefix":
    the positions up to the first loss-bearing one form the prefix, seen from everywhere."""
    if targets is None or kind == "causal":
        return None
    B, T = targets.shape
    pos = torch.arange(T, device=targets.device)
    causal = pos[None, :] <= pos[:, None]  # (query, key)
    ignored = targets == IGNORE
    if not ignored.any():
        return None
    if kind == "bidirectional":
        return (causal[None] | ignored.any(1)[:, None, None])[:, None]
    if kind != "prefix":
        raise ValueError(f"attention kind must be causal, bidirectional or prefix, got {kind!r}")
    has_loss = ~ignored
    prefix = torch.where(has_loss.any(1), has_loss.float().argmax(1) + 1, T)  # (B,)
    return (causal[None] | (pos[None, None, :] < prefix[:, None, None]))[:, None]


def _core(attn: torch.nn.Module, state: dict) -> Callable:
    def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        mask = state["mask"]  # set by the model's forward for the batch in flight
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                              scale=attn.softmax_scale,
                                              enable_gqa=k.shape[1] != q.shape[1])
    return core


def prepare_model(model: torch.nn.Module, objective: str) -> None:
    """Set up `model` for `objective`. clm: causal, as built (untouched). Otherwise wrap its
    forward to read the attention mask from the targets and give every attention a core that
    applies it (the mask stays set until the next forward, so recomputation in backward sees
    the same one)."""
    kind = ATTENTION[_check_objective(objective)]
    if kind == "causal":
        return
    if getattr(model, "objective", None) is not None:
        raise ValueError(f"model is already prepared for {model.objective}; build a new one")
    state: dict = {"mask": None}
    forward = model.forward

    def masked_forward(idx: torch.Tensor, targets: torch.Tensor | None = None,
                       positions: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        state["mask"] = attention_mask(targets, kind)
        return forward(idx, targets, positions)

    model.forward = masked_forward
    model.objective = objective
    for block in model.layers():
        block.attn.core = _core(block.attn, state)


def _generator(*keys: int) -> torch.Generator:
    """A generator seeded from (seed, rank, step, micro-batch): the same masks on a resume."""
    seed = 0
    for k in keys:
        seed = (seed * 1_000_003 + int(k)) % (2**61 - 1)
    return torch.Generator().manual_seed(seed)


def _rows(objective: str, block: torch.Tensor, vocab_size: int, g: torch.Generator
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch of packed blocks (B, T + 1) -> (inputs, targets), each (B, T)."""
    B, T = block.shape[0], block.shape[1] - 1
    if objective == "mlm":
        return bert_mask(block[:, :T], vocab_size - 1, vocab_size - special_tokens("mlm", T),
                         generator=g)
    if objective == "prefix":
        x, y = block[:, :-1], block[:, 1:].clone()
        y[torch.arange(T)[None, :] < prefix_lengths(B, T + 1, generator=g)[:, None] - 1] = IGNORE
        return x, y
    raw, n_in, n_tgt = decoder_span_length(T + 1)
    inputs, targets = span_corrupt(block[:, :raw],
                                   random_spans_noise_mask(raw, generator=g, batch=B), vocab_size)
    rows = torch.zeros(B, T + 1, dtype=block.dtype)  # padding (no loss) after the targets
    rows[:, :n_in + n_tgt] = torch.cat([inputs, targets], 1)
    y = rows[:, 1:].clone()
    loss_at = torch.arange(T)
    y[:, (loss_at < n_in - 1) | (loss_at >= n_in + n_tgt - 1)] = IGNORE
    return rows[:, :-1], y


def objective_batches(objective: str, batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                      vocab_size: int, seed: Sequence[int] = (0,)
                      ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The step's micro-batches of packed (inputs, targets) turned into `objective`'s (inputs,
    targets with -100 where there is no loss). clm: the same list, untouched. `vocab_size` is
    the model's (special tokens at the top); `seed` fixes the randomness per (seed, rank, step)."""
    if ATTENTION[_check_objective(objective)] == "causal":
        return batches
    out = []
    for micro, (x, y) in enumerate(batches):
        block = torch.cat([x, y[:, -1:]], 1).cpu()  # the packed block: T + 1 tokens
        xo, yo = _rows(objective, block, vocab_size, _generator(*seed, micro))
        out.append((xo.to(x.device), yo.to(y.device)))
    return out
