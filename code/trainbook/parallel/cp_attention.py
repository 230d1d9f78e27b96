"""Context-parallel attention: the online softmax, sequence sharding, and the four schemes.

A query needs the keys and values of every earlier position, so attention is the one layer
that must talk across a sequence split over ranks. The online softmax folds key/value blocks in
one at a time; `allgather_kv_attention` gathers the whole sequence's K and V (Llama 3, Section
3.3.2); `ring_attention` passes K/V blocks around a ring (Liu et al. 2023); `ulysses_attention`
trades the sequence split for a head split with all-to-alls (Jacobs et al. 2023, the exchange is
in `cp_ulysses`); `hybrid_attention` does Ulysses inside groups and the ring across them (USP,
Fang and Zhao 2024). Contiguous or zig-zag sharding decides how even the causal work is
(`causal_work`). The mask comes from global positions and, for packed rows, document ids
(`attention_mask`). Each function takes the CP ranks' `group` (default: all ranks; the hybrid
takes `hybrid_groups`); `check_attention` compares one against full attention.

Chapter: book/parallelism/context-parallel.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import compat
from . import cp_ulysses as uly

SCHEMES = ("contiguous", "zigzag")


# ---------------------------------------------------------------------------------------------
# The online softmax: attention over key/value blocks, one block at a time
# ---------------------------------------------------------------------------------------------

def online_softmax_update(state: tuple[torch.Tensor, ...] | None, q: torch.Tensor,
                          k: torch.Tensor, v: torch.Tensor,
                          mask: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Fold one key/value block into the running attention state (acc, m, l) of queries q.

    q: (..., Tq, d), k and v: (..., Tk, d), mask: bool (Tq, Tk) or (B, 1, Tq, Tk), True where a
    query may attend.
    m is the running max of the scores per query, l the running sum of exp(score - m), acc the
    running sum of exp(score - m) * v. A new block may raise the max: the old sums are rescaled
    by exp(m_old - m_new). Pass state=None for the first block; `online_softmax_finish` divides.
    m is a stabilizer that cancels in acc / l, so it is detached: the gradient stays exact.
    """
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    if state is None:
        shape = s.shape[:-1] + (1,)
        state = (torch.zeros(*s.shape[:-1], v.shape[-1], dtype=v.dtype, device=v.device),
                 torch.full(shape, float("-inf"), dtype=s.dtype, device=s.device),
                 torch.zeros(shape, dtype=s.dtype, device=s.device))
    acc, m, l = state
    m_new = torch.maximum(m, s.detach().amax(-1, keepdim=True))
    m_safe = m_new.masked_fill(torch.isinf(m_new), 0.0)  # rows that have seen no key yet
    p = torch.exp(s - m_safe)
    scale = torch.exp(m - m_safe)
    return acc * scale + p @ v, m_new, l * scale + p.sum(-1, keepdim=True)


def online_softmax_finish(state: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output acc / l and the log-sum-exp m + log(l) of each query's scores."""
    acc, m, l = state
    if bool((l == 0).any()):
        raise ValueError("a query attended to no key at all (every block masked it out); "
                         "with a causal mask every query must at least see itself")
    return acc / l, m + torch.log(l)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              q_pos: torch.Tensor | None = None, k_pos: torch.Tensor | None = None,
              q_doc: torch.Tensor | None = None, k_doc: torch.Tensor | None = None) -> torch.Tensor:
    """Plain softmax attention with an optional causal (and document) mask: the yardstick."""
    mask = None if q_pos is None else attention_mask(q_pos, k_pos, q_doc, k_doc)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """bool (Tq, Tk): query at global position i may attend to key at j when j <= i."""
    return k_pos[None, :] <= q_pos[:, None]


