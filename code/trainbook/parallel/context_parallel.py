"""Context parallelism from scratch: split every sequence across ranks, attend across the split.

Every token-wise layer (embeddings, norms, MLPs, the head) is local to a token, so a rank that
holds a slice of each sequence computes them alone. Attention is the exception: a query needs
the keys and values of every earlier position. Two ways to get them:

- all-gather K/V (Llama 3, Section 3.3.2): gather the whole sequence's keys and values, attend
  locally with the causal mask shifted to this rank's query positions. Simple; each rank holds
  the full K/V of a layer while it attends.
- ring attention (Liu et al. 2023): pass K/V blocks around a ring of ranks; each rank attends to
  the block it holds while the next one is in flight, and combines the partial results with the
  online softmax (Milakov and Gimelshein 2018; Dao et al. 2022). Only two blocks are in memory
  at a time in the forward pass.

The causal mask makes the work lopsided: with contiguous shards the last rank attends to the
whole sequence and the first to its own slice. Zig-zag sharding (rank r holds chunks r and
2n-1-r of 2n) gives every rank the same work.

`run_cp` trains the harness's reference model with each rank holding a sequence shard of every
sequence and checks it against `harness.reference`. Ring attention here is differentiable
through autograd (the ring shift's backward is the reverse shift), which is exact but keeps
every received block for backward; the memory-saving ring backward, which passes dK/dV around
the ring again, is not implemented.

Chapter: book/parallelism/context-parallel.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..compute import memory
from ..model import lm_loss
from . import harness

SCHEMES = ("contiguous", "zigzag")


# ---------------------------------------------------------------------------------------------
# The online softmax: attention over key/value blocks, one block at a time
# ---------------------------------------------------------------------------------------------

def online_softmax_update(state, q, k, v, mask=None):
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


def online_softmax_finish(state):
    """Attention output acc / l and the log-sum-exp m + log(l) of each query's scores."""
    acc, m, l = state
    if bool((l == 0).any()):
        raise ValueError("a query attended to no key at all (every block masked it out); "
                         "with a causal mask every query must at least see itself")
    return acc / l, m + torch.log(l)


def attention(q, k, v, q_pos=None, k_pos=None):
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

def _group_info():
    if not dist.is_initialized():
        raise ValueError("context-parallel attention needs a process group: run under torchrun "
                         "or trainbook.launch.run")
    return dist.get_rank(), dist.get_world_size()


