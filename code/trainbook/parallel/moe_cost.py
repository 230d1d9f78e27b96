"""What a mixture-of-experts layer costs at scale beyond its FLOPs: the nodes a token's
dispatch crosses, the bytes on the network, the token permutation around the expert GEMMs,
and the step time lost to the most loaded rank.

Chapter: book/parallelism/expert-parallel ("Routing at scale").
"""

from __future__ import annotations

from math import comb

from .. import hardware


def expected_nodes(n_experts: int, top_k: int, nodes: int, node_limit: int | None = None) -> float:
    """Expected distinct nodes a token's k experts live on, routing uniformly at random over the
    experts (E/nodes per node); with `node_limit` M, over the experts of M nodes only:
    M (1 - C(E_M - E/nodes, k) / C(E_M, k)), E_M = M E / nodes (one minus the chance that a
    given node gets none of the k, times the nodes)."""
    if nodes < 1 or n_experts % nodes:
        raise ValueError(f"{n_experts} experts do not split over {nodes} nodes")
    m = nodes if node_limit is None else node_limit
    if not 1 <= m <= nodes:
        raise ValueError(f"node_limit must be in [1, nodes={nodes}], got {node_limit}")
    pool, per_node = m * n_experts // nodes, n_experts // nodes
    if not 1 <= top_k <= pool:
        raise ValueError(f"top_k {top_k} must be in [1, {pool}] (the experts it may use)")
    return m * (1 - comb(pool - per_node, top_k) / comb(pool, top_k))


def dispatch_bytes(tokens: int, d_model: int, remote_nodes: float, top_k: int,
                   dtype_bytes: float = 2, dedup_per_node: bool = True) -> float:
    """Bytes one rank sends across nodes for one dispatch of `tokens` tokens: each token once
    per remote node it needs (DeepSeek-V3 sends it once over InfiniBand and forwards it inside
    the node over NVLink) or once per remote expert (plain all-to-all: k copies, of which the
    share on other nodes is `remote_nodes` out of the nodes in use; an upper bound)."""
    if tokens < 0 or d_model < 1 or remote_nodes < 0 or top_k < 1:
        raise ValueError("tokens, remote_nodes >= 0 and d_model, top_k >= 1 required")
    copies = remote_nodes if dedup_per_node else top_k
    return tokens * copies * d_model * dtype_bytes


def permutation_share(d_model: int, d_ff: int, gpu: str = "h100-sxm", dtype_bytes: float = 2,
                      dtype: str = "bf16") -> float:
    """Time to permute tokens into expert order and back, unfused, over the time of the expert
    GEMMs they feed, forward: each assignment's row (d values) is read and written once to
    sort and once to unsort (4 d b bytes), against 3 SwiGLU matmuls (6 d d_ff FLOPs) at the
    dense peak; d_ff is the expert's width, so fine-grained experts (small d_ff) pay more."""
    if d_model < 1 or d_ff < 1 or dtype_bytes <= 0:
        raise ValueError(f"need d_model, d_ff >= 1 and dtype_bytes > 0, got {d_model}, {d_ff}, "
                         f"{dtype_bytes}")
    acc = hardware.get(gpu)
    move_s = 4 * d_model * dtype_bytes / (acc.hbm_gbps * 1e9)
    gemm_s = 6 * d_model * d_ff / acc.peak_flops(dtype)
    return move_s / gemm_s


def imbalance_slowdown(counts_per_rank: list[float]) -> float:
    """Expert compute time of the step over what balanced routing would take: every rank waits
    for the most loaded one at the combine all-to-all, so the step runs at max / mean."""
    if not counts_per_rank or min(counts_per_rank) < 0 or sum(counts_per_rank) == 0:
        raise ValueError("give the non-negative token counts per rank (not all zero)")
    return max(counts_per_rank) / (sum(counts_per_rank) / len(counts_per_rank))