def attention_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, q_doc: torch.Tensor | None = None,
                   k_doc: torch.Tensor | None = None) -> torch.Tensor:
    """The causal mask, and with document ids the document mask too: a packed row holds several
    documents, and a query may only see earlier keys of its own document.

    Both depend on the tokens' global identity (position, document), never on where a rank
    holds them. Document ids of shape (Tq,) give a (Tq, Tk) mask; (B, Tq), one packing per row,
    give (B, 1, Tq, Tk), which broadcasts over heads.
    """
    mask = causal_mask(q_pos, k_pos)
    if q_doc is None and k_doc is None:
        return mask
    if q_doc is None or k_doc is None:
        raise ValueError("give document ids for both the queries and the keys, or for neither")
    same = q_doc[..., :, None] == k_doc[..., None, :]
    return mask & (same if same.dim() == 2 else same.unsqueeze(-3))


def packed_document_ids(batch: int, seq_len: int, documents: int, seed: int = 0) -> torch.Tensor:
    """Document ids (batch, seq_len) of rows that each pack `documents` documents, cut at random
    places (a different packing per row), to test document masks against."""
    if not 1 <= documents <= seq_len:
        raise ValueError(f"{documents} documents in a {seq_len}-token row: use 1..{seq_len}")
    g = torch.Generator().manual_seed(seed)
    starts = torch.zeros(batch, seq_len, dtype=torch.long)
    for b in range(batch):
        starts[b, torch.randperm(seq_len - 1, generator=g)[:documents - 1] + 1] = 1
    return starts.cumsum(-1)


# ---------------------------------------------------------------------------------------------
# Sharding the sequence
# ---------------------------------------------------------------------------------------------