def _repeat_kv(x, n_heads):
    """Grouped-query attention: each key/value head serves n_heads // kv_heads query heads."""
    return x if x.shape[1] == n_heads else x.repeat_interleave(n_heads // x.shape[1], dim=1)


def allgather_kv_attention(q, k, v, positions: list[torch.Tensor], counter: dict | None = None):
    """Attention of this rank's queries over the whole sequence's keys and values.

    q: (B, H, T/n, d), k and v: (B, Hkv, T/n, d) for this rank's tokens; positions[r] are the
    global positions rank r holds. K and V are all-gathered with the autograd-aware functional
    collective, whose backward is a reduce-scatter: the gradient of a key sums over the queries
    of every rank. The causal mask compares global positions, so any sharding works.
    """
    rank, world = _group_info()
    group = dist.group.WORLD
    k_all = _all_gather_seq(k, group)
    v_all = _all_gather_seq(v, group)
    mask = causal_mask(positions[rank], torch.cat(positions))
    if counter is not None:
        counter["pairs"] = counter.get("pairs", 0) + int(mask.sum())
    return F.scaled_dot_product_attention(q, _repeat_kv(k_all, q.shape[1]),
                                          _repeat_kv(v_all, q.shape[1]), attn_mask=mask)


def _all_gather_seq(x, group):
    """Autograd-aware all-gather along the sequence (dim 2). `all_gather_single_autograd` is
    torch 2.13's name for `all_gather_tensor_autograd`; its backward is a reduce-scatter. The
    input is made contiguous: gloo silently corrupts strided tensors."""
    from torch.distributed._functional_collectives import all_gather_single_autograd, wait_tensor

    return wait_tensor(all_gather_single_autograd(x.contiguous(), gather_dim=2, group=group))


class RingShift(torch.autograd.Function):
    """Send x to rank r+1 and receive rank r-1's block; backward sends the gradient back the
    other way (r -> r-1), which is exactly the transpose of the forward permutation."""

    @staticmethod
    def forward(ctx, x):
        return _shift(x, +1)

    @staticmethod
    def backward(ctx, g):
        return _shift(g, -1)


def _shift(x, direction: int):
    rank, world = dist.get_rank(), dist.get_world_size()
    x = x.contiguous()
    out = torch.empty_like(x)
    send = dist.isend(x, (rank + direction) % world)
    dist.recv(out, (rank - direction) % world)
    send.wait()
    return out


def ring_attention(q, k, v, positions: list[torch.Tensor], counter: dict | None = None):
    """Attention over the whole sequence with K/V blocks passed around the ring of ranks.

    Step t (0..n-1): this rank holds the K/V block of rank (r - t) mod n, folds it into the
    online softmax (skipping blocks the causal mask hides entirely), and shifts it on. K and V
    travel stacked, one message per step. A skipped block still joins the output with weight 0:
    its shift's backward (a send/recv pair) must run on every rank, or the ring deadlocks.
    Here each shift completes before the block is computed, which keeps autograd simple;
    production kernels post the receive, compute the block, then wait, so the transfer overlaps.
    """
    rank, world = _group_info()
    kv = torch.stack([k, v])
    state, unused = None, 0.0
    for t in range(world):
        src = (rank - t) % world
        nxt = RingShift.apply(kv) if t < world - 1 else None  # the next step's block
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


def _check_kind(kind: str):
    if kind not in ATTENTION:
        raise ValueError(f"kind {kind!r} is unknown; use one of {', '.join(ATTENTION)}")
    return ATTENTION[kind]


def check_attention(kind: str, batch: int = 2, heads: int = 4, kv_heads: int = 2, seq_len: int = 32,
                    head_dim: int = 8, seed: int = 0) -> dict:
    """One rank's largest |difference| from full causal attention: output and dq, dk, dv.

    Every rank builds the same full q, k, v and upstream gradient, computes the single-process
    answer, then runs the context-parallel attention on its shard and compares its slice.
    """
    fn, scheme = _check_kind(kind)
    rank, world = _group_info()
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
    out = fn(ql, kl, vl, positions, counter)
    (out * up[:, :, mine]).sum().backward()
    diff = lambda a, b: (a - b).abs().max().item()  # noqa: E731
    return {"rank": rank, "kind": kind, "out": diff(out, ref.detach()[:, :, mine]),
            "dq": diff(ql.grad, q.grad[:, :, mine]), "dk": diff(kl.grad, k.grad[:, :, mine]),
            "dv": diff(vl.grad, v.grad[:, :, mine]), "pairs": counter["pairs"]}


# ---------------------------------------------------------------------------------------------
# The reference model, context parallel
# ---------------------------------------------------------------------------------------------

def cp_forward(model, idx, positions: list[torch.Tensor], attend, counter: dict | None = None):
    """The reference Transformer's forward on this rank's tokens `idx` (B, T/n) -> logits.

    Same modules and weights as `model.forward`; what changes: learned positions and RoPE use
    the tokens' global positions, and each block's attention core is the context-parallel
    `attend` (its q, k, v projections, RoPE and output projection are the reference's own).
    """
    try:
        for block in model.layers():  # an instance attribute shadows Attention.core
            block.attn.core = lambda q, k, v: attend(q, k, v, positions, counter)
        return model(idx, positions=positions[dist.get_rank()])[0]  # via __call__: hooks run
    finally:
        for block in model.layers():
            block.attn.__dict__.pop("core", None)


def cp_loss(model, x, y, positions, attend, counter=None):
    """(loss to backpropagate, global mean loss): this rank's summed cross-entropy divided by
    the token count of all ranks, so the per-rank gradients add up to the full-batch gradient."""
    logits = cp_forward(model, x, positions, attend, counter)
    local = lm_loss(logits, y, reduction="sum")
    stats = torch.stack([local.detach(), torch.tensor(float(y.numel()))])
    dist.all_reduce(stats)
    return local / stats[1], (stats[0] / stats[1]).item()


def sync_gradients(model) -> None:
    """Sum the gradients over the CP ranks: they are data-parallel over the sequence's tokens."""
    params = [p for p in model.parameters() if p.grad is not None]
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat)
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
        offset += p.numel()


