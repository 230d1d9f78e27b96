"""Packing SFT examples into rows, with and without document boundaries.

Chat examples are short and of unequal length; padding each batch to its longest example wastes
the slots after the shorter ones. Packing puts several examples in one row of `capacity`
tokens. `best_fit_decreasing` chooses the rows as trl's default packer does (`packing_strategy=
"bfd"`): examples by decreasing length, each into the open row with the least room that still
fits it, ties to the row that got that room first, a new row when none fits; no example is cut.

A packed row is only the same computation as the examples alone if nothing crosses a boundary:
attention must stay inside each example (a block-diagonal causal mask: `pretrain.packing.
document_attention` puts it into the reference model's attention), positions must restart at 0
for each example where the model has learned absolute positions (GPT-2); with RoPE the score of
two tokens depends only on their distance, so under the mask the restart changes nothing, and the
first token of each example is never a target (it would be predicted from the example before).
`packed_loss` computes the SFT loss of packed rows that way (`boundaries=True`) or naively
(`boundaries=False`: one causal sequence per row, positions running on, as concatenating
examples does), and `sft_packed` trains on packed rows: each step packs the same examples `sft`
would draw, so with boundaries its losses equal `sft`'s to rounding, and without them they show
what the contamination costs.

Chapter: book/alignment/sft
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from ..pretrain.packing import document_attention, document_positions
from .policy import pad
from .sft import SFTConfig, draws, examples, masked_lm_loss, optimize
from .task import PAD, ChatTokenizer, Problem


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Rows of example indices, packed best-fit decreasing into rows of `capacity` tokens (the
    order trl's "bfd" packer produces: rows in order of opening, examples in order of placing)."""
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"capacity must be a whole number of tokens >= 1, got {capacity!r}")
    if not lengths or min(lengths) < 1:
        raise ValueError("lengths must be a non-empty list of positive example lengths")
    if max(lengths) > capacity:
        raise ValueError(f"an example of {max(lengths)} tokens does not fit a row of {capacity}; "
                         "raise the capacity (trl's bfd would truncate it)")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: ties by index
    rows: list[list[int]] = []
    room: dict[int, deque[int]] = {}  # free tokens -> rows with that much room, first come first
    for i in order:
        n = lengths[i]
        fits = [r for r in room if r >= n]
        if fits:
            free = min(fits)
            row = room[free].popleft()
            if not room[free]:
                del room[free]
        else:
            free, row = capacity, len(rows)
            rows.append([])
        rows[row].append(i)
        if free - n > 0:
            room.setdefault(free - n, deque()).append(row)
    return rows


@dataclass
class PackedRows:
    """Packed examples, right-padded to the longest row."""

    ids: torch.Tensor  # (rows, T)
    mask: torch.Tensor  # (rows, T) loss mask: 0 on each example's first token and on padding
    doc_ids: torch.Tensor  # (rows, T) index of the example within its row; -1 on padding
    positions: torch.Tensor  # (rows, T) position inside the example, restarting at 0
    rows: list[list[int]]  # the example indices of each row

    @property
    def fill(self) -> float:
        """Share of the token slots holding example tokens (the rest is padding)."""
        return float((self.doc_ids >= 0).float().mean())


def pack(data: Sequence[tuple[Sequence[int], Sequence[int]]], capacity: int) -> PackedRows:
    """Pack (ids, mask) examples into rows of at most `capacity` tokens, best-fit decreasing."""
    if not data:
        raise ValueError("no examples to pack")
    rows = best_fit_decreasing([len(ids) for ids, _ in data], capacity)
    seqs, masks, docs = [], [], []
    for row in rows:
        seqs.append([t for i in row for t in data[i][0]])
        # the first token of each example is never a target: it would be predicted from the
        # example before it in the row
        masks.append([0 if j == 0 else int(m) for i in row for j, m in enumerate(data[i][1])])
        docs.append([k for k, i in enumerate(row) for _ in data[i][0]])
    ids, mask = pad(seqs, masks, pad_id=PAD)
    doc_ids = torch.full_like(ids, -1)
    for r, d in enumerate(docs):
        doc_ids[r, :len(d)] = torch.tensor(d)
    return PackedRows(ids, mask, doc_ids, document_positions(doc_ids), rows)