def shard_positions(seq_len: int, cp: int, rank: int, scheme: str = "contiguous") -> torch.Tensor:
    """Global positions of the tokens rank `rank` of `cp` holds.

    contiguous: positions [r T/n, (r+1) T/n). zigzag: cut the sequence into 2n chunks; rank r
    holds chunks r and 2n-1-r (one early, one late), so the causal work is the same on every rank.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"scheme {scheme!r} is unknown; use one of {', '.join(SCHEMES)}")
    if cp < 1 or not 0 <= rank < cp:
        raise ValueError(f"rank {rank} is not in 0..{cp - 1} (cp={cp})")
    parts = cp if scheme == "contiguous" else 2 * cp
    if seq_len % parts:
        raise ValueError(f"sequence length {seq_len} is not divisible by {parts} "
                         f"({scheme} sharding over {cp} ranks cuts {parts} chunks); "
                         f"pad the sequence to a multiple of {parts}")
    c = seq_len // parts
    chunks = [rank] if scheme == "contiguous" else [rank, 2 * cp - 1 - rank]
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in chunks])


def causal_work(seq_len: int, cp: int, scheme: str = "contiguous") -> list[int]:
    """Query-key pairs under the causal mask per rank, in closed form (what attention computes).

    A query at position i sees i + 1 keys. A chunk of c positions starting at a sees
    c*a + c(c+1)/2 pairs. Contiguous: rank r has a = r c; zigzag: two chunks r and 2n-1-r of
    c = T/2n, c^2 (2n-1) + c(c+1) pairs on every rank.
    """
    shard_positions(seq_len, cp, 0, scheme)  # validates
    parts = cp if scheme == "contiguous" else 2 * cp
    c = seq_len // parts
    chunk = lambda i: c * (i * c) + c * (c + 1) // 2  # noqa: E731
    if scheme == "contiguous":
        return [chunk(r) for r in range(cp)]
    return [chunk(r) + chunk(2 * cp - 1 - r) for r in range(cp)]


def attention_work(kind: str, seq_len: int, cp: int, ulysses_degree: int = 2) -> list[float]:
    """Query-key pairs per head that each rank's attention computes under `kind` (closed form).

    All-gather and ring: `causal_work`. Ulysses: each rank attends over the whole sequence for
    H/n heads, so every rank does 1/n of the total whatever the sharding. Hybrid: a Ulysses group
    shares its ranks' causal work among u ranks.
    """
    _, scheme = check_kind(kind)
    work, u = causal_work(seq_len, cp, scheme), _ulysses_degree(kind, cp, ulysses_degree)
    return [sum(work[r] for r in row) / u for row in uly.hybrid_grid(cp, u) for _ in row]


# ---------------------------------------------------------------------------------------------
# Context-parallel attention (call inside a process group)
# ---------------------------------------------------------------------------------------------

def _group_info(group=None):
    if not dist.is_initialized():
        raise ValueError("context-parallel attention needs a process group: run under torchrun "
                         "or trainbook.launch.run")
    return dist.get_rank(group), dist.get_world_size(group)


def _repeat_kv(x, n_heads):
    """Grouped-query attention: each key/value head serves n_heads // kv_heads query heads."""
    return x if x.shape[1] == n_heads else x.repeat_interleave(n_heads // x.shape[1], dim=1)


def _count(counter, mask, heads):
    """Query-key pairs the mask lets through, times this rank's heads (rows summed if per row)."""
    if counter is not None:
        counter["pairs"] = counter.get("pairs", 0) + int(mask.sum()) * heads


def _cat(parts):
    return None if parts is None else torch.cat(parts, -1)


def allgather_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           positions: list[torch.Tensor], counter: dict | None = None,
                           group: dist.ProcessGroup | None = None,
                           documents: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence's keys and values.

    q: (B, H, T/n, d), k and v: (B, Hkv, T/n, d) for this rank's tokens; positions[r] are the
    global positions rank r holds. K and V are all-gathered with the autograd-aware functional
    collective, whose backward is a reduce-scatter: the gradient of a key sums over the queries
    of every rank. The causal mask compares global positions, so any sharding works. `group`:
    the CP ranks (default: all ranks); `documents[r]`: the document ids of rank r's tokens.
    """
    rank, _ = _group_info(group)
    group = group or dist.group.WORLD
    k_all = _all_gather_seq(k, group)
    v_all = _all_gather_seq(v, group)
    mask = attention_mask(positions[rank], torch.cat(positions),
                          None if documents is None else documents[rank], _cat(documents))
    _count(counter, mask, q.shape[1])
    return F.scaled_dot_product_attention(q, _repeat_kv(k_all, q.shape[1]),
                                          _repeat_kv(v_all, q.shape[1]), attn_mask=mask)


def _all_gather_seq(x, group):
    """Autograd-aware all-gather along the sequence (dim 2); its backward is a reduce-scatter.
    The input is made contiguous: gloo silently corrupts strided tensors."""
    return compat.all_gather_autograd(x.contiguous(), 2, group)


class RingShift(torch.autograd.Function):
    """Send x to rank r+1 and receive rank r-1's block; backward sends the gradient back the
    other way (r -> r-1), which is exactly the transpose of the forward permutation."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        ctx.group = group
        return _shift(x, +1, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _shift(g, -1, ctx.group), None


def _shift(x, direction: int, group=None):
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    x = x.contiguous()
    out = torch.empty_like(x)
    send = dist.isend(x, group=group, group_dst=(rank + direction) % world)
    dist.recv(out, group=group, group_src=(rank - direction) % world)
    send.wait()
    return out


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   positions: list[torch.Tensor], counter: dict | None = None,
                   group: dist.ProcessGroup | None = None,
                   documents: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Attention over the whole sequence with K/V blocks passed around the ring of ranks.

    Step t (0..n-1): this rank holds the K/V block of rank (r - t) mod n, folds it into the
    online softmax (skipping blocks the mask hides entirely), and shifts it on. K and V
    travel stacked, one message per step. A skipped block still joins the output with weight 0:
    its shift's backward (a send/recv pair) must run on every rank, or the ring deadlocks.
    Here each shift completes before the block is computed, which keeps autograd simple;
    production kernels post the receive, compute the block, then wait, so the transfer overlaps.
    """
    rank, world = _group_info(group)
    kv = torch.stack([k, v])
    state, unused = None, 0.0
    for t in range(world):
        src = (rank - t) % world
        nxt = RingShift.apply(kv, group) if t < world - 1 else None  # the next step's block
        mask = attention_mask(positions[rank], positions[src],
                              *(None, None) if documents is None else (documents[rank],
                                                                       documents[src]))
        if bool(mask.any()):
            _count(counter, mask, q.shape[1])
            state = online_softmax_update(state, q, _repeat_kv(kv[0], q.shape[1]),
                                          _repeat_kv(kv[1], q.shape[1]), mask)
        else:  # keep the block in the graph: every rank's backward must run every shift
            unused = unused + 0.0 * kv.sum()
        kv = nxt
    return online_softmax_finish(state)[0] + unused


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      positions: list[torch.Tensor], counter: dict | None = None,
                      group: dist.ProcessGroup | None = None,
                      documents: list[torch.Tensor] | None = None) -> torch.Tensor:
    """DeepSpeed-Ulysses: all-to-all to the whole sequence for H/n heads, attend, all-to-all back.

    q: (B, H, T/n, d), k and v: (B, Hkv, T/n, d) for this rank's tokens. After `seq_to_heads`
    the tokens are in rank order, so the mask is built from `torch.cat(positions)`: right for any
    sharding. K/V heads are replicated first when the ranks outnumber them (`ulysses_kv_heads`).
    Autograd runs back through the all-to-alls (each one's backward is the inverse all-to-all).
    """
    _, world = _group_info(group)
    kv_heads = uly.ulysses_kv_heads(q.shape[1], k.shape[1], world)  # before any communication
    q, k, v = (uly.seq_to_heads(t, group)
               for t in (q, _repeat_kv(k, kv_heads), _repeat_kv(v, kv_heads)))
    order = torch.cat(positions)
    mask = attention_mask(order, order, _cat(documents), _cat(documents))
    _count(counter, mask, q.shape[1])
    out = F.scaled_dot_product_attention(q, _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1]),
                                         attn_mask=mask)
    return uly.heads_to_seq(out, group)


def hybrid_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     positions: list[torch.Tensor], counter: dict | None = None,
                     group: uly.HybridGroups | None = None,
                     documents: list[torch.Tensor] | None = None) -> torch.Tensor:
    """USP: Ulysses inside each row of the grid, ring attention down each column.

    The all-to-all gives every rank of row i the tokens of all of row i's ranks (for H/u heads);
    the ring then passes those row-sized blocks between rows, so ring position i holds the
    positions (and document ids) of grid row i.
    """
    if not isinstance(group, uly.HybridGroups):
        raise ValueError("hybrid attention needs the Ulysses x ring groups: pass "
                         "group=cp_ulysses.hybrid_groups(ulysses_degree)")
    if len(positions) != sum(map(len, group.grid)):
        raise ValueError(f"positions cover {len(positions)} ranks, the grid {group.grid}: "
                         "give one tensor of positions per CP rank")
    kv_heads = uly.ulysses_kv_heads(q.shape[1], k.shape[1], group.ulysses_degree)
    q, k, v = (uly.seq_to_heads(t, group.ulysses)
               for t in (q, _repeat_kv(k, kv_heads), _repeat_kv(v, kv_heads)))
    rows = [torch.cat([positions[r] for r in row]) for row in group.grid]
    docs = None if documents is None else [_cat([documents[r] for r in row]) for row in group.grid]
    out = ring_attention(q, k, v, rows, counter, group.ring, docs)
    return uly.heads_to_seq(out, group.ulysses)


ATTENTION = {"allgather_kv": (allgather_kv_attention, "contiguous"),
             "allgather_kv_zigzag": (allgather_kv_attention, "zigzag"),
             "ring": (ring_attention, "contiguous"),
             "ring_zigzag": (ring_attention, "zigzag"),
             "ulysses": (ulysses_attention, "contiguous"),
             "ulysses_zigzag": (ulysses_attention, "zigzag"),
             "hybrid": (hybrid_attention, "contiguous"),
             "hybrid_zigzag": (hybrid_attention, "zigzag")}
KINDS = tuple(ATTENTION)


def check_kind(kind: str) -> tuple[Callable[..., torch.Tensor], str]:
    """(attention function, sharding scheme) of a kind; an unknown kind is rejected by name."""
    if kind not in ATTENTION:
        raise ValueError(f"kind {kind!r} is unknown; use one of {', '.join(ATTENTION)}")
    return ATTENTION[kind]


def _ulysses_degree(kind, cp, ulysses_degree):
    return cp if kind.startswith("ulysses") else ulysses_degree if kind.startswith("hybrid") else 1


def check_layout(kind: str, cp: int, heads: int, kv_heads: int, ulysses_degree: int = 2) -> None:
    """Reject, before any work, a layout the kind cannot run: Ulysses needs the heads to split
    over its ranks, the hybrid needs its Ulysses degree to divide the CP ranks."""
    check_kind(kind)
    u = _ulysses_degree(kind, cp, ulysses_degree)
    uly.hybrid_grid(cp, u)
    uly.ulysses_kv_heads(heads, kv_heads, u)


def attention_group(kind: str, group: dist.ProcessGroup | None = None,
                    ulysses_degree: int = 2) -> dist.ProcessGroup | uly.HybridGroups | None:
    """What the kind's attention takes as `group`: the CP group, or for the hybrid the grid's
    groups (made once here, since `dist.new_group` is collective and not free)."""
    return uly.hybrid_groups(ulysses_degree, group) if kind.startswith("hybrid") else group


def check_attention(kind: str, batch: int = 2, heads: int = 4, kv_heads: int = 2, seq_len: int = 32,
                    head_dim: int = 8, seed: int = 0, group: dist.ProcessGroup | None = None,
                    documents: int = 0, ulysses_degree: int = 2) -> dict:
    """One rank's largest |difference| from full causal attention: output and dq, dk, dv.

    Every rank builds the same full q, k, v and upstream gradient, computes the single-process
    answer, then runs the context-parallel attention on its shard and compares its slice.
    `documents` > 0 packs that many documents in every row (`packed_document_ids`) and masks
    across them, in the reference and in the CP version alike. "pairs": query-key pairs per head
    this rank computed (summed over rows when there are documents).
    """
    fn, scheme = check_kind(kind)
    rank, world = _group_info(group)
    check_layout(kind, world, heads, kv_heads, ulysses_degree)
    positions = [shard_positions(seq_len, world, r, scheme) for r in range(world)]
    doc = packed_document_ids(batch, seq_len, documents, seed) if documents else None
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq_len, head_dim, generator=g, requires_grad=True)
    k = torch.randn(batch, kv_heads, seq_len, head_dim, generator=g, requires_grad=True)
    v = torch.randn(batch, kv_heads, seq_len, head_dim, generator=g, requires_grad=True)
    up = torch.randn(batch, heads, seq_len, head_dim, generator=g)
    pos = torch.arange(seq_len)
    ref = attention(q, _repeat_kv(k, heads), _repeat_kv(v, heads), pos, pos, doc, doc)
    (ref * up).sum().backward()
    mine = positions[rank]
    ql, kl, vl = (t.detach()[:, :, mine].clone().requires_grad_() for t in (q, k, v))
    counter: dict = {}
    docs = None if doc is None else [doc[:, p] for p in positions]
    out = fn(ql, kl, vl, positions, counter, attention_group(kind, group, ulysses_degree), docs)
    (out * up[:, :, mine]).sum().backward()
    diff = lambda a, b: (a - b).abs().max().item()  # noqa: E731
    return {"rank": rank, "kind": kind, "documents": documents,
            "out": diff(out, ref.detach()[:, :, mine]), "dq": diff(ql.grad, q.grad[:, :, mine]),
            "dk": diff(kl.grad, k.grad[:, :, mine]), "dv": diff(vl.grad, v.grad[:, :, mine]),
            "pairs": counter["pairs"] / heads}
