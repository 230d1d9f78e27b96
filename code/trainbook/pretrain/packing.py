"""Packing versus padding, and document masks so packed documents do not see each other.

Padding gives each document its own row and fills the rest with pad tokens that cost compute
and teach nothing; packing concatenates documents (each ended by an EOS token) and cuts the
stream into full rows, so almost nothing is wasted, but a row then holds several documents and
causal attention lets each one attend to the documents before it. A document mask (attend only
within your own document, causally) and positions that restart at each document make a packed
row compute, for every document, exactly what it would alone. The mask goes in through the
model's seam: each attention's `core(q, k, v)` replaced on the instance.

Chapter: book/pretraining/data-tokenization.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..data import pack
from ..model import Attention

STRATEGIES = ("fixed", "batch", "sorted", "packed")


def _chunks(lengths: Sequence[int], seq_len: int) -> np.ndarray:
    """Document lengths cut into pieces of at most seq_len (a long document fills rows)."""
    out = []
    for n in lengths:
        full, rest = divmod(int(n), seq_len)
        out += [seq_len] * full + ([rest] if rest else [])
    return np.array(out, dtype=np.int64)


def padding_waste(lengths: Sequence[int], seq_len: int, strategy: str = "fixed",
                  batch_size: int = 8, seed: int = 0) -> float:
    """Fraction of the token slots a batching strategy fills with padding.

    fixed: every document (or seq_len piece of one) gets a row of seq_len. batch: pieces in
    random order, each batch padded to its longest piece. sorted: the same after sorting by
    length (length bucketing). packed: one stream cut into rows; only the last row is padded.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy {strategy!r} is unknown; use one of {STRATEGIES}")
    if seq_len < 1 or batch_size < 1:
        raise ValueError(f"seq_len and batch_size must be >= 1, got {seq_len}, {batch_size}")
    if len(lengths) == 0 or min(lengths) < 1:
        raise ValueError("lengths must be a non-empty list of positive document lengths")
    tokens = int(np.sum(lengths))
    if strategy == "packed":
        return 1 - tokens / (math.ceil(tokens / seq_len) * seq_len)
    pieces = _chunks(lengths, seq_len)
    if strategy == "fixed":
        return 1 - tokens / (len(pieces) * seq_len)
    if strategy == "batch":
        pieces = np.random.default_rng(seed).permutation(pieces)
    else:
        pieces = np.sort(pieces)
    slots = sum(len(b) * int(b.max()) for b in np.array_split(
        pieces, math.ceil(len(pieces) / batch_size)))
    return 1 - tokens / slots


@dataclass
class Packed:
    """Packed rows of seq_len + 1 tokens (inputs and shifted targets, as `data.pack`), the
    document each token belongs to, and its position inside that document."""

    tokens: torch.Tensor  # (rows, seq_len + 1)
    doc_ids: torch.Tensor  # (rows, seq_len + 1), the index of the document in the input list
    positions: torch.Tensor  # (rows, seq_len + 1), restarting at 0 at each document and row


def pack_documents(docs: Sequence[Sequence[int]], seq_len: int, eos_id: int) -> Packed:
    """Concatenate documents, each followed by eos_id, and cut the stream into rows."""
    if not docs:
        raise ValueError("pack_documents needs at least one document")
    stream = torch.tensor([t for d in docs for t in (*d, eos_id)], dtype=torch.long)
    owner = torch.repeat_interleave(torch.arange(len(docs)),
                                    torch.tensor([len(d) + 1 for d in docs]))
    tokens, doc_ids = pack(stream, seq_len), pack(owner, seq_len)
    return Packed(tokens, doc_ids, document_positions(doc_ids))


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """Position of each token inside its document, restarting at every document boundary and
    at the start of each row: (..., T) document ids -> (..., T) positions."""
    T = doc_ids.shape[-1]
    idx = torch.arange(T, device=doc_ids.device).expand_as(doc_ids)
    start = torch.ones_like(doc_ids, dtype=torch.bool)
    start[..., 1:] = doc_ids[..., 1:] != doc_ids[..., :-1]
    first = torch.where(start, idx, torch.zeros_like(idx)).cummax(-1).values
    return idx - first


def document_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """Boolean attention mask (B, 1, T, T), True where query i may attend to key j: causal and
    in the same document (block-diagonal causal)."""
    if doc_ids.dim() != 2:
        raise ValueError(f"doc_ids must be (batch, time), got shape {tuple(doc_ids.shape)}")
    T = doc_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    return (doc_ids[:, :, None] == doc_ids[:, None, :])[:, None] & causal


def cu_seqlens(doc_ids: torch.Tensor) -> torch.Tensor:
    """Cumulative sequence boundaries of the documents in (B, T) rows, flattened: the int32
    `cu_seqlens` that variable-length attention kernels (FlashAttention's varlen functions)
    take instead of a mask, so masked-out blocks are never computed."""
    start = torch.ones_like(doc_ids, dtype=torch.bool)
    start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    starts = torch.nonzero(start.flatten()).flatten()
    return torch.cat([starts, torch.tensor([doc_ids.numel()])]).to(torch.int32)


def _masked_core(attn: Attention, mask: torch.Tensor
                 ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.softmax_scale,
                                              enable_gqa=k.shape[1] != q.shape[1])
    return core


@contextlib.contextmanager
def document_attention(model: torch.nn.Module, doc_ids: torch.Tensor) -> Iterator[None]:
    """Within the block, every attention of `model` uses the document mask of doc_ids (B, T):
    its `core` is replaced on the instance and restored on exit."""
    mask = document_mask(doc_ids)
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if not layers:
        raise ValueError("the model has no trainbook.model.Attention layers to mask")
    for m in layers:
        m.core = _masked_core(m, mask)
    try:
        yield
    finally:
        for m in layers:
            del m.core


@torch.no_grad()
def leak(model: torch.nn.Module, before: Sequence[int], other: Sequence[int],
         doc: Sequence[int], masked: bool, reset_positions: bool) -> dict[str, float]:
    """Does a packed document see the one before it? Run rows [before, doc] and [other, doc]
    (before and other of equal length) and compare doc's logits between them, and with doc
    run alone. Returns the max abs differences."""
    if len(before) != len(other):
        raise ValueError(f"before and other must have the same length so that doc sits at the "
                         f"same place, got {len(before)} and {len(other)}")
    model.eval()

    def logits(prev: Sequence[int]) -> torch.Tensor:
        idx = torch.tensor([[*prev, *doc]])
        ids = torch.tensor([[0] * len(prev) + [1] * len(doc)])
        pos = document_positions(ids)[0] if reset_positions else None
        ctx = document_attention(model, ids) if masked else contextlib.nullcontext()
        with ctx:
            out, _ = model(idx, positions=pos)
        return out[0, len(prev):]

    a, b = logits(before), logits(other)
    alone, _ = model(torch.tensor([list(doc)]))
    return {"vs other previous document": (a - b).abs().max().item(),
            "vs document alone": (a - alone[0]).abs().max().item()}
