"""A layout planner: enumerate (dp, tp, pp, cp, ep, ZeRO, micro-batch, recompute), keep the layouts
that obey the divisibility rules and fit in memory, estimate each one's step time, rank them.

Ranks are ordered [TP, CP, PP, DP] from the fastest-varying (Llama 3's order, Dubey et al. 2024,
Section 3.3.2): a TP group is 8 consecutive GPUs of one node, DP the outermost dimension. A group
whose span (its stride times its size) fits in one node talks over NVLink, otherwise over the
network.

Memory is `compute.memory.estimate` (bf16 mixed precision with AdamW; by default the activations
of a model with fused attention, see `memory_inputs`) for the heaviest pipeline stage, against
the GPU's capacity from `trainbook.hardware` less a headroom (default 10%) for the CUDA context,
NCCL buffers and allocator fragmentation. Context parallelism is considered only when every CP
rank keeps at least `min_cp_tokens` (8,192) tokens: the time model does not see what short
chunks cost (attention-kernel efficiency, load balancing), and Llama 3 used CP only for 128K.

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
`compute.roofline.BYTES_PER_ELEMENT`; MFU is `compute.flops.utilization`. NVLink
bandwidth is half the table's bidirectional per-GPU figure; the network is `nic_gbps` per GPU
(50 GB/s: one 400 Gb/s NIC per GPU).

What the model leaves out: kernel efficiency that falls as matmuls shrink (small micro-batches,
large TP), stage imbalance (the head's FLOPs on the last stage), the optimizer step, data loading,
stragglers and failures, congestion and the network's topology beyond "node or not", overlap of
TP communication with compute, and FP8. It ranks layouts; it does not predict a run to 10%.

Chapter: book/parallelism/putting-it-together.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from numbers import Integral

from .. import configs, hardware
from ..compute import flops, memory
from ..compute.roofline import BYTES_PER_ELEMENT
from ..layout import RECOMPUTE, Layout, layout_rules, stage_layers
from .collectives import collective_time

GiB = 2**30
ACTIVATIONS = ("flash", "reference")


@dataclass(frozen=True)
class Cluster:
    """The machine and the assumptions of the time model (see the module docstring)."""

    gpu: str = "h100-sxm"
    gpus: int = 8
    gpus_per_node: int = 8
    nic_gbps: float = 50.0  # per GPU, decimal GB/s: one 400 Gb/s NIC per GPU
    mfu_matmul: float = 0.5  # fraction of the dense peak (`matmul_dtype`) the matmuls achieve
    alpha_nvlink_s: float = 5e-6  # latency per ring step inside a node
    alpha_net_s: float = 15e-6  # latency per ring step across nodes
    dp_overlap: float = 1.0  # fraction of a micro-batch's compute that can hide DP traffic
    headroom: float = 0.10  # fraction of HBM kept free (CUDA context, NCCL, fragmentation)
    min_cp_tokens: int = 8192  # CP only for long sequences: tokens per CP rank (check_rules)

    def __post_init__(self):
        hardware.get(self.gpu)  # unknown GPUs fail here, with the list
        _positive_int("GPU count", self.gpus)
        _positive_int("gpus_per_node", self.gpus_per_node)
        if not 0 < self.mfu_matmul <= 1:
            raise ValueError(f"mfu_matmul must be in (0, 1], got {self.mfu_matmul}")
        if not 0 <= self.headroom < 1:
            raise ValueError(f"headroom must be in [0, 1), got {self.headroom}")
        if not self.nic_gbps > 0:
            raise ValueError(f"nic_gbps must be positive, got {self.nic_gbps}")

    @property
    def spec(self) -> hardware.Accelerator:
        return hardware.get(self.gpu)

    @property
    def usable_gib(self) -> float:
        return self.spec.memory_gib * (1 - self.headroom)


@dataclass(frozen=True)
class Job:
    """What to train: the model, the global batch in tokens, the sequence length."""

    model: configs.ModelConfig
    global_batch_tokens: int
    seq_len: int
    dtype: str = "bf16"
    optimizer: str = "adamw"
    activations: str = "flash"  # "flash" (production kernels) or "reference" (the book's model)

    def __post_init__(self):
        if self.dtype not in memory.PRECISIONS:
            raise ValueError(f"dtype {self.dtype!r} is unknown; use one of "
                             f"{', '.join(memory.PRECISIONS)} (fp32, or bf16/fp16 mixed precision)")
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


@dataclass
class Plan:
    """One evaluated layout: feasible or not (with the reasons), memory and estimated time."""

    layout: Layout
    feasible: bool
    reasons: list[str] = field(default_factory=list)
    memory_gib: float | None = None
    step_s: float | None = None
    tokens_per_s_per_gpu: float | None = None
    mfu: float | None = None
    hfu: float | None = None  # hardware FLOPs (recomputation included) over peak
    microbatches: int | None = None
    breakdown: dict = field(default_factory=dict)  # seconds by term

    def row(self) -> dict:
        """A flat row for a table or JSON."""
        r = asdict(self.layout)
        r.update({"memory GiB": self.memory_gib, "step s": self.step_s,
                  "tokens/s/GPU": self.tokens_per_s_per_gpu, "MFU": self.mfu, "HFU": self.hfu,
                  "micro-batches": self.microbatches})
        return r


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
        raise ValueError(f"{name} must be a positive whole number, got {value!r}")
    return int(value)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_rules(layout: Layout, job: Job, cluster: Cluster) -> list[str]:
    """Every rule the layout breaks, in words (empty when none): the model's and the batch's
    (`trainbook.layout.layout_rules`, shared with the memory estimator and the trainer), then
    the cluster's."""
    L = layout
    out = layout_rules(L, job.model, job.seq_len, job.sequences)
    if out and "positive whole number" in out[0]:
        return out
    if L.gpus != cluster.gpus:
        out.insert(0, f"dp {L.dp} x tp {L.tp} x pp {L.pp} x cp {L.cp} = {L.gpus} GPUs, "
                      f"not the {cluster.gpus} available")
    if L.tp > cluster.gpus_per_node:
        out.append(f"tp {L.tp} exceeds {cluster.gpus_per_node} GPUs per node "
                   "(TP all-reduces every layer: it needs NVLink)")
    if L.cp > 1 and job.seq_len % L.cp == 0 and job.seq_len // L.cp < cluster.min_cp_tokens:
        out.append(f"cp {L.cp} cuts {job.seq_len}-token sequences into chunks of "
                   f"{job.seq_len // L.cp}, under {cluster.min_cp_tokens} (context parallelism "
                   "is for long sequences; see Cluster.min_cp_tokens)")
    return out