def padded_fill(data: Sequence[tuple[Sequence[int], Sequence[int]]]) -> float:
    """Share of the token slots holding example tokens when the examples are padded to the
    longest one, one per row (what `policy.pad` makes of a batch)."""
    if not data:
        raise ValueError("no examples")
    lengths = [len(ids) for ids, _ in data]
    return sum(lengths) / (len(lengths) * max(lengths))


def packed_loss(model: nn.Module, rows: PackedRows, boundaries: bool = True) -> torch.Tensor:
    """The SFT loss (token mean over the masked tokens) of packed rows. boundaries=True: each
    example attends only to itself (block-diagonal causal mask) and, for a model with learned
    positions, its positions restart at 0; False: one causal sequence per row."""
    device = next(model.parameters()).device
    ids, mask = rows.ids.to(device), rows.mask.to(device)
    if not boundaries:
        return masked_lm_loss(model, ids, mask)
    learned = getattr(model, "pos", None) is not None  # GPT-2: absolute positions, restart them
    forward = partial(model, positions=rows.positions.to(device)) if learned else model
    with document_attention(model, rows.doc_ids.to(device)):
        return masked_lm_loss(forward, ids, mask)


def sft_packed(model: nn.Module, tok: ChatTokenizer, items: Sequence[Problem],
               cfg: SFTConfig | None = None, capacity: int = 64, boundaries: bool = True,
               data: Sequence[tuple[list[int], list[int]]] | None = None,
               on_step: Callable[[int], None] | None = None) -> list[float]:
    """`sft` on packed rows: each step packs the examples `sft` would draw into rows of
    `capacity` tokens and trains on `packed_loss`; returns every step's loss. `data` replaces
    the items' assistant-token examples (for example all-token ones); `on_step` as in
    `sft.optimize`."""
    cfg = SFTConfig() if cfg is None else cfg
    data = list(data) if data is not None else examples(tok, items)
    if max(len(ids) for ids, _ in data) > capacity:
        raise ValueError(f"an example is longer than the row capacity {capacity}; raise it")
    batches = draws(len(data), cfg)

    def loss_at(step: int) -> torch.Tensor:
        return packed_loss(model, pack([data[i] for i in batches[step]], capacity), boundaries)

    return optimize(model, cfg, loss_at, on_step)


@torch.no_grad()
def contamination(model: nn.Module, data: Sequence[tuple[Sequence[int], Sequence[int]]],
                  capacity: int) -> dict[str, float]:
    """What packing does to the loss of the same examples: their padded loss (each alone), the
    packed loss with boundaries and without, and the largest difference in the assistant
    tokens' logits between packed-naive and alone, and packed-with-boundaries and alone."""
    rows = pack(data, capacity)
    was = model.training
    model.eval()
    ids, mask = pad([list(d[0]) for d in data], [list(d[1]) for d in data])
    alone = model(ids)[0]
    gaps = {}
    for name, bounded in (("naive", False), ("boundaries", True)):
        learned = getattr(model, "pos", None) is not None and bounded
        ctx = document_attention(model, rows.doc_ids) if bounded else contextlib.nullcontext()
        with ctx:
            logits = model(rows.ids, positions=rows.positions if learned else None)[0]
        gap = 0.0
        for r, row in enumerate(rows.rows):
            start = 0
            for i in row:
                n = len(data[i][0])
                trained = torch.tensor([*data[i][1][1:], 0], dtype=torch.bool)  # predicts a target
                diff = (logits[r, start:start + n] - alone[i, :n])[trained]
                gap = max(gap, diff.abs().max().item() if diff.numel() else 0.0)
                start += n
        gaps[name] = gap
    out = {"padded loss": masked_lm_loss(model, ids, mask).item(),
           "packed loss, boundaries": packed_loss(model, rows, True).item(),
           "packed loss, naive": packed_loss(model, rows, False).item(),
           "max logit gap, naive": gaps["naive"],
           "max logit gap, boundaries": gaps["boundaries"], "fill, packed": rows.fill,
           "fill, padded": padded_fill(data)}
    model.train(was)
    return out
