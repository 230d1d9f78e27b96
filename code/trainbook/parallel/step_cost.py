"""The planner's cost model: memory per GPU and the time of one step for a layout on a cluster.

Ranks are ordered [TP, CP, PP, DP] from the fastest-varying (Llama 3's order, Dubey et al. 2024,
Section 3.3.2): a TP group is 8 consecutive GPUs of one node, DP the outermost dimension. A group
whose span (its stride times its size) fits in one NVLink domain (`Cluster.domain_gpus`: 8 GPUs
of an HGX node, 72 of a GB200 NVL72 rack) talks over NVLink, otherwise over the network.

Memory is `compute.memory.estimate` (bf16 mixed precision with AdamW; by default the activations
of a model with fused attention, see `memory_inputs`) for the heaviest pipeline stage, against
the GPU's capacity from `trainbook.hardware` less a headroom (default 10%) for the CUDA context,
NCCL buffers and allocator fragmentation.

Step time is a roofline-plus-alpha-beta model (`step_time`):
- compute: the hardware FLOPs of `compute.flops.training_flops` (recomputation included) at an
  assumed fraction `mfu_matmul` of the dense peak of the job's matmul dtype (`matmul_dtype`:
  bf16 and fp16 jobs use their own peak; an fp32 job runs its matmuls in TF32 on the tensor
  cores, as PyTorch does with `torch.backends.cuda.matmul.allow_tf32`, so it gets the TF32 peak,
  or the fp32 peak on a chip without TF32), split evenly over pipeline stages;
- TP: per layer and micro-batch, 2 all-reduces forward and 2 backward (Megatron; with sequence
  parallelism the same bytes as all-gather + reduce-scatter), 2 more when full recompute replays
  the forward; on the critical path;
- CP: all-gather of K and V per layer forward, reduce-scatter of their gradients backward;
- EP: 2 all-to-alls (dispatch, combine) per MoE layer forward and 2 backward;
- PP: one activation send forward and one gradient send backward per micro-batch and stage, plus
  the bubble: a step takes (m + (p - 1) / v) stage-times for m micro-batches and v virtual stages;
- DP: gradients reduce-scattered (or all-reduced) once per step and weights all-gathered once
  (ZeRO 0-2), or all-gathered in every micro-batch's forward and backward (ZeRO-3, weights
  resharded), over dp x cp ranks, one collective per layer (so latency counts per layer); they
  hide behind one micro-batch's backward (or forward) compute on the stage, times `dp_overlap`;
  the rest is exposed.
Collectives cost `parallel.collectives.collective_time` (ring steps x alpha + bus factor x bytes /
bandwidth, the bus factor from `bench.collectives.bus_factor`). Bytes per element come from
`compute.roofline.BYTES_PER_ELEMENT`; MFU is `compute.flops.utilization`. Inside the domain
the bandwidth is what nccl-tests achieves, from the hardware table (`busbw_gbps`: on 8 H100,
480 GB/s for all-reduce with NVLink SHARP, 370 GB/s for ring-type collectives); across domains
`nic_gbps` per GPU (the platform's, 50 GB/s for one 400 Gb/s NIC per GPU). Latency per ring
step is 1 us inside the domain (an 8-GPU ring all-reduce: 14 us, about NCCL's small-message
latency there) and 15 us across.

What the model leaves out: kernel efficiency that falls as matmuls shrink (small micro-batches,
large TP), stage imbalance (the head's FLOPs on the last stage), the optimizer step, data loading,
stragglers and failures, congestion and the network's topology beyond "node or not", overlap of
TP communication with compute, and FP8. It ranks layouts; it does not predict a run to 10%.

Chapter: book/parallelism/putting-it-together.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral

from .. import configs, hardware
from ..compute import flops, memory
from ..compute.roofline import BYTES_PER_ELEMENT
from ..layout import Layout, stage_layers
from .collectives import collective_time

ACTIVATIONS = ("production", "reference")


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
        raise ValueError(f"{name} must be a positive whole number, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class Cluster:
    """The machine and the assumptions of the time model (see the module docstring)."""

    gpu: str = "h100-sxm"
    gpus: int = 8
    domain_gpus: int | None = None  # GPUs per NVLink domain; None: the GPU's (8 HGX, 72 NVL72)
    nic_gbps: float | None = None  # scale-out per GPU, decimal GB/s; None: the GPU's platform
    mfu_matmul: float = 0.5  # fraction of the dense peak (`matmul_dtype`) the matmuls achieve
    alpha_domain_s: float = 1e-6  # latency per ring step inside the NVLink domain
    alpha_net_s: float = 15e-6  # latency per ring step across domains
    dp_overlap: float = 1.0  # fraction of a micro-batch's compute that can hide DP traffic
    headroom: float = 0.10  # fraction of HBM kept free (CUDA context, NCCL, fragmentation)
    min_cp_tokens: int = 8192  # CP only for long sequences: tokens per CP rank (check_rules)

    def __post_init__(self):
        spec = hardware.get(self.gpu)  # unknown GPUs fail here, with the list
        _positive_int("GPU count", self.gpus)
        if self.domain_gpus is None:
            object.__setattr__(self, "domain_gpus", spec.domain)
        _positive_int("domain_gpus", self.domain_gpus)
        if self.nic_gbps is None:
            if spec.nic_gbps is None and self.gpus > self.domain_gpus:
                raise ValueError(f"{spec.name} has no scale-out network in the hardware table "
                                 f"and {self.gpus} GPUs span more than one domain of "
                                 f"{self.domain_gpus}; give nic_gbps (--nic-gbps)")
            object.__setattr__(self, "nic_gbps", spec.nic_gbps or 0.0)
        if not 0 < self.mfu_matmul <= 1:
            raise ValueError(f"mfu_matmul must be in (0, 1], got {self.mfu_matmul}")
        if not 0 <= self.headroom < 1:
            raise ValueError(f"headroom must be in [0, 1), got {self.headroom}")
        if self.nic_gbps < 0 or (self.nic_gbps == 0 and self.gpus > self.domain_gpus):
            raise ValueError(f"nic_gbps must be positive, got {self.nic_gbps}")

    @property
    def spec(self) -> hardware.Accelerator:
        return hardware.get(self.gpu)

    @property
    def usable_gib(self) -> float:
        return self.spec.capacity_gib * (1 - self.headroom)


@dataclass(frozen=True)
class Job:
    """What to train: the model, the global batch in tokens, the sequence length."""

    model: configs.ModelConfig
    global_batch_tokens: int
    seq_len: int
    dtype: str = "bf16"
    optimizer: str = "adamw"
    activations: str = "production"  # fused-kernel Llama stack, or "reference" (the book's model)
    grad_dtype: str | None = None  # None: the compute dtype; "fp32": fp32 main gradients

    def __post_init__(self):
        if self.dtype not in memory.PRECISIONS:
            raise ValueError(f"dtype {self.dtype!r} is unknown; use one of "
                             f"{', '.join(memory.PRECISIONS)} (fp32, or bf16/fp16 mixed precision)")
        memory.check_grad_dtype(self.dtype, self.grad_dtype)
        if self.activations not in ACTIVATIONS:
            raise ValueError(f"activations {self.activations!r} is unknown; use one of "
                             f"{', '.join(ACTIVATIONS)}")
        _positive_int("global batch tokens", self.global_batch_tokens)
        _positive_int("sequence length", self.seq_len)
        if self.global_batch_tokens % self.seq_len:
            raise ValueError(f"global batch of {self.global_batch_tokens:,} tokens is not a whole "
                             f"number of {self.seq_len:,}-token sequences; use a multiple of "
                             f"{self.seq_len:,}")

    @property
    def sequences(self) -> int:
        return self.global_batch_tokens // self.seq_len


def memory_inputs(layout: Layout, job: Job) -> memory.MemoryInputs:
    """The estimator's inputs for a layout.

    Activations: "production" (`compute.activations.production_layer_bytes`: fused norms, fused
    attention with grouped-query attention, fused SwiGLU, no dropout) for published models;
    "reference" counts the tensors the book's reference model saves (fp32 norm copies among
    them). Uneven stages are costed as ceil(layers / pp) layers per stage (see
    `memory_per_rank`).
    """
    cfg, L = job.model, layout
    per = stage_layers(cfg.n_layers, L.pp * L.interleave)
    if per is not None and per * L.pp * L.interleave != cfg.n_layers:
        cfg = cfg.with_(n_layers=per * L.pp * L.interleave)
    return memory.MemoryInputs(
        model=cfg, dtype=job.dtype, optimizer=job.optimizer, dp=L.dp, zero=L.zero, tp=L.tp,
        pp=L.pp, cp=L.cp, ep=L.ep, micro_batch=L.micro_batch, seq_len=job.seq_len,
        microbatches=job.sequences // (L.dp * L.micro_batch), interleave=L.interleave,
        recompute=L.recompute, activations=job.activations, grad_dtype=job.grad_dtype)


def memory_per_rank(layout: Layout, job: Job) -> dict[str, float]:
    """Peak bytes per GPU by term (and "peak", "params_per_rank") for the heaviest stage.

    `compute.memory.estimate` costs the first pipeline stage: `pp` micro-batches in flight.
    When the first and last stages carry one block fewer (uneven layers), the heaviest stage
    is the first (per - 1 blocks, pp in flight) or the second (per blocks, pp - 1 in flight);
    the stored activations are scaled to that stage's count here.
    """
    b = memory.estimate(memory_inputs(layout, job))
    terms = {k: getattr(b, k) for k in ("weights", "grads", "optimizer", "activations",
                                        "logits", "transient")}
    peak = b.peak
    per = stage_layers(job.model.n_layers, layout.pp * layout.interleave)
    if layout.pp > 1 and per * layout.pp * layout.interleave != job.model.n_layers:
        p = layout.pp
        factor = max((per - 1) * p, per * (p - 1)) / (per * p)
        cut = terms["activations"] * (1 - factor)
        terms["activations"] -= cut
        peak = max(peak - cut, b.model_states)
    return {**terms, "peak": peak, "params_per_rank": b.params_per_rank}


def matmul_dtype(job: Job, cluster: Cluster) -> str:
    """The dtype whose dense peak the job's matmuls run at: bf16 and fp16 as given; fp32 as TF32
    on tensor cores when the chip has a TF32 peak (PyTorch's `allow_tf32`; A100 and later), else
    plain fp32 (V100, T4)."""
    if job.dtype == "fp32":
        return "tf32" if cluster.spec.tflops.get("tf32") else "fp32"
    return job.dtype


def peak_flops(job: Job, cluster: Cluster) -> float:
    """Dense peak FLOP/s per GPU for the job's matmuls (`matmul_dtype`)."""
    return cluster.spec.peak_flops(matmul_dtype(job, cluster))


def _collective(op: str, n: int, nbytes: float, alpha_s: float, gbps: float) -> float:
    return collective_time(op, n, nbytes, alpha_s, gbps * 1e9)


def link(stride: int, size: int, cluster: Cluster, op: str) -> tuple[float, float]:
    """(alpha, busbw GB/s) of collective `op` over a group of `size` ranks `stride` apart: the
    hardware table's achievable bus bandwidth inside the NVLink domain
    (`hardware.Accelerator.busbw_gbps`), the NIC otherwise."""
    if stride * size <= cluster.domain_gpus:
        return cluster.alpha_domain_s, cluster.spec.busbw_gbps(op)
    return cluster.alpha_net_s, cluster.nic_gbps


def step_time(layout: Layout, job: Job, cluster: Cluster) -> dict[str, float]:
    """Estimated seconds of one optimizer step, by term, and "total" (see the module docstring)."""
    cfg, L = job.model, layout
    e = BYTES_PER_ELEMENT[job.dtype]  # bytes per element on the wire
    s, mb = job.seq_len, L.micro_batch
    m = job.sequences // (L.dp * mb)  # micro-batches per replica per step
    rate = peak_flops(job, cluster) * cluster.mfu_matmul

    # compute of one micro-batch on one stage (forward + backward, recomputation included)
    hw = flops.training_flops(cfg, s, L.recompute)["total"] * mb
    t_comp = hw / (L.tp * L.cp * L.pp) / rate
    t_fwd = flops.forward_flops(cfg, s)["total"] * mb / (L.tp * L.cp * L.pp) / rate
    layers = stage_layers(cfg.n_layers, L.pp * L.interleave) * L.interleave

    # TP: 4 all-reduces of the layer's activations per layer (6 with full recompute)
    a_tp, bw_tp = link(1, L.tp, cluster, "all_reduce")
    act = mb * s / L.cp * cfg.d_model * e
    n_ar = 6 if L.recompute == "full" else 4
    t_tp = layers * n_ar * _collective("all_reduce", L.tp, act, a_tp, bw_tp)

    # CP: all-gather K and V forward, reduce-scatter their gradients backward
    a_cp, bw_cp = link(L.tp, L.cp, cluster, "all_gather")
    kv = 2 * mb * s * cfg.n_kv_heads / L.tp * cfg.head_dim * e
    n_cp = 3 if L.recompute == "full" else 2
    t_cp = layers * n_cp * _collective("all_gather", L.cp, kv, a_cp, bw_cp)

    # EP: dispatch and combine all-to-alls, forward and backward (ranks carved out of dp)
    t_ep = 0.0
    if L.ep > 1:
        a_ep, bw_ep = link(L.tp * L.cp * L.pp, L.ep, cluster, "all_to_all")
        tokens = mb * s / L.cp / L.tp * cfg.top_k * cfg.d_model * e
        t_ep = layers * 4 * _collective("all_to_all", L.ep, tokens, a_ep, bw_ep)

    # PP: one send forward and one backward per micro-batch and virtual stage
    t_p2p = 0.0
    if L.pp > 1:
        a_pp, bw_pp = link(L.tp * L.cp, L.pp, cluster, "send")
        t_p2p = 2 * L.interleave * (a_pp + act / L.tp / (bw_pp * 1e9))
    stage = t_comp + t_tp + t_cp + t_ep + t_p2p
    bubble = (L.pp - 1) / L.interleave * stage if L.pp > 1 else 0.0
    pipeline = m * stage + bubble

    # DP / ZeRO: per-rank shard of this stage's parameters (tp- and pp-split), one collective
    # per layer (FSDP units, DDP buckets), so the latency counts once per layer. CP ranks hold
    # the same weights: gradients are reduced over dp x cp ranks.
    params = memory_per_rank(L, job)["params_per_rank"]
    n_dp = L.dp * L.cp
    span = L.tp * L.cp if L.dp == 1 else L.gpus
    a_dp, bw_dp = link(1, span, cluster, "reduce_scatter")
    unit = params * e / layers
    grads = layers * _collective("reduce_scatter", n_dp, unit, a_dp, bw_dp)
    gather = layers * _collective("all_gather", n_dp, unit, a_dp, bw_dp)
    w_b = cluster.dp_overlap * (t_comp - t_fwd)  # one micro-batch's backward on this stage
    w_f = cluster.dp_overlap * t_fwd
    if L.zero == 3:  # weights gathered for every micro-batch's forward and backward
        dp_total = grads + 2 * m * gather
        dp_exposed = max(0.0, grads - w_b) + m * (max(0.0, gather - w_f) + max(0.0, gather - w_b))
    else:  # all-reduce = reduce-scatter + all-gather; ZeRO 1/2 gather the updated weights
        dp_total = grads + gather
        dp_exposed = max(0.0, grads - w_b) + max(0.0, gather - w_f)
    total = pipeline + dp_exposed
    return {"compute": m * t_comp, "tp": m * t_tp, "cp": m * t_cp, "ep": m * t_ep,
            "pp_p2p": m * t_p2p, "bubble": bubble, "dp_exposed": dp_exposed,
            "dp_total": dp_total, "total": total}
