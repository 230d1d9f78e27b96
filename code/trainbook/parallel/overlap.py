"""When communication hides: compute against communication per parallelism, and overlap read from
a profiler trace.

A collective hides behind compute only if independent compute runs meanwhile and lasts at least
as long: t_compute >= t_comm. Per transformer block, with F the table's dense peak of `dtype`
times an MFU, W the bus bandwidth (`Accelerator.busbw_gbps(op)` inside the scale-up domain,
`nic_gbps` per GPU across it), collective times from `collectives.collective_time` without
latency, P the block's parameters (a mixture of experts computes with its active ones) and e, r,
g, a the bytes of a parameter, a reduced gradient, a DP gradient and an activation:

- FSDP / ZeRO-3, `fsdp_min_tokens`: all-gather forward, all-gather backward and reduce-scatter
  move (2e + r) P (n-1)/n bytes per rank against 2P + 4P FLOPs per token; per phase, tokens per
  GPU per micro-batch b >= F/W (n-1)/n in bf16 (fp32 reduction: the backward binds, 1.5x).
- DP, `dp_min_tokens`, `dp_max_ranks`: the all-reduce of gP bytes (2(n-1)/n of them per rank)
  behind the backward's 4P: b >= F/W (n-1)/n g/2 in the micro-batch that syncs, so a global
  batch of B tokens hides on at most 1 + B / (F/W g/2) ranks.
- TP, `tp_ratio`, `tp_min_width`: 4 all-reduces of the (tokens, h) activation per block
  (Megatron; sequence parallelism: the same bytes as all-gathers and reduce-scatters) against
  6P/t: comm/compute = (4a/3)(t-1) h F / (P W), whatever the tokens; with P = c h^2 it is <= 1
  when h/(t-1) >= 4aF / (3cW).
- CP (ring attention), `cp_min_chunk`: a ring step sends one chunk's K and V (2 a n_kv d_h bytes
  per token) while the local queries attend to the chunk in hand (4 H d_h FLOPs per query-key
  pair, a fraction f = 1/2 of them under a load-balanced causal mask): c >= F/W (a/2)(n_kv/H)/f.
`seq_len` adds the causal attention core (`compute.flops`): thresholds fall. `fsdp_step` is the
exposed time per micro-batch; `profile_ddp_overlap` measures DDP's overlap on this machine.

Chapter: book/parallelism/overlap.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from numbers import Integral, Real

import torch
import torch.distributed as dist

from .. import configs, hardware
from ..bench.profile import quiet_profiler_lines
from ..compute import flops
from ..compute.roofline import bytes_per_element
from ..model import Transformer
from .collectives import collective_time

OVER = ("domain", "nic")
# Profiler event names the measurement depends on (torch 2.13, CPU, gloo); a rename fails loudly.
EVENTS = {
    "compute": "autograd::engine::evaluate_function: ",  # prefix: one autograd node's backward
    "accumulate": "autograd::engine::evaluate_function: torch::autograd::AccumulateGrad",
    "launch": "c10d::allreduce_",  # DDP's hook enqueues the bucket (autograd thread)
    "allreduce": "gloo:all_reduce",  # the collective running on a gloo worker thread
}


def _config(cfg: configs.ModelConfig) -> configs.ModelConfig:
    if not isinstance(cfg, configs.ModelConfig):
        raise ValueError(f"cfg must be a ModelConfig, got {type(cfg).__name__}; use "
                         "configs.resolve('llama-3-8b')")
    return cfg


def _ranks(name: str, n: int, accel: hardware.Accelerator, over: str) -> int:
    if isinstance(n, bool) or not isinstance(n, Integral) or n < 1:
        raise ValueError(f"{name} must be a whole number >= 1, got {n!r}")
    if over == "domain" and n > accel.domain:
        raise ValueError(f"{n} ranks do not fit in one {accel.name} scale-up domain of "
                         f"{accel.domain} GPUs; use over='nic' or fewer ranks")
    return int(n)


def achieved_flops(accel: hardware.Accelerator | str, mfu: float = 0.5,
                   dtype: str = "bf16") -> float:
    """F in FLOP/s: the table's dense peak times the fraction the matmuls reach (the MFU)."""
    if isinstance(mfu, bool) or not isinstance(mfu, Real) or not 0 < mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1] (0.5: half the dense peak), got {mfu!r}")
    return hardware.get(accel).peak_flops(dtype) * mfu


