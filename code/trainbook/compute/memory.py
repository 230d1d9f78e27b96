"""Training memory per rank: model states, activations, logits, and what parallelism divides.

`estimate(MemoryInputs(...))` returns a `MemoryBreakdown` in bytes. Inputs are either a
`ModelConfig` (everything) or a bare parameter count (model states only: with no shapes there
are no activations to count). The function holds no CLI logic, so the parallelism chapters and a
layout planner can call it in a loop.

Model states follow Rajbhandari et al. 2020 (ZeRO), Section 3: with mixed precision and Adam,
2 bytes of 16-bit weights, 2 of 16-bit gradients and K = 12 of fp32 optimizer state (master
weights, momentum, variance) per parameter; ZeRO stage 1 shards the optimizer state over the
data-parallel ranks, stage 2 also the gradients, stage 3 also the weights.

Activations per block come from one of three models in `compute.activations`: "production" (a
fused-kernel Llama stack, for published models; the default), "reference" (what the book's own
model saves, checked against measurements here) and "korthikanti" (Korthikanti et al. 2022,
Table 2, as printed). Gradients are kept in the compute dtype unless `grad_dtype="fp32"`
(Megatron's fp32 main gradients, FSDP2 with an fp32 reduce dtype).

Chapter: book/compute/memory.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .. import hardware
from ..configs import ModelConfig, param_counts
from ..layout import Layout, check_layout
from .activations import (  # noqa: F401  (re-exported: the chapter reads them from here)
    ACTIVATION_MODELS,
    PRECISIONS,
    RECOMPUTE,
    check_choice,
    head_bytes,
    korthikanti_layer_bytes,
    layer_bytes,
    logits_bytes,
    production_layer_bytes,
    reference_layer_bytes,
)
from .roofline import bytes_per_element

GiB = 2**30
OPTIMIZERS = ("adamw", "sgd", "adam8bit", "adafactor", "adam", "lion", "muon", "sgd-plain")
GRAD_DTYPES = ("fp32", "bf16", "fp16")
# The error the estimator promises: the memory chapter's estimate-against-MemTracker checks stay
# within it. A peak closer than this to the capacity is too close to call.
ESTIMATE_MARGIN = 0.10


# ---------------------------------------------------------------------------------------------
# Model states: bytes per parameter
# ---------------------------------------------------------------------------------------------

def state_bytes_per_param(dtype: str = "bf16", optimizer: str = "adamw",
                          grad_dtype: str | None = None) -> dict[str, float]:
    """Bytes per parameter of weights, gradients and optimizer state.

    grad_dtype: the gradients' precision, by default the compute dtype (ZeRO's accounting: 16-bit
    gradients, 2 bytes). "fp32" is Megatron's main-gradient buffer (with its distributed
    optimizer, 2 + 4 + 12 = 18 bytes per parameter before sharding) and FSDP2 with
    `reduce_dtype=torch.float32`.

    dtype "fp32": everything in fp32, no master copy. dtype "bf16"/"fp16": mixed precision,
    16-bit weights and gradients for compute plus an fp32 master copy kept by the optimizer (ZeRO's
    accounting; FSDP2 with a MixedPrecisionPolicy keeps the fp32 copy as the sharded parameter
    instead, same total). Optimizer state per parameter:
    adamw: momentum and variance in fp32 (8 bytes); sgd: momentum in fp32 (4);
    adam8bit: momentum and variance in 8 bits, block-wise quantized with one fp32 scale per 2048
    values (Dettmers et al. 2022), 2 + 8/2048 bytes; adafactor: no momentum (beta1 = 0) and a
    factored second moment, one row and one column vector per matrix (Shazeer and Stern 2018),
    which is ~0 bytes per parameter; `estimate` adds the exact factored size when it knows the
    shapes. adam: as adamw (8); lion: momentum only (4); sgd-plain: no momentum (0); muon:
    a momentum for every parameter (4) plus AdamW's second moment on what Muon leaves to it
    (embeddings, head, norms), which `estimate` adds when it knows the shapes (book/pretraining/
    optimizers measures all of these from the optimizers' state_dicts).
    """
    dtype = check_choice(dtype, PRECISIONS, "dtype")
    optimizer = check_choice(optimizer, OPTIMIZERS, "optimizer")
    grads = float(bytes_per_element(check_grad_dtype(dtype, grad_dtype)))
    opt = {"adamw": 8.0, "sgd": 4.0, "adam8bit": 2.0 + 8.0 / 2048, "adafactor": 0.0,
           "adam": 8.0, "lion": 4.0, "muon": 4.0, "sgd-plain": 0.0}[optimizer]
    if dtype == "fp32":
        return {"weights": 4.0, "grads": grads, "optimizer": opt}
    return {"weights": 2.0, "grads": grads, "optimizer": 4.0 + opt}  # + fp32 master weights


def zero_model_states(params: float, dp: int, zero: int, dtype: str = "bf16",
                      optimizer: str = "adamw", grad_dtype: str | None = None) -> float:
    """Bytes of model states per rank under ZeRO stage 0..3 over `dp` ranks (ZeRO Figure 1)."""
    _check_zero(dp, zero)
    b = state_bytes_per_param(dtype, optimizer, grad_dtype)
    shard = lambda stage: params / dp if zero >= stage else params  # noqa: E731
    return b["weights"] * shard(3) + b["grads"] * shard(2) + b["optimizer"] * shard(1)


# ---------------------------------------------------------------------------------------------
# The estimate
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MemoryInputs:
    """One training setup; `model` (a ModelConfig) or `params` (a bare count) is required.

    micro_batch and seq_len are per rank, before CP splits the sequence; seq_len defaults to the
    model's max_seq_len. microbatches is the number of micro-batches per optimizer step
    (gradient accumulation or pipeline micro-batches; default 1, or pp when pipelining); with
    more than one, gradients stay live during the forward pass. interleave is the number of
    virtual pipeline stages per rank. sp (sequence parallelism) defaults to on when tp > 1.
    activations: "production" for a published model trained with fused kernels, "reference"
    for the book's own model (what the chapters measure), "korthikanti" for the paper's table.
    grad_dtype: None (the compute dtype) or "fp32" (fp32 main gradients).
    """

    model: ModelConfig | None = None
    params: int | None = None
    dtype: str = "bf16"
    optimizer: str = "adamw"
    dp: int = 1
    zero: int = 0
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    micro_batch: int = 1
    seq_len: int | None = None
    microbatches: int | None = None
    interleave: int = 1
    recompute: str = "none"
    sp: bool | None = None
    activations: str = "production"
    grad_dtype: str | None = None

    def __post_init__(self):
        if (self.model is None) == (self.params is None):
            raise ValueError("give either a model config or a bare parameter count (params), "
                             "not both")
        if self.params is not None and (not isinstance(self.params, int)
                                        or isinstance(self.params, bool) or self.params < 1):
            raise ValueError(f"params must be a positive integer, got {self.params!r}")
        if self.microbatches is None:  # a pipeline needs at least pp micro-batches to fill
            object.__setattr__(self, "microbatches", self.pp)
        for name in ("dp", "tp", "pp", "cp", "ep", "micro_batch", "microbatches", "interleave"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, "
                                 f"got {v!r}")
        if self.seq_len is not None and (not isinstance(self.seq_len, int) or self.seq_len < 1):
            raise ValueError(f"--seq-len must be a positive integer, got {self.seq_len!r}")
        check_choice(self.dtype, PRECISIONS, "dtype")
        check_choice(self.optimizer, OPTIMIZERS, "optimizer")
        check_choice(self.recompute, RECOMPUTE, "recompute")
        check_choice(self.activations, ACTIVATION_MODELS, "activations")
        check_grad_dtype(self.dtype, self.grad_dtype)
        _check_zero(self.dp, self.zero)
        cfg = self.model
        if cfg is None:
            if self.ep > 1:
                raise ValueError(f"--ep {self.ep} needs a mixture-of-experts model config, "
                                 "not a bare parameter count")
            return
        # the model's rules are the layout's, shared with the planner and the trainer
        check_layout(Layout(dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep,
                            zero=self.zero, micro_batch=self.micro_batch,
                            recompute=self.recompute, interleave=self.interleave),
                     cfg, self.tokens_seq)
        if cfg.n_layers % (self.pp * self.interleave):  # stricter than the layout's rule
            raise ValueError(f"the estimator costs equal pipeline stages: pp {self.pp} x "
                             f"interleave {self.interleave} must divide {cfg.n_layers} layers "
                             "(uneven stages: parallel.step_cost.memory_per_rank)")

    @property
    def tokens_seq(self) -> int:
        return self.seq_len or (self.model.max_seq_len if self.model else 0)

    @property
    def sequence_parallel(self) -> bool:
        return self.tp > 1 if self.sp is None else bool(self.sp)


@dataclass
class MemoryBreakdown:
    """Bytes per rank by category, for the pipeline stage that needs the most.

    peak: the largest of three phases of a steady-state step: the loss's backward (weights,
    optimizer state, live gradients, stored activations, all logit buffers, sharding buffers),
    rebuilding the first layer under full recompute (the same with one layer's activations, the
    gradients of all but the embedding, and only the logits the caller holds), and the
    optimizer step (weights, gradients, optimizer state). So peak can be less than the sum of
    the categories; upper_bound is that sum (everything at once, the usual conservative figure).
    """

    weights: float
    grads: float
    optimizer: float
    activations: float
    logits: float
    transient: float  # all-gathered weights and unsharded gradients (ZeRO-3 / FSDP)
    peak: float
    upper_bound: float
    params_per_rank: float
    stage: str  # "all" without pipelining, else "first" or "last"
    notes: list[str] = field(default_factory=list)

    @property
    def model_states(self) -> float:
        return self.weights + self.grads + self.optimizer

    def as_dict(self) -> dict:
        d = asdict(self)
        d["model_states"] = self.model_states
        return d

    def rows(self, unit: float = GiB) -> list[dict]:
        """(category, GiB) rows for a table."""
        keys = ("weights", "grads", "optimizer", "activations", "logits", "transient", "peak")
        return [{"category": k, "GiB": getattr(self, k) / unit} for k in keys]


def _component_params(cfg: ModelConfig) -> dict[str, float]:
    """Parameters by how parallelism divides them: per layer (tp-split, expert, replicated) and
    the first-stage (embedding, positions) and last-stage (final norm, head) extras."""
    c = param_counts(cfg)
    L = cfg.n_layers
    router = cfg.d_model * cfg.n_experts if cfg.is_moe else 0
    experts = c["mlp"] / L - router if cfg.is_moe else 0
    final_norm = (2 if cfg.flavour == "gpt2" else 1) * cfg.d_model
    return {
        "layer_tp": c["attention"] / L + (0 if cfg.is_moe else c["mlp"] / L),
        "layer_expert": experts,
        "layer_replicated": router + (c["norms"] - final_norm) / L,
        "embedding": c["embedding"], "position": c["position"], "final_norm": final_norm,
        "head": c["head"] or c["embedding"],  # tied: pipelining keeps a copy on the last stage
        "tied": float(c["head"] == 0),
    }


def _adafactor_factored(cfg: ModelConfig) -> tuple[float, float]:
    """(parameters in matrices, row+column state elements of those matrices) for Adafactor."""
    d, hd, ff, L = cfg.d_model, cfg.head_dim, cfg.d_ff, cfg.n_layers
    h, kv, V = cfg.n_heads * hd, cfg.n_kv_heads * hd, cfg.vocab_size
    mats = [(h, d), (kv, d), (kv, d), (d, h)]
    mats += [(ff, d), (d, ff)] * (cfg.n_experts if cfg.is_moe else 1)
    if cfg.flavour == "llama":
        mats += [(ff, d)] * (cfg.n_experts if cfg.is_moe else 1)
    if cfg.is_moe:
        mats.append((cfg.n_experts, d))
    numel = L * sum(r * c for r, c in mats)
    rc = L * sum(r + c for r, c in mats)
    head = ([(V, d)] * (1 if cfg.tied else 2)
            + ([(cfg.max_seq_len, d)] if cfg.flavour == "gpt2" else []))
    return numel + sum(r * c for r, c in head), rc + sum(r + c for r, c in head)


def _muon_adamw_share(cfg: ModelConfig) -> float:
    """The share of parameters Muon leaves to AdamW: all but the blocks' matrices."""
    c = param_counts(cfg)
    hidden = _adafactor_factored(cfg)[0] - c["embedding"] - c["head"] - c["position"]
    return 1 - hidden / c["total"]


