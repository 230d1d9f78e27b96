"""Training FLOPs of a transformer from its config, and the published formulas that count them.

One multiply-add is 2 FLOPs, so a matmul of (m, k) by (k, n) costs 2mkn. A token's forward pass
through a weight matrix of P entries costs 2P; the backward pass computes the gradient with
respect to the input and to the weight, two matmuls of the same size, 4P. That is the 6N rule.
Everything here counts matmul FLOPs only: norms, softmax, activations and the optimizer are a few
percent at most and are left out by every convention below (Chinchilla's softmax term aside).

- `forward_flops(cfg, T)`: exact matmul FLOPs of one sequence through `trainbook.model.Transformer`,
  by component; `training_flops(cfg, T, recompute)` adds the backward pass and recomputation.
  `measure_flops` counts the real model with `torch.utils.flop_counter.FlopCounterMode`.
- `training_flops_per_token` (PaLM's 6N + 12LHQT) and `kaplan_forward_flops_per_token`.
- `chinchilla_forward_flops` (Hoffmann et al. 2022, Appendix F) and its parameter count.
- `megatron_flops` / `megatron_params` (Narayanan et al. 2021; Korthikanti et al. 2022, App. A).
- `utilization`: MFU (model FLOPs) or HFU (hardware FLOPs, recomputation included).

Chapter: book/compute/flops.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from numbers import Integral
from typing import TYPE_CHECKING

from ..configs import ModelConfig, param_counts

if TYPE_CHECKING:
    import torch

RECOMPUTE = ("none", "selective", "full")
ATTENTION_CORE = ("attn_scores", "attn_values")  # the T x T matmuls: what selective recomputes


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
        raise ValueError(f"{name} must be >= 1 and a whole number, got {value!r}")
    return int(value)


def _check_recompute(recompute: str) -> str:
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute {recompute!r} is unknown; use one of {', '.join(RECOMPUTE)}")
    return recompute


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters one token multiplies through: active non-embedding weights plus the output head.

    The embedding lookup and learned positions do no FLOPs; the logits matmul does (2 * V * d
    per token forward), tied or not. Norm and bias parameters are included, as in 6N.
    """
    c = param_counts(cfg)
    return c["active"] - c["embedding"] - c["position"] - c["head"] + cfg.vocab_size * cfg.d_model


def training_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """6N + 12 * L * H * Q * T FLOPs per token for forward plus backward (PaLM, Chowdhery et al.
    2022, Appendix B). N counts matmul parameters; the attention term counts QK^T and AV over the
    full T x T square (no causal discount), as PaLM does for MFU."""
    seq_len = _positive_int("seq_len", seq_len)
    return 6 * matmul_params(cfg) + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len


def forward_flops(cfg: ModelConfig, seq_len: int, causal: bool = False) -> dict[str, int]:
    """Exact matmul FLOPs of one sequence of `seq_len` tokens through the reference model's
    forward pass, by component (all layers summed), plus "total".

    Grouped-query attention shrinks the K and V projections, not the T x T matmuls (every query
    head still attends). A mixture of experts runs each token through exactly top_k experts, so
    its MLP FLOPs are top_k times one expert's, plus the router. `causal=False` counts the full
    T x T square of QK^T and AV, as the math SDPA kernel computes it (and FlopCounterMode counts
    it); `causal=True` counts only the T(T+1)/2 query-key pairs a causal mask keeps, the work a
    block-skipping kernel (FlashAttention) can get close to.
    """
    T = _positive_int("seq_len", seq_len)
    d, h, kv, hd, L = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.n_layers
    pairs = T * (T + 1) // 2 if causal else T * T  # query-key pairs per head
    mats_per_expert = 3 if cfg.flavour == "llama" else 2  # SwiGLU gate/up/down vs fc/proj
    out = {
        "attn_qkv": L * 2 * T * d * (h + 2 * kv) * hd,
        "attn_scores": L * 2 * pairs * h * hd,  # Q K^T
        "attn_values": L * 2 * pairs * h * hd,  # softmax(.) V
        "attn_out": L * 2 * T * h * hd * d,
        "mlp": L * cfg.top_k * mats_per_expert * 2 * T * d * cfg.d_ff,
        "router": L * 2 * T * d * cfg.n_experts if cfg.is_moe else 0,
        "logits": 2 * T * d * cfg.vocab_size,
    }
    out["total"] = sum(out.values())
    return out


def training_flops(cfg: ModelConfig, seq_len: int, recompute: str = "none",
                   causal: bool = False) -> dict[str, int]:
    """Matmul FLOPs of one sequence's forward + backward pass, by component, with recomputation.

    Backward is exactly 2x forward for every matmul (input gradient and weight gradient).
    "selective" recomputes the attention core (QK^T and AV) once more in the backward pass, as in
    Korthikanti et al. 2022; "full" recomputes every transformer block's forward (activation
    checkpointing per block), but not the output head: 4x forward for blocks, 3x for logits.
    These are hardware FLOPs; model FLOPs are the "none" count whatever the run does.
    """
    _check_recompute(recompute)
    fwd = forward_flops(cfg, seq_len, causal)
    out = {}
    for name, f in fwd.items():
        if name == "total":
            continue
        extra = f if (recompute == "full" and name != "logits") or \
            (recompute == "selective" and name in ATTENTION_CORE) else 0
        out[name] = 3 * f + extra
    out["total"] = sum(out.values())
    return out


