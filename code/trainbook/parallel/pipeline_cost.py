"""Pipeline schedules at scale, in closed form: the bubble each schedule leaves, the activations
and parameters it holds, the point-to-point bytes it sends, and what data parallelism can hide
behind it.

The times are per micro-batch on one stage: F the forward, I the backward for the input
(what the previous stage waits for), W the backward for the weights (what only the optimizer
needs); the full backward is B = I + W. Memory is in units of M_B, one micro-batch's stored
activations on one stage. The formulas are the published ones:

- 1F1B: bubble (p - 1)(F + B) (Narayanan et al. 2021, SC21, Section 2.2), p M_B;
- interleaved 1F1B with v chunks per rank: the bubble divided by v (the same paper), more
  activations in flight than 1F1B (`memory`);
- ZB-H1: (p - 1)(F + I - W), p M_B; ZB-H2: (p - 1)(F + I - 2W), (2p - 1) M_B (Qi et al.
  2023, Zero Bubble Pipeline Parallelism, Table 2, with their T_B = our I);
- DualPipe: (p/2 - 1)(F&B + B - 3W), parameters twice, (p + 1) M_B (DeepSeek-V3 technical
  report, Table 2; deepseek-ai/DualPipe README), F&B being a forward and a backward chunk
  run overlapped (at most F + B, less when their communication and compute overlap).

Chapter: book/parallelism/pipeline-parallel ("Schedules, quantitatively").
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import configs, hardware
from ..compute import flops

SCHEDULES = ("1f1b", "interleaved", "zb-h1", "zb-h2", "dualpipe")


@dataclass(frozen=True)
class StageTimes:
    """One micro-batch on one stage, in any unit of time: forward, input-gradient backward,
    weight-gradient backward, and a forward and a backward run overlapped (DualPipe)."""

    F: float
    I: float  # noqa: E741 (the papers' name)
    W: float
    FB: float | None = None  # overlapped F&B; None: no overlap gain, F + B

    def __post_init__(self):
        for name in ("F", "I", "W"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"stage time {name} must be >= 0, got {value!r}")
        if self.FB is not None and not 0 <= self.FB <= self.F + self.B:
            raise ValueError(f"the overlapped F&B must lie in [0, F + B = {self.F + self.B}], "
                             f"got {self.FB!r}")

    @property
    def B(self) -> float:
        return self.I + self.W

    @classmethod
    def from_ratio(cls, forward: float = 1.0, backward_over_forward: float = 2.0,
                   weight_share: float = 0.5) -> StageTimes:
        """Times from F, the ratio B/F (2 for matmul-dominated layers: the input and the weight
        gradient each cost one forward) and the weight gradient's share of B."""
        if not 0 <= weight_share <= 1:
            raise ValueError(f"weight_share must be in [0, 1], got {weight_share}")
        backward = forward * backward_over_forward
        return cls(forward, backward * (1 - weight_share), backward * weight_share)


def _check(schedule: str, p: int, m: int, v: int) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    for name, val in (("p", p), ("m", m), ("v", v)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"{name} must be a positive integer, got {val!r}")
    if schedule == "dualpipe" and p % 2:
        raise ValueError(f"DualPipe runs an even number of stages (two directions), got p={p}")
    if schedule != "interleaved" and v != 1:
        raise ValueError(f"v (chunks per rank) applies to the interleaved schedule, not {schedule}")


def bubble(schedule: str, p: int, t: StageTimes, v: int = 1) -> float:
    """Idle time per rank and step (same unit as `t`), as the papers give it."""
    _check(schedule, p, 1, v)
    F, I, W, B = t.F, t.I, t.W, t.B
    if schedule in ("1f1b", "interleaved"):
        return (p - 1) * (F + B) / v
    if schedule == "zb-h1":
        return (p - 1) * (F + I - W)
    if schedule == "zb-h2":
        return max(0.0, (p - 1) * (F + I - 2 * W))
    fb = F + B if t.FB is None else t.FB
    return max(0.0, (p / 2 - 1) * (fb + B - 3 * W))


def memory(schedule: str, p: int, v: int = 1) -> dict:
    """Peak stored activations (in M_B) and parameters (times one stage's) on the first rank,
    which holds the most. Interleaved: PyTorch's Interleaved1F1B warms up (v - 1) p + 2 (p - 1)
    chunk forwards on rank 0 (`schedules._get_warmup_ops`), each 1/v of a stage, plus the one
    in progress."""
    _check(schedule, p, 1, v)
    if schedule == "interleaved":
        acts = ((v - 1) * p + 2 * (p - 1) + 1) / v if v > 1 else p
    else:
        acts = {"zb-h2": 2 * p - 1, "dualpipe": p + 1}.get(schedule, p)
    return {"activations_MB": acts, "parameters": 2 if schedule == "dualpipe" else 1}


def step(schedule: str, p: int, m: int, t: StageTimes, v: int = 1) -> dict:
    """Compute, bubble and the bubble's share of the step for m micro-batches per step."""
    _check(schedule, p, m, v)
    compute = m * (t.F + t.B)
    idle = bubble(schedule, p, t, v)
    return {"compute": compute, "bubble": idle, "bubble_fraction": idle / (compute + idle),
            **memory(schedule, p, v)}


def p2p(model: str, micro_batch: int, seq_len: int, m: int, p: int, v: int = 1,
        tp: int = 1, dtype_bytes: int = 2, gpu: str = "h100-sxm", mfu: float = 0.4) -> dict:
    """What one stage boundary carries per step against the compute it sits between.

    Each micro-batch sends its hidden states (b s h values) forward and their gradient back,
    through every one of the p v - 1 chunk boundaries (with tensor parallelism each of the t
    ranks of a stage sends its 1/t share, sequence-parallel). The time is at the GPU's NIC
    bandwidth (`hardware`), the compute time of one micro-batch's forward on one stage at
    `mfu` of the bf16 dense peak."""
    if micro_batch < 1 or seq_len < 1 or m < 1 or p < 2 or v < 1 or tp < 1:
        raise ValueError("need micro_batch, seq_len, m, v, tp >= 1 and p >= 2 stages, got "
                         f"{micro_batch}, {seq_len}, {m}, {v}, {tp}, {p}")
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1], got {mfu}")
    cfg, acc = configs.get(model), hardware.get(gpu)
    if acc.nic_gbps is None:
        raise ValueError(f"{gpu} has no scale-out NIC bandwidth in the hardware table; "
                         "pick a GPU that lists one (python -m trainbook hardware)")
    message = micro_batch * seq_len * cfg.d_model * dtype_bytes / tp  # bytes, one direction
    per_step = 2 * m * v * message  # forward and backward, per boundary crossed per chunk
    fwd_flops = flops.training_flops_per_token(cfg, seq_len) / 3 * micro_batch * seq_len
    forward_s = fwd_flops / (p * tp) / (acc.peak_flops("bf16") * mfu)
    send_s = message / (acc.nic_gbps * 1e9)
    return {"message_bytes": message, "bytes_per_step": per_step, "send_s": send_s,
            "forward_s": forward_s, "send_over_forward": send_s / (forward_s / v)}


def dp_exposed(dp_comm_s: float, t: StageTimes) -> float:
    """Data-parallel gradient sync left exposed behind a pipeline: a stage's gradients are
    final only during its last micro-batch's backward, and the first stage runs that backward
    last in the step, so at most one backward (B of one micro-batch on one stage) hides it."""
    if dp_comm_s < 0:
        raise ValueError(f"dp_comm_s must be >= 0, got {dp_comm_s}")
    return max(0.0, dp_comm_s - t.B)