def estimate(x: MemoryInputs) -> MemoryBreakdown:
    """Memory per rank for one training setup (see the module docstring for the models)."""
    b = state_bytes_per_param(x.dtype, x.optimizer, x.grad_dtype)
    notes: list[str] = []
    if x.model is None:  # bare count: model states only, spread evenly over tp x pp
        n = x.params / (x.tp * x.pp)
        w, g, o = _sharded_states(b, n, 0.0, x)
        notes.append("bare parameter count: model states only (no shapes, no activations)")
        if x.optimizer == "adafactor":
            notes.append("adafactor: factored second moment not counted without shapes (~0)")
        if x.optimizer == "muon":
            notes.append("muon: AdamW's second moment on embeddings, head and norms not "
                         "counted without shapes")
        total = w + g + o
        return MemoryBreakdown(w, g, o, 0.0, 0.0, 0.0, total, total, n, "all", notes)

    cfg, p = x.model, _component_params(x.model)
    L_stage = cfg.n_layers // x.pp
    layer_dense = p["layer_tp"] / x.tp + p["layer_replicated"]
    layer_expert = p["layer_expert"] / (x.tp * x.ep)
    s, mb, sp = x.tokens_seq, x.micro_batch, x.sequence_parallel
    per_layer = layer_bytes(cfg, mb, s, x.dtype, x.activations, x.tp, sp, x.cp, x.recompute)
    full_layer = layer_bytes(cfg, mb, s, x.dtype, x.activations, x.tp, sp, x.cp, "none")
    final_norm_acts = head_bytes(cfg, mb, s, x.dtype, x.activations, x.tp, sp, x.cp)
    if x.activations == "korthikanti":
        logit = 4 * s / x.cp * mb * cfg.vocab_size / x.tp  # Section 4.3: output layer, 4sbv/t
    else:  # fp32 cross-entropy on the logits, as the reference model and torchtitan compute it
        logit = logits_bytes(mb, s, cfg.vocab_size, x.dtype, x.tp, x.cp)
    if x.recompute == "full":
        notes.append("full recompute: one layer's activations are rebuilt at a time in backward")

    stages = ["all"] if x.pp == 1 else ["first", "last"]
    best = None
    for stage in stages:
        first, last = stage in ("all", "first"), stage in ("all", "last")
        n_dense = L_stage * layer_dense
        if first:
            n_dense += p["embedding"] / x.tp + p["position"]
        if last:
            n_dense += p["final_norm"]
            if not (p["tied"] and stage == "all"):
                n_dense += p["head"] / x.tp
        n_expert = L_stage * layer_expert
        w, g, o = _sharded_states(b, n_dense, n_expert, x)
        if x.optimizer == "adafactor":
            numel, rc = _adafactor_factored(cfg)
            o += 4 * rc * (n_dense + n_expert) / numel / (x.dp if x.zero >= 1 else 1)
        if x.optimizer == "muon":  # AdamW's second moment, by the model's share
            o += 4 * _muon_adamw_share(cfg) * (n_dense + n_expert) / (x.dp if x.zero >= 1 else 1)
        # activations: 1F1B keeps min(pp, microbatches) micro-batches in flight on the first
        # stage, L layers' worth in all; the interleaved schedule with v virtual stages holds
        # 1 + (pp - 1) / (pp * v) times that (Korthikanti et al. 2022, Section 4.2.3).
        in_flight = 1.0
        if x.pp > 1 and first:
            in_flight = min(x.pp, x.microbatches)
            if x.interleave > 1:
                in_flight *= 1 + (x.pp - 1) / (x.pp * x.interleave)
        stored = L_stage * per_layer * in_flight
        rebuilt = full_layer if x.recompute == "full" else 0.0  # one layer at a time, in backward
        head_acts = final_norm_acts if last else 0.0
        logit_b = logit if last else 0.0
        # the logits the caller still holds while a layer is rebuilt, in the compute dtype
        held_logits = mb * s / x.cp * cfg.vocab_size / x.tp * bytes_per_element(x.dtype) \
            if last else 0.0
        acts = stored + rebuilt + head_acts
        transient = 0.0
        if x.zero == 3:  # FSDP: the root's weights stay gathered; two layers gathered at a time
            gathered = n_dense - L_stage * layer_dense + 2 * (layer_dense + layer_expert)
            transient = (b["weights"] * gathered * (1 - 1 / x.dp)
                         + b["grads"] * (layer_dense + layer_expert))
        grads_live = g if (x.microbatches > 1 or x.pp > 1) else 0.0
        base = w + o + grads_live + transient
        # three phases: the loss's backward (all logit buffers), rebuilding a layer in backward
        # (only the caller's logits are left), the optimizer step (all gradients). When the
        # first layer is rebuilt, every gradient but the embedding's exists.
        embed = (p["embedding"] / x.tp + p["position"]) if first else 0.0
        g_rebuild = (g - grads_live) * (1 - embed / (n_dense + n_expert)) if rebuilt else 0.0
        peak = max(base + stored + head_acts + logit_b,
                   base + g_rebuild + stored + rebuilt + held_logits, w + g + o)
        upper = w + g + o + acts + logit_b + transient
        br = MemoryBreakdown(w, g, o, acts, logit_b, transient, peak, upper, n_dense + n_expert,
                             stage, list(notes))
        if best is None or br.peak > best.peak:
            best = br
    return best


