"""Context-parallel attention: the online softmax, sequence sharding, all-gather-KV and ring.

A query needs the keys and values of every earlier position, so attention is the one layer
that must talk across a sequence split over ranks. The online softmax folds key/value blocks in
one at a time; `allgather_kv_attention` gathers the whole sequence's K and V (Llama 3, Section
3.3.2); `ring_attention` passes K/V blocks around a ring (Liu et al. 2023). Contiguous or
zig-zag sharding decides how even the causal work is (`causal_work`). Each function takes the CP
ranks' `group` (default: all ranks); `check_attention` compares one against full attention.

Chapter: book/parallelism/context-parallel.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import compat

SCHEMES = ("contiguous", "zigzag")


# ---------------------------------------------------------------------------------------------
# The online softmax: attention over key/value blocks, one block at a time
# ---------------------------------------------------------------------------------------------

def online_softmax_update(state: tuple[torch.Tensor, ...] | None, q: torch.Tensor,
                          k: torch.Tensor, v: torch.Tensor,
                          mask: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Fold one key/value block into the running attention state (acc, m, l) of queries q.

    q: (..., Tq, d), k and v: (..., Tk, d), mask: bool (Tq, Tk), True where a query may attend.
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
              q_pos: torch.Tensor | None = None, k_pos: torch.Tensor | None = None) -> torch.Tensor:
    """Plain softmax attention with an optional causal mask from global positions: the yardstick."""
    mask = None if q_pos is None else causal_mask(q_pos, k_pos)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """bool (Tq, Tk): query at global position i may attend to key at j when j <= i."""
    return k_pos[None, :] <= q_pos[:, None]


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


def allgather_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           positions: list[torch.Tensor], counter: dict | None = None,
                           group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence's keys and values.

    q: (B, H, T/n, d), k and v: (B, Hkv, T/n, d) for this rank's tokens; positions[r] are the
    global positions rank r holds. K and V are all-gathered with the autograd-aware functional
    collective, whose backward is a reduce-scatter: the gradient of a key sums over the queries
    of every rank. The causal mask compares global positions, so any sharding works. `group`:
    the CP ranks (default: all ranks).
    """
    rank, _ = _group_info(group)
    group = group or dist.group.WORLD
    k_all = _all_gather_seq(k, group)
    v_all = _all_gather_seq(v, group)
    mask = causal_mask(positions[rank], torch.cat(positions))
    if counter is not None:
        counter["pairs"] = counter.get("pairs", 0) + int(mask.sum())
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
                   group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Attention over the whole sequence with K/V blocks passed around the ring of ranks.

    Step t (0..n-1): this rank holds the K/V block of rank (r - t) mod n, folds it into the
    online softmax (skipping blocks the causal mask hides entirely), and shifts it on. K and V
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
        mask = causal_mask(positions[rank], positions[src])
        if bool(mask.any()):
            if counter is not None:
                counter["pairs"] = counter.get("pairs", 0) + int(mask.sum())
            state = online_softmax_update(state, q, _repeat_kv(kv[0], q.shape[1]),
                                          _repeat_kv(kv[1], q.shape[1]), mask)
        else:  # keep the block in the graph: every rank's backward must run every shift
            unused = unused + 0.0 * kv.sum()
        kv = nxt
    return online_softmax_finish(state)[0] + unused


ATTENTION = {"allgather_kv": (allgather_kv_attention, "contiguous"),
             "allgather_kv_zigzag": (allgather_kv_attention, "zigzag"),
             "ring": (ring_attention, "contiguous"),
             "ring_zigzag": (ring_attention, "zigzag")}
KINDS = tuple(ATTENTION)


def check_kind(kind: str) -> tuple[Callable[..., torch.Tensor], str]:
    if kind not in ATTENTION:
        raise ValueError(f"kind {kind!r} is unknown; use one of {', '.join(ATTENTION)}")
    return ATTENTION[kind]


def check_attention(kind: str, batch: int = 2, heads: int = 4, kv_heads: int = 2, seq_len: int = 32,
                    head_dim: int = 8, seed: int = 0,
                    group: dist.ProcessGroup | None = None) -> dict:
    """One rank's largest |difference| from full causal attention: output and dq, dk, dv.

    Every rank builds the same full q, k, v and upstream gradient, computes the single-process
    answer, then runs the context-parallel attention on its shard and compares its slice.
    """
    fn, scheme = check_kind(kind)
    rank, world = _group_info(group)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq_len, head_dim, generator=g, requires_grad=True)
    k = torch.randn(batch, kv_heads, seq_len, head_dim, generator=g, requires_grad=True)
    v = torch.randn(batch, kv_heads, seq_len, head_dim, generator=g, requires_grad=True)
    up = torch.randn(batch, heads, seq_len, head_dim, generator=g)
    pos = torch.arange(seq_len)
    ref = attention(q, _repeat_kv(k, heads), _repeat_kv(v, heads), pos, pos)
    (ref * up).sum().backward()
    positions = [shard_positions(seq_len, world, r, scheme) for r in range(world)]
    mine = positions[rank]
    ql, kl, vl = (t.detach()[:, :, mine].clone().requires_grad_() for t in (q, k, v))
    counter: dict = {}
    out = fn(ql, kl, vl, positions, counter, group)
    (out * up[:, :, mine]).sum().backward()
    diff = lambda a, b: (a - b).abs().max().item()  # noqa: E731
    return {"rank": rank, "kind": kind, "out": diff(out, ref.detach()[:, :, mine]),
            "dq": diff(ql.grad, q.grad[:, :, mine]), "dk": diff(kl.grad, k.grad[:, :, mine]),
            "dv": diff(vl.grad, v.grad[:, :, mine]), "pairs": counter["pairs"]}
