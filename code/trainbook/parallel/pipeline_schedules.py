"""Pipeline schedules as data: the order each stage runs, the bubble they leave, what they store.

`schedule_order` is the from-scratch GPipe and 1F1B (PipeDream-Flush) order of F and B on one
stage; `native_schedule` builds PyTorch's (`torch.distributed.pipelining`: GPipe, 1F1B,
interleaved 1F1B, zero bubble V) and `planned` reads its plan. The bubble arithmetic is
Narayanan et al. 2021 (SC21), Section 2.2; `idle_fraction` measures it on recorded timelines;
`stage_activation_bytes` is what one stage stores with a number of micro-batches in flight.

Chapter: book/parallelism/pipeline-parallel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..model import lm_loss

if TYPE_CHECKING:
    from torch.distributed.pipelining.schedules import (
        PipelineScheduleMulti,
        PipelineScheduleSingle,
    )

    from ..configs import ModelConfig

SCRATCH = ("gpipe", "1f1b")
NATIVE = ("native-gpipe", "native-1f1b", "native-interleaved", "native-zero-bubble")
KINDS = SCRATCH + NATIVE


def schedule_order(kind: str, p: int, m: int, stage: int) -> list[tuple[str, int]]:
    """The (op, micro-batch) order one stage runs: ("F", i) or ("B", i)."""
    if kind == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    if kind != "1f1b":
        raise ValueError(f"from-scratch schedule must be one of {SCRATCH}, got {kind!r}")
    warmup = min(p - 1 - stage, m)
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):  # steady state: one forward, then the oldest backward
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", i) for i in range(m - warmup, m)]


def native_stage_indices(kind: str, p: int, rank: int) -> tuple[int, list[int]]:
    """(number of stages, the stage indices this rank holds) for a native schedule."""
    if kind in ("native-gpipe", "native-1f1b"):
        return p, [rank]
    if kind == "native-interleaved":  # loop: rank r holds r, r + p
        return 2 * p, [rank, rank + p]
    if kind == "native-zero-bubble":  # V shape (ZBV): rank r holds r and 2p - 1 - r
        return 2 * p, [rank, 2 * p - 1 - rank]
    raise ValueError(f"native schedule must be one of {NATIVE}, got {kind!r}")


def native_schedule(kind: str, stages: list,
                    m: int) -> PipelineScheduleSingle | PipelineScheduleMulti:
    """The torch.distributed.pipelining schedule object for `kind` over this rank's stages."""
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleZBVZeroBubble,
    )
    if kind == "native-gpipe":
        return ScheduleGPipe(stages[0], m, loss_fn=lm_loss)
    if kind == "native-1f1b":
        return Schedule1F1B(stages[0], m, loss_fn=lm_loss)
    if kind == "native-interleaved":
        return ScheduleInterleaved1F1B(stages, m, loss_fn=lm_loss)
    return ScheduleZBVZeroBubble(stages, m, loss_fn=lm_loss)


def planned(sched: PipelineScheduleSingle | PipelineScheduleMulti) -> dict[int, list[str | None]]:
    """A native schedule's planned compute actions per rank ("0F1": stage 0, forward,
    micro-batch 1; "I"/"W": the input and weight halves of a split backward; None: an idle
    slot). This is the plan every rank computes, not a measurement."""
    order = sched.pipeline_order or {}
    return {r: [None if a is None else str(a) for a in acts if a is None or a.is_compute_op]
            for r, acts in order.items()}


def check_microbatches(kind: str, p: int, m: int) -> None:
    if m < 1:
        raise ValueError(f"microbatches must be >= 1, got {m}")
    if kind == "1f1b" and m < p:
        raise ValueError(f"1F1B with {p} stages needs at least {p} micro-batches to reach its "
                         f"steady state, got {m}; raise microbatches")
    if kind in ("native-interleaved", "native-zero-bubble") and m < p:
        raise ValueError(f"{kind} needs microbatches >= {p} stages per round, got {m}")


def bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """Idle fraction of a step for GPipe/1F1B with p stages and m micro-batches, equal stage
    times: (p - 1) / (v m + p - 1); with v interleaved chunks per rank the bubble shrinks v-fold
    relative to compute (Narayanan et al. 2021, SC21, "Efficient Large-Scale Language Model
    Training on GPU Clusters Using Megatron-LM", Section 2.2)."""
    for name, val in (("p", p), ("m", m), ("v", v)):
        if not isinstance(val, int) or val < 1:
            raise ValueError(f"{name} must be a positive integer, got {val!r}")
    return (p - 1) / (v * m + p - 1)


def bubble_over_compute(p: int, m: int, v: int = 1) -> float:
    """The bubble relative to the ideal compute time: (p - 1) / (v m)."""
    bubble_fraction(p, m, v)
    return (p - 1) / (v * m)


def idle_fraction(events: list[list[dict]]) -> float:
    """Measured idle share: 1 - busy / (ranks x span), span from the first start to the last end."""
    rows = [r for per_rank in events for r in per_rank]
    if not rows:
        raise ValueError("no events recorded")
    span = max(r["end"] for r in rows) - min(r["start"] for r in rows)
    busy = sum(r["end"] - r["start"] for r in rows)
    return 1 - busy / (len(events) * span)


def stage_activation_bytes(cfg: ModelConfig, stage: int, p: int, in_flight: int, micro_batch: int,
                           seq_len: int, dtype: str = "fp32") -> float:
    """Stored activations of one stage: in-flight micro-batches x its layers' bytes
    (`compute.memory.reference_layer_bytes`), plus the last stage's final-norm and logits."""
    from ..compute import memory

    if cfg.n_layers % p:
        raise ValueError(f"{cfg.n_layers} layers do not split into {p} stages")
    per_mb = cfg.n_layers // p * memory.reference_layer_bytes(cfg, micro_batch, seq_len, dtype)
    if stage == p - 1:  # final norm (3 tensors) and the fp32 log-softmax the loss keeps
        per_mb += micro_batch * seq_len * (3 * cfg.d_model + cfg.vocab_size) * 4
    return in_flight * per_mb
