"""Training memory per rank: model states, activations, logits, and what parallelism divides.

`estimate(MemoryInputs(...))` returns a `MemoryBreakdown` in bytes. Inputs are either a
`ModelConfig` (everything) or a bare parameter count (model states only: with no shapes there
are no activations to count). The function holds no CLI logic, so the parallelism chapters and a
layout planner can call it in a loop.

Model states follow Rajbhandari et al. 2020 (ZeRO), Section 3: with mixed precision and Adam,
2 bytes of 16-bit weights, 2 of 16-bit gradients and K = 12 of fp32 optimizer state (master
weights, momentum, variance) per parameter; ZeRO stage 1 shards the optimizer state over the
data-parallel ranks, stage 2 also the gradients, stage 3 also the weights.

Activations come in two flavours. `korthikanti_layer_bytes` is Korthikanti et al. 2022, Table 2,
as printed: a GPT layer with 16-bit activations, 1-byte dropout masks, a 4h GELU MLP and the
attention score matrices stored (no flash attention). `reference_layer_bytes` counts the tensors
the book's reference model (`trainbook.model`) actually saves for backward: no dropout, fused
attention (`scaled_dot_product_attention`, no s x s scores), SwiGLU or GELU MLP, RoPE and
grouped-query attention. It is checked against `MemTracker` measurements (`memory_measure`).

Chapter: book/compute/memory.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .. import hardware
from ..configs import ModelConfig, param_counts
from ..layout import Layout, check_layout
from .roofline import bytes_per_element

GiB = 2**30
PRECISIONS = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("adamw", "sgd", "adam8bit", "adafactor")
RECOMPUTE = ("none", "selective", "full")
ACTIVATION_MODELS = ("reference", "korthikanti")


# ---------------------------------------------------------------------------------------------
# Model states: bytes per parameter
# ---------------------------------------------------------------------------------------------

def state_bytes_per_param(dtype: str = "bf16", optimizer: str = "adamw") -> dict[str, float]:
    """Bytes per parameter of weights, gradients and optimizer state.

    dtype "fp32": everything in fp32, no master copy. dtype "bf16"/"fp16": mixed precision,
    16-bit weights and gradients for compute plus an fp32 master copy kept by the optimizer (ZeRO's
    accounting; FSDP2 with a MixedPrecisionPolicy keeps the fp32 copy as the sharded parameter
    instead, same total). Optimizer state per parameter:
    adamw: momentum and variance in fp32 (8 bytes); sgd: momentum in fp32 (4);
    adam8bit: momentum and variance in 8 bits, block-wise quantized with one fp32 scale per 2048
    values (Dettmers et al. 2022), 2 + 8/2048 bytes; adafactor: no momentum (beta1 = 0) and a
    factored second moment, one row and one column vector per matrix (Shazeer and Stern 2018),
    which is ~0 bytes per parameter; `estimate` adds the exact factored size when it knows the
    shapes.
    """
    dtype = _check_choice(dtype, PRECISIONS, "dtype")
    optimizer = _check_choice(optimizer, OPTIMIZERS, "optimizer")
    opt = {"adamw": 8.0, "sgd": 4.0, "adam8bit": 2.0 + 8.0 / 2048, "adafactor": 0.0}[optimizer]
    if dtype == "fp32":
        return {"weights": 4.0, "grads": 4.0, "optimizer": opt}
    return {"weights": 2.0, "grads": 2.0, "optimizer": 4.0 + opt}  # + fp32 master weights


def zero_model_states(params: float, dp: int, zero: int, dtype: str = "bf16",
                      optimizer: str = "adamw") -> float:
    """Bytes of model states per rank under ZeRO stage 0..3 over `dp` ranks (ZeRO Figure 1)."""
    _check_zero(dp, zero)
    b = state_bytes_per_param(dtype, optimizer)
    shard = lambda stage: params / dp if zero >= stage else params  # noqa: E731
    return b["weights"] * shard(3) + b["grads"] * shard(2) + b["optimizer"] * shard(1)


# ---------------------------------------------------------------------------------------------
# Activations per layer
# ---------------------------------------------------------------------------------------------

def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                            recompute: str = "none") -> float:
    """Activation bytes of one transformer layer, Korthikanti et al. 2022, Table 2.

    s sequence length, b micro-batch, h hidden size, a heads, t tensor-parallel size, sp sequence
    parallelism. 16-bit activations, 1-byte dropout masks, 4h GELU MLP, attention scores stored;
    "selective" recomputes the attention core (drops the 5as/h term), "full" keeps only the
    layer's input (2sbh).
    """
    recompute = _check_choice(recompute, RECOMPUTE, "recompute")
    sbh, scores = s * b * h, 5 * a * s / h
    if recompute == "full":
        return 2.0 * sbh
    if recompute == "selective":
        scores = 0.0
    if sp:
        return sbh * (34 / t + scores / t)
    return sbh * (10 + 24 / t + scores / t)


def reference_layer_bytes(cfg: ModelConfig, b: int, s: int, dtype: str = "fp32", tp: int = 1,
                          sp: bool = False, cp: int = 1, recompute: str = "none") -> float:
    """Activation bytes one block of the reference model saves for backward.

    Counted from `trainbook.model` (llama flavour; per token): each RMSNorm keeps its input, the
    normalized x and the weighted output (3d; in 16 bits the fp32 copy replaces the input);
    attention keeps the rotated q, the attention output and its reshaped copy (3 x heads x
    head_dim), the rotated k and v (2 x kv heads x head_dim: SDPA takes grouped-query attention as
    it is, no repeated copies) and an fp32 log-sum-exp per head; SwiGLU keeps gate, silu(gate), up
    and their product (4 d_ff). The gpt2 flavour keeps input and output of each LayerNorm, q/k/v,
    the attention output and its copy, and the GELU input and output. Tensor parallelism divides the
    head and d_ff dimensions; with sequence parallelism also the norms' tensors. Context parallelism
    divides the sequence, except the all-gathered k and v. "full" recompute keeps the block input;
    "selective" recomputes the attention core (RoPE, attention) and keeps the linear layers' inputs:
    a model that is not checked by measurement here. Mixture-of-experts MLPs are approximated (top_k
    copies).
    """
    recompute = _check_choice(recompute, RECOMPUTE, "recompute")
    e = bytes_per_element(_check_choice(dtype, PRECISIONS, "dtype"))
    tok = b * s / cp  # tokens on this rank; k and v are gathered: cp times as many
    d, ff, hd = cfg.d_model, cfg.d_ff, cfg.head_dim
    h, kv = cfg.n_heads / tp, cfg.n_kv_heads / tp
    norm_div = tp if sp else 1
    if recompute == "full":
        return tok * d * e / norm_div
    if cfg.flavour == "gpt2":
        norms = 2 * 2 * d * e / norm_div  # input and output of each LayerNorm
        attn = (3 * h * hd + 2 * h * hd * cp) * e  # q, output, its copy; k, v
        if recompute == "selective":
            attn = 4 * h * hd * e  # q, k, v and the output projection's input
        return tok * (norms + attn + 2 * ff / tp * e)  # GELU input and output
    norms = 2 * (3 * d * e if e == 4 else (4 + 2 + 2) * d) / norm_div
    attn = (3 * h * hd + 2 * kv * hd * cp) * e + h * 4  # + fp32 log-sum-exp
    if recompute == "selective":
        attn = (2 * h + 2 * kv) * hd * e  # q, k, v and the output projection's input
    if cfg.is_moe:  # approximate: each token's top_k expert inputs, SwiGLU tensors and outputs
        mlp = cfg.top_k * (2 * d + 4 * ff / tp) * e + cfg.n_experts * 4
    else:
        mlp = 4 * ff / tp * e  # gate, silu(gate), up, their product
    return tok * (norms + attn + mlp)


def logits_bytes(b: int, s: int, vocab: int, dtype: str = "fp32", tp: int = 1,
                 cp: int = 1) -> float:
    """Peak bytes of the logits and the cross-entropy buffers, as the reference model computes them.

    The logits (the caller keeps them until the step ends), the fp32 log-softmax saved for
    backward, and in backward the gradients of both (fp32): 4 x 4 bytes per logit in fp32,
    2 + 4 + 4 + 4 in 16 bits. Vocabulary-parallel TP divides the vocabulary; CP the sequence.
    """
    per = 16 if _check_choice(dtype, PRECISIONS, "dtype") == "fp32" else 14
    return b * s / cp * vocab / tp * per


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
    activations: str = "reference"

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
        _check_choice(self.dtype, PRECISIONS, "dtype")
        _check_choice(self.optimizer, OPTIMIZERS, "optimizer")
        _check_choice(self.recompute, RECOMPUTE, "recompute")
        _check_choice(self.activations, ACTIVATION_MODELS, "activations")
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


def estimate(x: MemoryInputs) -> MemoryBreakdown:
    """Memory per rank for one training setup (see the module docstring for the models)."""
    b = state_bytes_per_param(x.dtype, x.optimizer)
    notes: list[str] = []
    if x.model is None:  # bare count: model states only, spread evenly over tp x pp
        n = x.params / (x.tp * x.pp)
        w, g, o = _sharded_states(b, n, 0.0, x)
        notes.append("bare parameter count: model states only (no shapes, no activations)")
        if x.optimizer == "adafactor":
            notes.append("adafactor: factored second moment not counted without shapes (~0)")
        total = w + g + o
        return MemoryBreakdown(w, g, o, 0.0, 0.0, 0.0, total, total, n, "all", notes)

    cfg, p = x.model, _component_params(x.model)
    L_stage = cfg.n_layers // x.pp
    layer_dense = p["layer_tp"] / x.tp + p["layer_replicated"]
    layer_expert = p["layer_expert"] / (x.tp * x.ep)
    s, mb = x.tokens_seq, x.micro_batch
    if x.activations == "reference":
        layer = lambda rc: reference_layer_bytes(cfg, mb, s, x.dtype, x.tp,  # noqa: E731
                                                 x.sequence_parallel, x.cp, rc)
        per_layer, full_layer = layer(x.recompute), layer("none")
        logit = logits_bytes(mb, s, cfg.vocab_size, x.dtype, x.tp, x.cp)
        final_norm_acts = mb * s / x.cp * cfg.d_model * bytes_per_element(x.dtype) * \
            (3 if cfg.flavour == "llama" else 2) / (x.tp if x.sequence_parallel else 1)
    else:
        a, h = cfg.n_heads, cfg.d_model
        layer = lambda rc: korthikanti_layer_bytes(s // x.cp, mb, h, a, x.tp,  # noqa: E731
                                                   x.sequence_parallel, rc)
        per_layer, full_layer = layer(x.recompute), layer("none")
        logit = 4 * s / x.cp * mb * cfg.vocab_size / x.tp  # Section 4.3: output layer, 4sbv/t
        final_norm_acts = 4 * s / x.cp * mb * h / x.tp
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


def fits(breakdown: MemoryBreakdown, gpu: str = "h100-sxm") -> dict:
    """Whether the peak fits in one accelerator's memory (from `trainbook.hardware`).

    The table's capacity is nominal; CUDA reserves a few hundred MiB for its context and the
    allocator fragments, so treat a margin under ~5% as "does not fit".
    """
    spec = hardware.get(gpu)
    cap = spec.memory_gib * GiB
    return {"gpu": spec.name, "capacity_gib": spec.memory_gib, "peak_gib": breakdown.peak / GiB,
            "free_gib": (cap - breakdown.peak) / GiB, "fits": breakdown.peak <= cap}


def _check_choice(value: str, choices: tuple, what: str) -> str:
    if value not in choices:
        raise ValueError(f"{what} {value!r} is unknown; use one of {', '.join(choices)}")
    return value


def _check_zero(dp: int, zero: int) -> None:
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"--zero must be 0, 1, 2 or 3, got {zero!r}")
    if zero > 0 and dp < 2:
        raise ValueError(f"--zero {zero} shards over data-parallel ranks and needs --dp > 1 "
                         f"(got --dp {dp}); set --dp or use --zero 0")