def bandwidth(accel: hardware.Accelerator | str, op: str, over: str = "domain") -> float:
    """W in bytes/s for collective `op`: the table's bus bandwidth inside the scale-up domain
    (NVLink), or the NIC per GPU across it, so every threshold reads the same figures."""
    accel = hardware.get(accel)
    if over not in OVER:
        raise ValueError(f"over must be 'domain' (NVLink, inside a node) or 'nic' (across "
                         f"nodes), got {over!r}")
    busbw = accel.busbw_gbps(op)  # validates op
    if over == "domain":
        return busbw * 1e9
    if not accel.nic_gbps:
        raise ValueError(f"{accel.name} has no NIC in the hardware table; use over='domain'")
    return accel.nic_gbps * 1e9


def block_params(cfg: configs.ModelConfig) -> tuple[float, float]:
    """(stored, active per token) parameters of one transformer block: what FSDP gathers and
    what a token multiplies through (they differ for a mixture of experts)."""
    c = configs.param_counts(_config(cfg))
    L = cfg.n_layers
    final_norm = c["norms"] / (2 * L + 1)
    stored = (c["attention"] + c["mlp"] + c["norms"] - final_norm) / L
    return stored, stored - (c["total"] - c["active"]) / L


def _block_flops(cfg: configs.ModelConfig, seq_len: int | None) -> tuple[float, float]:
    """(forward, backward) FLOPs per token of one block: 2P and 4P, plus the causal core."""
    _, active = block_params(cfg)
    core = 0.0
    if seq_len is not None:
        f = flops.forward_flops(cfg, seq_len, causal=True)
        core = (f["attn_scores"] + f["attn_values"]) / (cfg.n_layers * seq_len)
    fwd = 2 * active + core
    return fwd, 2 * fwd


def _fsdp_collectives(cfg, accel, n, over, dtype, reduce_dtype, alpha_s=0.0) -> tuple:
    """(all-gather, reduce-scatter) seconds of one block on n ranks."""
    n = _ranks("n", n, accel, over)
    stored, _ = block_params(cfg)
    return tuple(collective_time(op, n, stored * bytes_per_element(d), alpha_s,
                                 bandwidth(accel, op, over))
                 for op, d in (("all_gather", dtype), ("reduce_scatter", reduce_dtype)))


def fsdp_min_tokens(cfg: configs.ModelConfig, accel: hardware.Accelerator | str, n: int,
                    over: str = "domain", mfu: float = 0.5, dtype: str = "bf16",
                    reduce_dtype: str = "bf16", seq_len: int | None = None) -> float:
    """Tokens per GPU per micro-batch above which a block's FSDP all-gathers and reduce-scatter
    hide behind its forward and backward: below it, the link is what a step waits for."""
    accel = hardware.get(accel)
    ag, rs = _fsdp_collectives(cfg, accel, n, over, dtype, reduce_dtype)
    fwd, bwd = _block_flops(cfg, seq_len)
    return achieved_flops(accel, mfu, dtype) * max(ag / fwd, (ag + rs) / bwd)


def fsdp_step(cfg: configs.ModelConfig, accel: hardware.Accelerator | str, n: int,
              tokens_per_gpu: float, over: str = "domain", mfu: float = 0.5,
              dtype: str = "bf16", reduce_dtype: str = "bf16",
              alpha_s: float = 0.0) -> dict[str, float]:
    """Seconds of one micro-batch through all blocks under FSDP: compute, communication and the
    exposed part (per block and phase, what the collective outlasts its compute by)."""
    if isinstance(tokens_per_gpu, bool) or not isinstance(tokens_per_gpu, Real) \
            or tokens_per_gpu <= 0:
        raise ValueError(f"tokens_per_gpu must be positive, got {tokens_per_gpu!r}")
    accel = hardware.get(accel)
    ag, rs = _fsdp_collectives(cfg, accel, n, over, dtype, reduce_dtype, alpha_s)
    F = achieved_flops(accel, mfu, dtype)
    fwd, bwd = (f * tokens_per_gpu / F for f in _block_flops(cfg, None))
    L = cfg.n_layers
    return {"compute": L * (fwd + bwd), "comm": L * (2 * ag + rs),
            "exposed": L * (max(0.0, ag - fwd) + max(0.0, ag + rs - bwd))}