def memory_inputs(layout: Layout, job: Job) -> memory.MemoryInputs:
    """The estimator's inputs for a layout.

    Activations: "reference" counts the tensors the book's reference model saves (full-size
    GQA copies of K and V, fp32 norm copies). "flash" is Korthikanti et al. 2022, Table 2
    without the attention-score term: what a production model with fused (flash) attention
    stores, which is their "selective" row; its backward recomputes the scores inside the
    kernel at no cost FLOP counts see, so "none" and "selective" store the same there.
    Uneven stages are costed as ceil(layers / pp) layers per stage (see `memory_per_rank`).
    """
    cfg, L = job.model, layout
    per = stage_layers(cfg.n_layers, L.pp * L.interleave)
    if per is not None and per * L.pp * L.interleave != cfg.n_layers:
        cfg = cfg.with_(n_layers=per * L.pp * L.interleave)
    recompute, acts = L.recompute, "reference"
    if job.activations == "flash":
        acts, recompute = "korthikanti", ("full" if L.recompute == "full" else "selective")
    return memory.MemoryInputs(
        model=cfg, dtype=job.dtype, optimizer=job.optimizer, dp=L.dp, zero=L.zero, tp=L.tp,
        pp=L.pp, cp=L.cp, ep=L.ep, micro_batch=L.micro_batch, seq_len=job.seq_len,
        microbatches=job.sequences // (L.dp * L.micro_batch), interleave=L.interleave,
        recompute=recompute, activations=acts)


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