def _sharded_states(b: dict, n_dense: float, n_expert: float, x: MemoryInputs):
    """(weights, grads, optimizer) bytes with ZeRO over dp (experts over dp / ep ranks)."""
    def shard(stage):
        if x.zero < stage:
            return n_dense + n_expert
        return n_dense / x.dp + n_expert / (x.dp // x.ep)
    return b["weights"] * shard(3), b["grads"] * shard(2), b["optimizer"] * shard(1)


def fits(breakdown: MemoryBreakdown, gpu: str = "h100-sxm",
         margin: float = ESTIMATE_MARGIN) -> dict:
    """Whether the peak fits one accelerator, as a verdict that respects the estimate's error.

    Capacity is what the device reports (`hardware.Accelerator.capacity_gib`: an H100 80GB
    reports 79.6 GiB), not the name on the box. "fits" when the peak plus `margin` fits, "does
    not fit" when the peak minus `margin` does not, else "too close to call": measure it. The
    CUDA context, NCCL buffers and allocator fragmentation come on top (several hundred MiB to a
    few GiB); the planner's headroom covers them.
    """
    if not 0 <= margin < 1:
        raise ValueError(f"margin is a fraction of the peak in [0, 1), got {margin!r}")
    spec = hardware.get(gpu)
    cap = spec.capacity_gib * GiB
    peak = breakdown.peak
    verdict = ("fits" if peak * (1 + margin) <= cap else
               "does not fit" if peak * (1 - margin) > cap else "too close to call")
    return {"gpu": spec.name, "capacity_gib": spec.capacity_gib,
            "capacity_is_nominal": spec.reported_gib is None, "peak_gib": peak / GiB,
            "free_gib": (cap - peak) / GiB, "fits": peak <= cap, "verdict": verdict,
            "margin": margin}


def check_grad_dtype(dtype: str, grad_dtype: str | None) -> str:
    """The gradients' dtype: the compute dtype, or fp32 (never lower than the weights')."""
    if grad_dtype is None:
        return dtype
    grad_dtype = check_choice(grad_dtype, GRAD_DTYPES, "grad dtype")
    if grad_dtype not in (dtype, "fp32"):
        raise ValueError(f"--grad-dtype {grad_dtype} with --dtype {dtype}: gradients are kept in "
                         f"the compute dtype or in fp32; use --grad-dtype {dtype} or fp32")
    return grad_dtype


def _check_zero(dp: int, zero: int) -> None:
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"--zero must be 0, 1, 2 or 3, got {zero!r}")
    if zero > 0 and dp < 2:
        raise ValueError(f"--zero {zero} shards over data-parallel ranks and needs --dp > 1 "
                         f"(got --dp {dp}); set --dp or use --zero 0")