def dp_min_tokens(cfg: configs.ModelConfig, accel: hardware.Accelerator | str, n: int,
                  over: str = "domain", mfu: float = 0.5, dtype: str = "bf16",
                  grad_dtype: str = "bf16", seq_len: int | None = None) -> float:
    """Tokens per GPU in the micro-batch that carries DDP's all-reduce (the last one under
    no_sync) above which the gradient all-reduce hides behind that backward."""
    accel = hardware.get(accel)
    stored, _ = block_params(cfg)
    t = collective_time("all_reduce", _ranks("n", n, accel, over),
                        stored * bytes_per_element(grad_dtype), 0.0,
                        bandwidth(accel, "all_reduce", over))
    return achieved_flops(accel, mfu, dtype) * t / _block_flops(cfg, seq_len)[1]


def dp_max_ranks(cfg: configs.ModelConfig, accel: hardware.Accelerator | str,
                 global_batch_tokens: int, over: str = "nic", mfu: float = 0.5,
                 dtype: str = "bf16", grad_dtype: str = "bf16") -> int:
    """The most DP ranks whose all-reduce still hides when a global batch (capped near the
    critical batch size) is split over them, one micro-batch per step: n <= 1 + B / K."""
    if isinstance(global_batch_tokens, bool) or not isinstance(global_batch_tokens, Integral) \
            or global_batch_tokens < 1:
        raise ValueError(f"global_batch_tokens must be a whole number >= 1, got "
                         f"{global_batch_tokens!r}")
    k = 2 * dp_min_tokens(cfg, accel, 2, over, mfu, dtype, grad_dtype)  # K (n-1)/n at n = 2
    return int(1 + global_batch_tokens // k)


def tp_ratio(cfg: configs.ModelConfig, accel: hardware.Accelerator | str, t: int,
             over: str = "domain", mfu: float = 0.5, dtype: str = "bf16",
             sequence_parallel: bool = False, seq_len: int | None = None) -> float:
    """Communication over compute time of one block under Megatron TP of degree t; the tokens
    cancel, so only the shape (h, P) and the hardware decide whether TP can hide at all."""
    accel = hardware.get(accel)
    t = _ranks("t", t, accel, over)
    act = _config(cfg).d_model * bytes_per_element(dtype)  # bytes of one token's activation
    if sequence_parallel:  # the all-reduce's bytes as an all-gather plus a reduce-scatter
        comm = 4 * sum(collective_time(op, t, act, 0.0, bandwidth(accel, op, over))
                       for op in ("all_gather", "reduce_scatter"))
    else:
        comm = 4 * collective_time("all_reduce", t, act, 0.0,
                                   bandwidth(accel, "all_reduce", over))
    fwd, bwd = _block_flops(cfg, seq_len)
    return comm / ((fwd + bwd) / t / achieved_flops(accel, mfu, dtype))


def tp_min_width(cfg: configs.ModelConfig, accel: hardware.Accelerator | str,
                 over: str = "domain", mfu: float = 0.5, dtype: str = "bf16",
                 sequence_parallel: bool = False) -> float:
    """The smallest h/(t-1) at which TP's communication fits inside its compute (ratio <= 1):
    the width each extra rank needs."""
    return tp_ratio(cfg, accel, 2, over, mfu, dtype, sequence_parallel) * cfg.d_model


def cp_min_chunk(cfg: configs.ModelConfig, accel: hardware.Accelerator | str,
                 over: str = "domain", mfu: float = 0.5, dtype: str = "bf16",
                 causal: bool = True) -> float:
    """Tokens per CP rank above which ring attention's K/V exchange hides behind the attention of
    the chunk in hand (forward; the backward sends K, V and their gradients, twice the bytes,
    against more than twice the work)."""
    cfg = _config(cfg)
    a = bytes_per_element(dtype)
    # a point-to-point send to the next rank: K and V of one token, at the link's bandwidth
    per_token = 2 * cfg.n_kv_heads * cfg.head_dim * a / bandwidth(accel, "send", over)
    work = 4 * cfg.n_heads * cfg.head_dim * (0.5 if causal else 1.0)  # FLOPs per query per key
    return achieved_flops(accel, mfu, dtype) * per_token / work


def _merge(intervals: Iterable[tuple[float, float]]) -> list[list[float]]:
    """The union of intervals as disjoint sorted [start, end] pairs."""
    out: list[list[float]] = []
    for s, e in sorted(map(tuple, intervals)):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def _length(intervals: Iterable[tuple[float, float]]) -> float:
    return sum(e - s for s, e in _merge(intervals))


def trace_overlap(events: Iterable[tuple[str, float, float]]) -> dict:
    """How much all-reduce time runs while the backward computes, from (name, start s, end s)
    events: compute is every `EVENTS["compute"]` event but AccumulateGrad (which only adds to
    .grad and runs DDP's hook), communication every `EVENTS["allreduce"]`. Times in the result
    are seconds from the start of the backward's compute."""
    events = list(events)
    found = {k: sum(name.startswith(v) for name, _, _ in events) for k, v in EVENTS.items()}
    missing = [EVENTS[k] for k in ("compute", "allreduce") if not found[k]]
    if missing:
        raise ValueError(f"the trace has no {missing[0]!r} event: a torch version that renames "
                         "it needs trainbook.parallel.overlap.EVENTS updated")
    compute = _merge((s, e) for name, s, e in events if name.startswith(EVENTS["compute"])
                     and not name.startswith(EVENTS["accumulate"]))
    comm = sorted((s, e) for name, s, e in events if name == EVENTS["allreduce"])
    t0, end = compute[0][0], compute[-1][1]
    busy = _length(comm)
    hidden = busy + _length(compute) - _length(comm + compute)  # |A n B| = |A| + |B| - |A u B|
    return {"allreduces": len(comm), "allreduce_s": busy, "overlap_s": hidden,
            "exposed_s": busy - hidden, "fraction": hidden / busy if busy > 0 else 0.0,
            "backward_s": _length(compute), "backward_span_s": end - t0,
            "started_before_end": sum(s < end for s, _ in comm),
            "first_start_s": comm[0][0] - t0, "last_end_s": max(e for _, e in comm) - t0,
            "found": found, "compute": [(s - t0, e - t0) for s, e in compute],
            "comm": [(s - t0, e - t0) for s, e in comm]}


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor) -> None:
    model(tokens[:, :-1], tokens[:, 1:])[1].backward()
    opt.step()
    opt.zero_grad()