def _link(stride: int, size: int, cluster: Cluster) -> tuple[float, float]:
    """(alpha, GB/s) of a group of `size` ranks `stride` apart: NVLink inside a node (half the
    bidirectional table figure), the NIC otherwise."""
    if stride * size <= cluster.gpus_per_node:
        return cluster.alpha_nvlink_s, cluster.spec.interconnect_gbps / 2
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
    a_tp, bw_tp = _link(1, L.tp, cluster)
    act = mb * s / L.cp * cfg.d_model * e
    n_ar = 6 if L.recompute == "full" else 4
    t_tp = layers * n_ar * _collective("all_reduce", L.tp, act, a_tp, bw_tp)

    # CP: all-gather K and V forward, reduce-scatter their gradients backward
    a_cp, bw_cp = _link(L.tp, L.cp, cluster)
    kv = 2 * mb * s * cfg.kv_heads / L.tp * cfg.dim_head * e
    n_cp = 3 if L.recompute == "full" else 2
    t_cp = layers * n_cp * _collective("all_gather", L.cp, kv, a_cp, bw_cp)

    # EP: dispatch and combine all-to-alls, forward and backward (ranks carved out of dp)
    t_ep = 0.0
    if L.ep > 1:
        a_ep, bw_ep = _link(L.tp * L.cp * L.pp, L.ep, cluster)
        tokens = mb * s / L.cp / L.tp * cfg.top_k * cfg.d_model * e
        t_ep = layers * 4 * _collective("all_to_all", L.ep, tokens, a_ep, bw_ep)

    # PP: one send forward and one backward per micro-batch and virtual stage
    t_p2p = 0.0
    if L.pp > 1:
        a_pp, bw_pp = _link(L.tp * L.cp, L.pp, cluster)
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
    a_dp, bw_dp = _link(1, span, cluster)
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