def kaplan_forward_flops_per_token(cfg: ModelConfig, n_ctx: int) -> int:
    """Kaplan et al. 2020, Table 1: C_forward = 2N + 2 n_layer n_ctx d_attn per token.

    N is Kaplan's non-embedding parameter count (no embedding, positions or output head, so no
    logits FLOPs either), of the experts a token visits for a mixture of experts. The attention
    term is half of the full-square QK^T + AV count, what a causal mask does on average.
    Training is about 3x this.
    """
    n_ctx = _positive_int("n_ctx", n_ctx)
    n = matmul_params(cfg) - cfg.vocab_size * cfg.d_model  # active, non-embedding
    return 2 * n + 2 * cfg.n_layers * n_ctx * cfg.n_heads * cfg.head_dim


# --- Chinchilla (Hoffmann et al. 2022), Appendix F ----------------------------------------------

def chinchilla_forward_flops(n_layers: int, d_model: int, ffw_size: int, n_heads: int,
                             kq_size: int, seq_len: int, vocab_size: int) -> dict[str, int]:
    """Forward FLOPs of one sequence by Appendix F's rules, by term, plus "total" (everything)
    and "total_no_embeddings" (without the embedding and final-logits terms).

    Appendix F charges the embedding as a matmul (2 S V d) and counts softmax (3 H S^2). Table
    A4's ratios reproduce only with the embedding and logits terms left out (see the tests).
    """
    L, d, f, H, k, S, V = (_positive_int(n, v) for n, v in [
        ("n_layers", n_layers), ("d_model", d_model), ("ffw_size", ffw_size),
        ("n_heads", n_heads), ("kq_size", kq_size), ("seq_len", seq_len),
        ("vocab_size", vocab_size)])
    kh = k * H
    out = {
        "embeddings": 2 * S * V * d,
        "attn_qkv": L * 2 * 3 * S * d * kh,
        "attn_logits": L * 2 * S * S * kh,
        "attn_softmax": L * 3 * H * S * S,
        "attn_reduce": L * 2 * S * S * kh,
        "attn_out": L * 2 * S * kh * d,
        "dense": L * 2 * S * (d * f + d * f),
        "logits": 2 * S * d * V,
    }
    out["total"] = sum(out.values())
    out["total_no_embeddings"] = out["total"] - out["embeddings"] - out["logits"]
    return out


def chinchilla_params(n_layers: int, d_model: int, ffw_size: int, n_heads: int, kq_size: int,
                      vocab_size: int = 32000) -> int:
    """Parameter count of Hoffmann et al.'s models (Gopher architecture): attention and MLP
    weights, one relative-position projection (d x H k) per layer (Transformer-XL style
    positions, as in Gopher), and one vocabulary matrix. Matches their Table A9 within 0.5%
    for the Table A4 models; it is the N their Table A4 divides by."""
    L, d, f, kh = n_layers, d_model, ffw_size, n_heads * kq_size
    return L * (4 * d * kh + 2 * d * f) + L * d * kh + vocab_size * d


# --- Megatron-LM (Narayanan et al. 2021; Korthikanti et al. 2022) ------------------------------

def megatron_params(n_layers: int, hidden: int, vocab_size: int, seq_len: int) -> float:
    """P = 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h)) (Narayanan et al. 2021, Section 5.1):
    a GPT-2-style model with 4h MLP, biases, LayerNorms, learned positions, tied embeddings
    (the final LayerNorm's 2h is left out)."""
    l, h = _positive_int("n_layers", n_layers), _positive_int("hidden", hidden)
    V, s = _positive_int("vocab_size", vocab_size), _positive_int("seq_len", seq_len)
    return 12 * l * h**2 * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))


def megatron_flops(batch: int, seq_len: int, n_layers: int, hidden: int, vocab_size: int,
                   recompute: str = "full") -> float:
    """FLOPs per iteration of a GPT-style model (B sequences of s tokens), Megatron's formulas:

    - "none":      72 B s l h^2 (1 + s/(6h) + V/(12 l h))  model FLOPs (Korthikanti, App. A)
    - "selective": 72 B s l h^2 (1 + s/(3h) + V/(12 l h))  hardware FLOPs with selective
      recomputation as Korthikanti et al. count them (it reproduces their Table 5 HFU)
    - "full":      96 B s l h^2 (1 + s/(6h) + V/(16 l h))  (Narayanan et al. 2021, eq. 3)

    "none" and "full" equal `training_flops` of the matching gpt2-flavour config exactly. The
    paper's "selective" charges the recomputed attention core at 12 B s^2 h per layer, three
    times the 4 B s^2 h an extra forward of QK^T and AV costs, so it sits above ours.
    """
    _check_recompute(recompute)
    B, s = _positive_int("batch", batch), _positive_int("seq_len", seq_len)
    l, h = _positive_int("n_layers", n_layers), _positive_int("hidden", hidden)
    V = _positive_int("vocab_size", vocab_size)
    if recompute == "full":
        return 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))
    attn = s / (3 * h) if recompute == "selective" else s / (6 * h)
    return 72 * B * s * l * h**2 * (1 + attn + V / (12 * l * h))


