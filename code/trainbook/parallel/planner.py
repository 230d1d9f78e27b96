"""A layout planner: enumerate (dp, tp, pp, cp, ep, ZeRO, micro-batch, recompute), keep the layouts
that obey the divisibility rules and fit in memory, estimate each one's step time
(`step_cost`), rank them, and check the ranking against published layouts (Llama 3 405B;
Narayanan et al. 2021, Table 1).

Context parallelism is considered only when every CP rank keeps at least `min_cp_tokens` (8,192)
tokens: the time model does not see what short chunks cost (attention-kernel efficiency, load
balancing), and Llama 3 used CP only for 128K.

Chapter: book/parallelism/putting-it-together.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from .. import configs
from ..compute import flops
from ..layout import RECOMPUTE, Layout, layout_rules
from .step_cost import ACTIVATIONS, Cluster, Job, memory_per_rank, peak_flops, step_time  # noqa: F401

GiB = 2**30


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
    memory_margin: float | None = None  # how much the peak may grow and still fit: usable/peak - 1

    def row(self) -> dict:
        """A flat row for a table or JSON."""
        r = asdict(self.layout)
        r.update({"memory GiB": self.memory_gib, "step s": self.step_s,
                  "tokens/s/GPU": self.tokens_per_s_per_gpu, "MFU": self.mfu, "HFU": self.hfu,
                  "micro-batches": self.microbatches, "memory margin": self.memory_margin})
        return r


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
    if L.tp > cluster.domain_gpus:
        out.append(f"tp {L.tp} exceeds the {cluster.domain_gpus} GPUs of one NVLink domain "
                   "(TP all-reduces every layer: it needs NVLink)")
    if L.cp > 1 and job.seq_len % L.cp == 0 and job.seq_len // L.cp < cluster.min_cp_tokens:
        out.append(f"cp {L.cp} cuts {job.seq_len}-token sequences into chunks of "
                   f"{job.seq_len // L.cp}, under {cluster.min_cp_tokens} (context parallelism "
                   "is for long sequences; see Cluster.min_cp_tokens)")
    return out


def evaluate(layout: Layout, job: Job, cluster: Cluster) -> Plan:
    """Rules, memory and time of one layout; an infeasible Plan says why in `reasons`."""
    reasons = check_rules(layout, job, cluster)
    if reasons:
        return Plan(layout, False, reasons)
    b = memory_per_rank(layout, job)
    peak = b["peak"] / GiB
    plan = Plan(layout, True, [], memory_gib=peak,
                microbatches=job.sequences // (layout.dp * layout.micro_batch),
                memory_margin=cluster.usable_gib / peak - 1)
    if peak > cluster.usable_gib:
        terms = {k: v / GiB for k, v in b.items() if k not in ("peak", "params_per_rank")}
        big = max(terms, key=terms.get)
        plan.feasible = False
        plan.reasons.append(
            f"peak memory {peak:.1f} GiB exceeds {cluster.usable_gib:.1f} GiB usable on "
            f"{cluster.spec.name} ({cluster.spec.capacity_gib:.1f} GiB less {cluster.headroom:.0%} "
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


def enumerate_layouts(job: Job, cluster: Cluster, zero: Sequence[int] = (0, 1, 2, 3),
                      micro_batches: Sequence[int] = (1, 2, 4, 8),
                      recompute: Sequence[str] = RECOMPUTE, interleave: Sequence[int] = (1, 2, 4),
                      max_cp: int = 16) -> list[Layout]:
    """Every layout whose sizes multiply to the GPU count and obey `check_rules`."""
    cfg, n = job.model, cluster.gpus
    out = []
    for tp in _divisors(n):
        if tp > cluster.domain_gpus:
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
                                if job.activations == "production" and rc == "selective":
                                    continue  # saves only the log-sum-exp, at more FLOPs
                                for v in interleave:
                                    lay = Layout(dp, tp, pp, cp, ep, z, mb, rc, v)
                                    if not check_rules(lay, job, cluster):
                                        out.append(lay)
    return out


def rank(job: Job, cluster: Cluster, margin: float = 0.0, **options: Any) -> list[Plan]:
    """Feasible layouts, fastest estimated step first (ties: less memory first).

    margin: keep only layouts whose peak may grow by this fraction and still fit, e.g.
    `compute.memory.ESTIMATE_MARGIN`: the estimator's error, so that no plan rests on a
    memory figure the estimate cannot vouch for."""
    if not 0 <= margin < 1:
        raise ValueError(f"margin is a fraction of the peak in [0, 1), got {margin!r}")
    plans = [evaluate(lay, job, cluster) for lay in enumerate_layouts(job, cluster, **options)]
    ok = [p for p in plans if p.feasible and p.memory_margin >= margin]
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


def find(plans: list[Plan], **shape: int | str) -> tuple[int, Plan] | None:
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


def narayanan_check(row: tuple, micro_batches: Sequence[int] = (1, 2, 4, 8)) -> Plan:
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
