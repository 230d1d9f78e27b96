"""DeepSpeed-Ulysses' all-to-all, the Ulysses x ring grid, and what each CP scheme sends.

Ulysses (Jacobs et al. 2023) turns a shard of the sequence with every head into the whole
sequence with a shard of the heads: one all-to-all each for q, k and v; attention is then
ordinary attention per head; one more all-to-all brings the output back to sequence shards.
`AllToAll` is that exchange with autograd, `seq_to_heads` and `heads_to_seq` the re-layout around
it, and `ulysses_kv_heads` how grouped-query K/V heads split over the ranks. USP (Fang and Zhao
2024) runs Ulysses inside groups of ranks and ring attention across them: `hybrid_grid` lays the
ranks out, `hybrid_groups` makes the two families of process groups. `comm_volume` counts, by
formula, what one rank sends per layer under each scheme. The attention functions built from
these are in `cp_attention`.

Chapter: book/parallelism/context-parallel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

SCHEMES = ("allgather_kv", "ring", "ulysses", "hybrid")


# ---------------------------------------------------------------------------------------------
# Heads over ranks
# ---------------------------------------------------------------------------------------------

def ulysses_kv_heads(heads: int, kv_heads: int, degree: int) -> int:
    """K/V heads that the all-to-all splits over `degree` ranks, after replication if needed.

    Query heads must split evenly: rank j attends with heads [j H/n, (j+1) H/n). With grouped-query
    attention those heads use kv heads [j Hkv/n, (j+1) Hkv/n): when Hkv divides by n, the kv heads
    split as they are. When n is a multiple of Hkv (Llama 3 8B: 8 kv heads, 16 or 32 ranks), each
    kv head is replicated n/Hkv times first, so every rank receives the one kv head its queries
    use: Ulysses then reaches H ranks instead of Hkv, for more K/V traffic.
    """
    if min(heads, kv_heads, degree) < 1:
        raise ValueError(f"heads, kv_heads and degree must be >= 1, got {heads}, {kv_heads}, "
                         f"{degree}")
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} kv heads")
    if heads % degree:
        raise ValueError(f"Ulysses over {degree} ranks needs the {heads} query heads divisible by "
                         f"{degree}: use a degree that divides {heads}, or the hybrid kind with "
                         "a smaller Ulysses degree and ring attention for the rest")
    if kv_heads % degree == 0:
        return kv_heads
    if degree % kv_heads == 0:
        return degree
    raise ValueError(f"{kv_heads} kv heads cannot be split over {degree} Ulysses ranks: the "
                     f"degree must divide {kv_heads} or be a multiple of it")


# ---------------------------------------------------------------------------------------------
# The all-to-all, with autograd
# ---------------------------------------------------------------------------------------------

class AllToAll(torch.autograd.Function):
    """Rank r sends chunk j of x (along dim 0) to rank j and receives rank j's chunk r as chunk j.

    With equal chunks this block permutation is its own transpose (block (r, j) goes to (j, r)),
    so the backward is the same all-to-all applied to the gradient.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_to_all(g, ctx.group), None


