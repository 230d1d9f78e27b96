"""Training FLOPs of a transformer from its config."""

from __future__ import annotations

from ..configs import ModelConfig, param_counts


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
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    return 6 * matmul_params(cfg) + 12 * cfg.n_layers * cfg.n_heads * cfg.dim_head * seq_len
