"""Activation memory per transformer block: three models, for three questions.

`korthikanti_layer_bytes` is Korthikanti et al. 2022, Table 2, as printed: a GPT-3 layer with
16-bit activations, 1-byte dropout masks, a 4h GELU MLP and the attention scores stored (no fused
attention). It reproduces the paper; it describes no model trained today.

`reference_layer_bytes` counts what the book's reference model (`trainbook.model`) saves: unfused
RMSNorm with fp32 copies, SDPA attention, an unfused SwiGLU. It is checked against `MemTracker`
measurements (`bench.memory_measure`), so it is the model to use for the book's own runs.

`production_layer_bytes` is a production Llama stack (torchtitan, Megatron-Core, bf16): fused
RMSNorm, fused attention with grouped-query attention, no dropout, a fused SwiGLU. It is the model
to cost a published model (Llama, Mistral, Mixtral) trained with today's kernels.

Symbols: b micro-batch, s sequence length, h hidden size (d_model), a heads, t tensor-parallel
size, sp sequence parallelism, cp context-parallel size.

Chapter: book/compute/memory.
"""

from __future__ import annotations

from ..configs import ModelConfig
from .roofline import bytes_per_element

PRECISIONS = ("fp32", "bf16", "fp16")
RECOMPUTE = ("none", "selective", "full")
ACTIVATION_MODELS = ("production", "reference", "korthikanti")
LSE_BYTES = 4  # fused attention keeps an fp32 log-sum-exp per head and token
RSTD_BYTES = 4  # a fused RMSNorm keeps an fp32 reciprocal standard deviation per token


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                            recompute: str = "none") -> float:
    """Activation bytes of one transformer layer, Korthikanti et al. 2022, Table 2.

    s sequence length, b micro-batch, h hidden size, a heads, t tensor-parallel size, sp sequence
    parallelism. 16-bit activations, 1-byte dropout masks, 4h GELU MLP, attention scores stored;
    "selective" recomputes the attention core (drops the 5as/h term), "full" keeps only the
    layer's input (2sbh).
    """
    recompute = check_choice(recompute, RECOMPUTE, "recompute")
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
    recompute = check_choice(recompute, RECOMPUTE, "recompute")
    e = bytes_per_element(check_choice(dtype, PRECISIONS, "dtype"))
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
    per = 16 if check_choice(dtype, PRECISIONS, "dtype") == "fp32" else 14
    return b * s / cp * vocab / tp * per


def production_layer_bytes(cfg: ModelConfig, b: int, s: int, dtype: str = "bf16", tp: int = 1,
                           sp: bool = False, cp: int = 1, recompute: str = "none") -> float:
    """Activation bytes one block of a production Llama stack saves for backward.

    Per token, with e bytes per activation: each fused RMSNorm keeps its input and an fp32 rstd
    (2 x (e d + 4)); the two matmuls that read a norm's output (QKV, and gate/up) keep that input
    (2 e d); FlashAttention keeps q, k, v (kv heads only: grouped-query attention as it is), its
    output, which is also the output projection's input, and an fp32 log-sum-exp per head; the
    fused SwiGLU keeps gate and up and the down projection's input (3 e d_ff). No dropout masks,
    no s x s scores. Tensor parallelism divides heads and d_ff; with sequence parallelism also
    the norms and the matmul inputs, which Megatron stores sharded and all-gathers again in
    backward. Context parallelism divides the tokens; ring attention keeps only the local k and
    v (the ring passes the others again in backward). "full" keeps the block input; "selective"
    (Megatron's: recompute the attention core) drops only the log-sum-exp here, because fused
    attention stores nothing else the core would rebuild. Mixture-of-experts: each token's top_k
    expert inputs and SwiGLU tensors, and fp32 router probabilities. A gpt2-flavoured config
    gets a GELU MLP (its input and output, 2 e d_ff) and LayerNorms costed like the RMSNorms.
    """
    recompute = check_choice(recompute, RECOMPUTE, "recompute")
    e = bytes_per_element(check_choice(dtype, PRECISIONS, "dtype"))
    tok = b * s / cp
    d, ff, hd = cfg.d_model, cfg.d_ff, cfg.head_dim
    h, kv = cfg.n_heads / tp, cfg.n_kv_heads / tp
    seq_div = tp if sp else 1
    if recompute == "full":
        return tok * d * e / seq_div
    norms = (2 * (e * d + RSTD_BYTES) + 2 * e * d) / seq_div
    attn = (2 * h + 2 * kv) * hd * e + (0 if recompute == "selective" else LSE_BYTES * h)
    per_expert = (3 if cfg.flavour == "llama" else 2) * ff / tp * e  # SwiGLU; GELU in, out
    if cfg.is_moe:
        mlp = cfg.top_k * (d * e + per_expert) + 4 * cfg.n_experts
    else:
        mlp = per_expert
    return tok * (norms + attn + mlp)


def head_bytes(cfg: ModelConfig, b: int, s: int, dtype: str, model: str, tp: int = 1,
               sp: bool = False, cp: int = 1) -> float:
    """Activation bytes of the final norm (the head's input included) under each model."""
    model = check_choice(model, ACTIVATION_MODELS, "activations")
    tok, e = b * s / cp, bytes_per_element(check_choice(dtype, PRECISIONS, "dtype"))
    if model == "korthikanti":  # Section 4.3: the final layer norm's input, 4sbh/t with sp
        return 4 * tok * cfg.d_model / tp
    div = tp if sp else 1
    if model == "production":  # fused norm: input and rstd; its output is the head's input
        return tok * (2 * e * cfg.d_model + RSTD_BYTES) / div
    return tok * cfg.d_model * e * (3 if cfg.flavour == "llama" else 2) / div


def layer_bytes(cfg: ModelConfig, b: int, s: int, dtype: str, model: str, tp: int = 1,
                sp: bool = False, cp: int = 1, recompute: str = "none") -> float:
    """One block's saved activations under activation model `model` (see the module docstring)."""
    model = check_choice(model, ACTIVATION_MODELS, "activations")
    if model == "production":
        return production_layer_bytes(cfg, b, s, dtype, tp, sp, cp, recompute)
    if model == "reference":
        return reference_layer_bytes(cfg, b, s, dtype, tp, sp, cp, recompute)
    return korthikanti_layer_bytes(s // cp, b, cfg.d_model, cfg.n_heads, tp, sp, recompute)


def check_choice(value: str, choices: tuple[str, ...], what: str) -> str:
    """`value` if it is one of `choices`, else a ValueError that lists them."""
    if value not in choices:
        raise ValueError(f"{what} {value!r} is unknown; use one of {', '.join(choices)}")
    return value