def profile_ddp_overlap(cfg: configs.ModelConfig, bucket_caps_mb: dict[str, float],
                        seq_len: int = 64, batch: int = 4, warmup: int = 2,
                        seed: int = 0) -> dict[str, dict]:
    """One DDP (gloo) training step per bucket size, profiled on this rank, read by
    `trace_overlap`: the measurement behind the overlap the thresholds assume. Run it on every
    rank of a process group (`launch.run`)."""
    from torch.nn.parallel import DistributedDataParallel
    from torch.profiler import ProfilerActivity, profile

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("profile_ddp_overlap runs inside a process group: use "
                         "trainbook.launch.run(profile_ddp_overlap, 2, args=...)")
    if not isinstance(bucket_caps_mb, dict) or not bucket_caps_mb or \
            not all(isinstance(v, Real) and v > 0 for v in bucket_caps_mb.values()):
        raise ValueError(f"bucket_caps_mb must be a non-empty dict of name -> MiB > 0, got "
                         f"{bucket_caps_mb!r}")
    if not isinstance(warmup, int) or warmup < 1:
        raise ValueError(f"warmup must be a whole number >= 1 (DDP rebuilds its buckets after "
                         f"the first step), got {warmup!r}")
    cfg = _config(cfg)
    configs.check_seq_len(cfg, seq_len)
    g = torch.Generator().manual_seed(seed + 1 + dist.get_rank())
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), generator=g)
    out = {}
    for name, cap in bucket_caps_mb.items():
        torch.manual_seed(seed)
        model = DistributedDataParallel(Transformer(cfg), bucket_cap_mb=cap)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)

        for _ in range(warmup):
            t0 = time.perf_counter()
            _step(model, opt, tokens)
            step_s = time.perf_counter() - t0
        dist.barrier()
        prof = profile(activities=[ProfilerActivity.CPU])
        with quiet_profiler_lines():
            prof.start()
        _step(model, opt, tokens)
        with quiet_profiler_lines():
            prof.stop()
        events = [(e.name, e.time_range.start / 1e6, e.time_range.end / 1e6)
                  for e in prof.events()]
        grad_mib = 4 * sum(p.numel() for p in model.parameters()) / 2**20
        out[name] = {**trace_overlap(events), "bucket_cap_mb": cap, "grad_mib": grad_mib,
                     "step_s": step_s}
    return out