def evaluate(layout: Layout, job: Job, cluster: Cluster) -> Plan:
    """Rules, memory and time of one layout; an infeasible Plan says why in `reasons`."""
    reasons = check_rules(layout, job, cluster)
    if reasons:
        return Plan(layout, False, reasons)
    b = memory_per_rank(layout, job)
    peak = b["peak"] / GiB
    plan = Plan(layout, True, [], memory_gib=peak,
                microbatches=job.sequences // (layout.dp * layout.micro_batch))
    if peak > cluster.usable_gib:
        terms = {k: v / GiB for k, v in b.items() if k not in ("peak", "params_per_rank")}
        big = max(terms, key=terms.get)
        plan.feasible = False
        plan.reasons.append(
            f"peak memory {peak:.1f} GiB exceeds {cluster.usable_gib:.1f} GiB usable on "
            f"{cluster.spec.name} ({cluster.spec.memory_gib:g} GiB less {cluster.headroom:.0%} "
            f"headroom); largest term: {big} {terms[big]:.1f} GiB ("
            + ", ".join(f"{k} {v:.1f}" for k, v in terms.items()) + ")")
    t = step_time(layout, job, cluster)
    model_flops = flops.training_flops(job.model, job.seq_len)["total"] * job.sequences
    plan.step_s = t["total"]
    plan.tokens_per_s_per_gpu = job.global_batch_tokens / t["total"] / cluster.gpus
    plan.mfu = flops.utilization(model_flops, t["total"], peak_flops(job, cluster), cluster.gpus)
    plan.hfu = plan.mfu * flops.training_flops(job.model, job.seq_len, layout.recompute)["total"] \
        / flops.training_flops(job.model, job.seq_len)["total"]
    plan.breakdown = t
    return plan


def explain(layout: Layout | str, job: Job, cluster: Cluster) -> str:
    """Why a layout is or is not feasible, in sentences. A string layout ('tp=8,pp=16,dp=128')
    leaves the other fields at their defaults; a missing dp is filled in from the GPU count."""
    if isinstance(layout, str):
        given = {k.split("=")[0].strip() for k in layout.split(",")}
        layout = Layout.parse(layout)
        rest = layout.tp * layout.pp * layout.cp
        if "dp" not in given and cluster.gpus % rest == 0:
            layout = replace(layout, dp=cluster.gpus // rest)
    p = evaluate(layout, job, cluster)
    head = (f"{layout.short()}, ZeRO {layout.zero}, micro-batch {layout.micro_batch}, "
            f"recompute {layout.recompute}"
            + (f", interleave {layout.interleave}" if layout.interleave > 1 else ""))
    if p.feasible:
        return (f"{head}: feasible; peak memory {p.memory_gib:.1f} GiB of "
                f"{cluster.usable_gib:.1f} usable, est. step {p.step_s:.2f} s, "
                f"MFU {p.mfu:.0%}")
    return f"{head}: infeasible: " + "; ".join(p.reasons)


def enumerate_layouts(job: Job, cluster: Cluster, zero=(0, 1, 2, 3), micro_batches=(1, 2, 4, 8),
                      recompute=RECOMPUTE, interleave=(1, 2, 4), max_cp: int = 16) -> list[Layout]:
    """Every layout whose sizes multiply to the GPU count and obey `check_rules`."""
    cfg, n = job.model, cluster.gpus
    out = []
    for tp in _divisors(n):
        if tp > cluster.gpus_per_node:
            break
        for cp in _divisors(n // tp):
            if cp > max_cp:
                break
            for pp in _divisors(n // (tp * cp)):
                dp = n // (tp * cp * pp)
                eps = [e for e in _divisors(dp) if cfg.n_experts % e == 0] if cfg.is_moe else [1]
                for ep in eps:
                    for z in zero:
                        for mb in micro_batches:
                            for rc in recompute:
                                if job.activations == "flash" and rc == "selective":
                                    continue  # stores what "none" stores, at more FLOPs
                                for v in interleave:
                                    lay = Layout(dp, tp, pp, cp, ep, z, mb, rc, v)
                                    if not check_rules(lay, job, cluster):
                                        out.append(lay)
    return out


def rank(job: Job, cluster: Cluster, **options) -> list[Plan]:
    """Feasible layouts, fastest estimated step first (ties: less memory first)."""
    plans = [evaluate(lay, job, cluster) for lay in enumerate_layouts(job, cluster, **options)]
    ok = [p for p in plans if p.feasible]
    return sorted(ok, key=lambda p: (p.step_s, p.memory_gib))


def best_per_shape(plans: list[Plan]) -> list[Plan]:
    """The fastest plan of each (dp, tp, pp, cp, ep) shape, in ranked order."""
    seen, out = set(), []
    for p in plans:
        key = (p.layout.dp, p.layout.tp, p.layout.pp, p.layout.cp, p.layout.ep)
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


def find(plans: list[Plan], **shape) -> tuple[int, Plan] | None:
    """(0-based position, plan) of the first plan matching the given fields, or None."""
    for i, p in enumerate(plans):
        if all(getattr(p.layout, k) == v for k, v in shape.items()):
            return i, p
    return None


# --- Published layouts -------------------------------------------------------------------------

def narayanan_model(billions: float) -> configs.ModelConfig:
    """A GPT model of Narayanan et al. 2021, Table 1 (gpt2 flavour, V = 51,200, s = 2,048)."""
    for b, heads, hidden, layers, *_ in NARAYANAN_TABLE1:
        if b == billions:
            return configs.ModelConfig(f"gpt-{b}b", "gpt2", 51200, layers, hidden, heads,
                                       max_seq_len=2048)
    raise ValueError(f"no {billions}B model in Narayanan et al. Table 1; "
                     f"rows: {', '.join(str(r[0]) for r in NARAYANAN_TABLE1)}")


# Narayanan et al. 2021 (arXiv 2104.04473), Table 1: parameters (billion), heads, hidden size,
# layers, tensor-parallel size t, pipeline size p, GPUs n, batch size B (sequences), achieved
# teraFLOP/s per GPU (A100 80GB, 16-bit, full activation recomputation).
NARAYANAN_TABLE1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]

# Dubey et al. 2024 (Llama 3), Table 4, second row: 16,384 H100s, TP 8, CP 1, PP 16, DP 128,
# sequence 8,192, 16M tokens per batch (16 sequences per DP group), 400 TFLOPs/GPU, 41% BF16 MFU.
# Their FSDP shards optimizer state and gradients and keeps the weights gathered between forward
# and backward (Section 3.3.2): ZeRO stage 2 in memory terms.
LLAMA3_405B = dict(gpus=16384, tp=8, cp=1, pp=16, dp=128, seq_len=8192,
                   global_batch_tokens=16 * 128 * 8192, tflops_per_gpu=400, mfu=0.41)


def narayanan_check(row: tuple, micro_batches=(1, 2, 4, 8)) -> Plan:
    """The best feasible variant (micro-batch, ZeRO 0 as in the paper, full recompute) of one
    Table 1 row on A100 80GB, or the infeasible micro-batch-1 plan if none fits."""
    billions, _, _, _, t, p, n, B, _ = row
    job = Job(narayanan_model(billions), B * 2048, 2048)
    cluster = Cluster(gpu="a100-80gb", gpus=n)
    best = None
    for mb in micro_batches:
        plan = evaluate(Layout(n // (t * p), t, p, 1, 1, 0, mb, "full"), job, cluster)
        if plan.feasible and (best is None or plan.step_s < best.step_s):
            best = plan
    return best or evaluate(Layout(n // (t * p), t, p, 1, 1, 0, 1, "full"), job, cluster)