def _all_to_all(x, group):
    x = x.contiguous()  # gloo silently corrupts strided tensors
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """(B, H, T/n, d) on each of n ranks -> (B, H/n, T, d): this rank's head group, every token.

    The tokens come out in rank order (rank 0's, then rank 1's, ...), so their global positions
    are `torch.cat(positions)`, whatever the sharding scheme.
    """
    n = dist.get_world_size(group)
    if n == 1:
        return x
    B, H, t, d = x.shape
    if H % n:
        raise ValueError(f"{H} heads cannot be split over {n} ranks")
    chunks = x.reshape(B, n, H // n, t, d).transpose(0, 1)  # chunk j: head group j, for rank j
    got = AllToAll.apply(chunks, group)  # chunk j: my head group, rank j's tokens
    return got.permute(1, 2, 0, 3, 4).reshape(B, H // n, n * t, d)


def heads_to_seq(y: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The inverse of `seq_to_heads`: (B, H/n, T, d) -> (B, H, T/n, d), this rank's tokens."""
    n = dist.get_world_size(group)
    if n == 1:
        return y
    B, h, T, d = y.shape
    chunks = y.reshape(B, h, n, T // n, d).permute(2, 0, 1, 3, 4)  # chunk j: rank j's tokens
    got = AllToAll.apply(chunks, group)  # chunk j: head group j, my tokens
    return got.transpose(0, 1).reshape(B, n * h, T // n, d)


# ---------------------------------------------------------------------------------------------
# The Ulysses x ring grid (USP)
# ---------------------------------------------------------------------------------------------

def hybrid_grid(cp: int, ulysses_degree: int) -> list[list[int]]:
    """CP ranks on a (ring_degree, ulysses_degree) grid: rows are Ulysses groups, columns rings.

    Row i holds ranks i u .. i u + u - 1: consecutive ranks, so on real hardware the bandwidth-
    hungry all-to-all stays inside a node and the ring, which overlaps with compute, crosses
    nodes (USP's default layout).
    """
    if ulysses_degree < 1 or cp % ulysses_degree:
        raise ValueError(f"Ulysses degree {ulysses_degree} does not divide the {cp} CP ranks: "
                         f"pick a divisor of {cp} (the ring degree is {cp} / Ulysses degree)")
    u = ulysses_degree
    return [list(range(i * u, (i + 1) * u)) for i in range(cp // u)]


@dataclass(frozen=True)
class HybridGroups:
    """This rank's process groups on the grid: `ulysses` (its row), `ring` (its column), `cp`
    (all of them); `grid[i][j]` is the CP rank at ring position i and Ulysses position j."""

    grid: tuple[tuple[int, ...], ...]
    ulysses: dist.ProcessGroup
    ring: dist.ProcessGroup
    cp: dist.ProcessGroup

    @property
    def ulysses_degree(self) -> int:
        return len(self.grid[0])

    @property
    def ring_degree(self) -> int:
        return len(self.grid)


def hybrid_groups(ulysses_degree: int, group: dist.ProcessGroup | None = None) -> HybridGroups:
    """Make the grid's Ulysses groups and ring groups with `dist.new_group`.

    `new_group` is collective over all ranks: every rank creates every group, in the same order
    (all rows, then all columns), and keeps the two it belongs to. A rank that skipped a group it
    is not in would pair its next `new_group` with another rank's different one.
    """
    if not dist.is_initialized():
        raise ValueError("hybrid_groups needs a process group: run under torchrun or "
                         "trainbook.launch.run")
    group = group or dist.group.WORLD
    ranks = dist.get_process_group_ranks(group)
    if len(ranks) != dist.get_world_size():
        raise ValueError(f"the CP group has {len(ranks)} of {dist.get_world_size()} ranks; "
                         "hybrid_groups makes its groups over all ranks, so CP must span them")
    grid = hybrid_grid(len(ranks), ulysses_degree)
    me = dist.get_rank(group)
    mine = {}
    for family, lines in (("ulysses", grid), ("ring", [list(c) for c in zip(*grid)])):
        for line in lines:
            made = dist.new_group([ranks[r] for r in line])
            if me in line:
                mine[family] = made
    return HybridGroups(tuple(map(tuple, grid)), mine["ulysses"], mine["ring"], group)


# ---------------------------------------------------------------------------------------------
# Communication volume per rank and layer, forward pass
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CommVolume:
    """One rank's attention traffic in one layer's forward pass. `calls` and `bytes` by op, as
    `harness.CommCounter` counts them (the full tensor of each op: an all-gather's output, an
    all-to-all's input, each send's and each recv's message); `sent`: bytes this rank puts on the
    wire (what stays local, its own all-gather or all-to-all chunk, is not sent)."""

    scheme: str
    calls: dict[str, int]
    bytes: dict[str, int]
    sent: int


def comm_volume(scheme: str, seq_len: int, cp: int, heads: int, kv_heads: int, head_dim: int,
                bytes_per_value: int = 2, batch: int = 1,
                ulysses_degree: int = 2) -> CommVolume:
    """What one rank sends per layer forward under `scheme` (a kind's name works too).

    With t = seq_len / cp tokens per rank, a K (or V) shard is t Hkv d values and a q shard t H d.
    all-gather K/V and ring both send cp - 1 shards of K and V. Ulysses sends (cp - 1)/cp of each
    of its four all-to-all inputs (q, k, v, the output). The hybrid does Ulysses over u ranks,
    then a ring over cp/u ranks whose blocks, t u tokens of Hkv'/u heads, are as big as a shard.
    """
    name = scheme.removesuffix("_zigzag")
    if name not in SCHEMES:
        raise ValueError(f"scheme {scheme!r} is unknown; use one of {', '.join(SCHEMES)}")
    if cp < 1 or seq_len % cp:
        raise ValueError(f"sequence length {seq_len} does not split over {cp} ranks")
    u = {"allgather_kv": 1, "ring": 1, "ulysses": cp, "hybrid": ulysses_degree}[name]
    r = len(hybrid_grid(cp, u))
    kv = ulysses_kv_heads(heads, kv_heads, u)
    unit = seq_len // cp * head_dim * batch * bytes_per_value  # one head of a shard
    calls, sizes, sent = {}, {}, 0
    if name == "allgather_kv" and cp > 1:
        calls["all_gather"], sizes["all_gather"] = 2, 2 * cp * kv * unit
        sent = 2 * (cp - 1) * kv * unit
    if u > 1:
        calls["all_to_all"], sizes["all_to_all"] = 4, (2 * heads + 2 * kv) * unit
        sent += (u - 1) * sizes["all_to_all"] // u
    if name != "allgather_kv" and r > 1:
        for op in ("send", "recv"):
            calls[op], sizes[op] = r - 1, (r - 1) * 2 * kv * unit
        sent += sizes["send"]
    return CommVolume(name, calls, sizes, sent)