def utilization(flops: float, seconds: float, peak_flops: float, n_devices: int = 1) -> float:
    """Achieved FLOP/s over peak: MFU when `flops` are model FLOPs (no recomputation), HFU when
    they are hardware FLOPs (recomputation included). `peak_flops` is per device, in FLOP/s,
    e.g. `trainbook.hardware.get("a100-80gb").peak_flops("bf16")`."""
    for name, v in (("flops", flops), ("seconds", seconds), ("peak_flops", peak_flops)):
        if not v > 0:
            raise ValueError(f"{name} must be positive, got {v!r}")
    return flops / (seconds * peak_flops * _positive_int("n_devices", n_devices))


# --- Measurement -------------------------------------------------------------------------------

_LEAF_COMPONENT = {"q": "attn_qkv", "k": "attn_qkv", "v": "attn_qkv", "o": "attn_out",
                   "gate": "mlp", "up": "mlp", "down": "mlp", "router": "router", "head": "logits"}


@contextmanager
def recomputing(model: torch.nn.Module, early_stop: bool = False) -> Iterator[torch.nn.Module]:
    """Full activation recomputation for the duration: every block of the reference model runs
    under `torch.utils.checkpoint` (non-reentrant), so backward recomputes its forward.

    PyTorch stops a recomputation as soon as the saved tensors backward needs are rebuilt
    (`early_stop=True`, its default): the output of a block's last matmul (the MLP's down
    projection) is never needed, so that matmul is skipped. `early_stop=False` redoes it all,
    the "one extra forward" of Megatron's 96 B s l h^2 formula.
    """
    import torch
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    class Checkpointed(torch.nn.Module):
        def __init__(self, block):
            super().__init__()
            self.block = block

        def forward(self, x, rope=None):
            return checkpoint(self.block, x, rope, use_reentrant=False)

    blocks = model.blocks
    model.blocks = torch.nn.ModuleList(Checkpointed(b) for b in blocks)
    try:
        with set_checkpoint_early_stop(early_stop):
            yield model
    finally:
        model.blocks = blocks


def measure_flops(model: torch.nn.Module, idx: torch.Tensor, backward: bool = True,
                  recompute: str = "none", early_stop: bool = False) -> dict[str, int]:
    """FLOPs `torch.utils.flop_counter.FlopCounterMode` counts for the reference model on `idx`
    (batch, seq): forward, plus the backward of the cross-entropy when `backward`.

    Returns "total", "attention" (batched matmuls: QK^T and AV, forward and backward) and
    "linear" (every nn.Linear), and, for a forward pass only, the `forward_flops` components
    (the counter's per-module attribution of backward FLOPs is not reliable, its per-op one is).
    Attention runs on the math SDPA backend: FlopCounterMode has no formula for the CPU flash
    kernel (aten._scaled_dot_product_flash_attention_for_cpu) and would count zero; the math
    kernel computes the full T x T square and masks it, so this matches `forward_flops(cfg, T)`.
    recompute="full" runs the model under `recomputing(model, early_stop)`.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    if recompute not in ("none", "full"):
        raise ValueError(f"measure_flops supports recompute 'none' or 'full', got {recompute!r}")
    if recompute == "full" and not backward:
        raise ValueError("recompute='full' only changes the backward pass; pass backward=True")
    counter = FlopCounterMode(display=False, depth=100)
    with ExitStack() as stack:
        if recompute == "full":
            stack.enter_context(recomputing(model, early_stop))
        with sdpa_kernel(SDPBackend.MATH), counter:
            _, loss = model(idx, idx if backward else None)  # any targets do
            if backward:
                loss.backward()
    model.zero_grad(set_to_none=True)  # leave no gradients behind
    counts = counter.get_flop_counts()
    by_op = {str(op): n for op, n in counts["Global"].items()}
    out = {"total": counter.get_total_flops(), "attention": by_op.get("aten.bmm", 0)}
    out["linear"] = out["total"] - out["attention"]
    if not backward:  # per component, from the module each matmul ran in
        comp = dict.fromkeys(["attn_qkv", "attn_core", "attn_out", "mlp", "router", "logits"], 0)
        for path, ops in counts.items():
            leaf = path.split(".")[-1]
            if leaf in _LEAF_COMPONENT:
                comp[_LEAF_COMPONENT[leaf]] += sum(ops.values())
        comp["attn_core"] = out["attention"]
        out.update(comp)
    return out