def run_cp(setup: harness.Setup, kind: str = "allgather_kv", measure_memory: bool = False) -> dict:
    """Train the reference model with every sequence split across the ranks (call via launch.run).

    Returns this rank's trace (reference parameter names; the model is replicated, so its
    gradients and parameters are already full tensors), the query-key pairs its attention
    computed per layer (per sequence and head: the causal-mask entries it evaluated), the median
    seconds per step, and with measure_memory its peak tensor memory (one AdamW step,
    `memory_measure.tracked_peak`) next to the estimator.
    """
    fn, scheme = _check_kind(kind)
    rank, world = _group_info()
    positions = [shard_positions(setup.seq_len, world, r, scheme) for r in range(world)]
    model = harness.build_model(setup)
    opt = harness.make_optimizer(setup, model.parameters())
    losses, first, times, counter = [], {}, [], {}
    for step, (x, y) in enumerate(harness.global_batches(setup)):
        t0 = time.perf_counter()
        mine = positions[rank]
        loss, mean = cp_loss(model, x[:, mine], y[:, mine], positions, fn,
                             counter if step == 0 else None)
        loss.backward()
        sync_gradients(model)
        if step == 0:
            first = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(mean)
    trace = harness.Trace(losses, first,
                          {n: p.detach().clone() for n, p in model.named_parameters()})
    out = {"rank": rank, "kind": kind, "trace": trace,
           "pairs_per_layer": counter["pairs"] // setup.n_layers,
           "step_seconds": sorted(times)[len(times) // 2]}
    if measure_memory:
        out["memory"] = measure_rank_memory(setup, kind)
    return out


def measure_rank_memory(setup: harness.Setup, kind: str = "allgather_kv") -> dict:
    """This rank's peak tensor bytes in one CP training step (AdamW, as the estimator assumes),
    and `compute.memory.estimate` for the same shape with cp = world size."""
    from ..bench.memory_measure import tracked_peak

    fn, scheme = _check_kind(kind)
    rank, world = _group_info()
    positions = [shard_positions(setup.seq_len, world, r, scheme) for r in range(world)]
    x, y = harness.global_batches(setup)[0]
    model = harness.build_model(setup)
    opt = torch.optim.AdamW(model.parameters(), lr=setup.lr, foreach=False)

    def step(model, optimizer, x, y):
        loss, _ = cp_loss(model, x, y, positions, fn)
        loss.backward()
        sync_gradients(model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    measured = tracked_peak(model, opt, x[:, positions[rank]], y[:, positions[rank]], step=step)
    est = memory.estimate(memory.MemoryInputs(
        model=setup.model_config(), dtype="fp32", optimizer="adamw", cp=world,
        micro_batch=setup.global_batch, seq_len=setup.seq_len))
    return {"measured": measured, "estimate": est.as_dict(),
            "error": est.peak / measured["peak"] - 1}


def sweep(setup: harness.Setup, variants: list[dict]) -> list[dict]:
    """One call per variant in one process group. A variant is run_cp's keyword arguments, or
    {"check": kind, ...} for check_attention's, or {"official": True} for the official API probe."""
    out = []
    for v in variants:
        v = dict(v)
        if "check" in v:
            out.append(check_attention(v.pop("check"), **v))
        elif v.pop("official", False):
            out.append(official_api_on_cpu(**v))
        else:
            out.append(run_cp(setup, **v))
    return out


# ---------------------------------------------------------------------------------------------
# The official API on CPU
# ---------------------------------------------------------------------------------------------

def official_api_on_cpu(seq_len: int = 32, backward: bool = True) -> dict:
    """Try `torch.distributed.tensor.experimental.context_parallel` on this (CPU) process group,
    once per SDPA backend; return what happened (the real error message, or success)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rank, world = _group_info()
    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.MATH):
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 2, seq_len, 8, generator=g) for _ in range(3))
        try:
            with sdpa_kernel(backend), context_parallel(mesh, buffers=[q, k, v],
                                                        buffer_seq_dims=[2, 2, 2]):
                qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
                out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
                if backward:
                    out.sum().backward()
            results[backend.name] = "works"
        except Exception as e:  # the point: show the real error
            msg = str(e).strip().splitlines()
            results[backend.name] = f"{type(e).__name__}: {msg[0] if msg else ''}"[:300]
    return {"rank": rank, "torch": torch.__version__, **results}
