"""The reference decoder-only transformer, built from a `ModelConfig`.

One readable file in the spirit of nanoGPT. The "gpt2" flavour is GPT-2 (LayerNorm, learned
positions, GELU, biases, tied embeddings); the "llama" flavour is Llama/Mistral/Mixtral/Qwen2
(RMSNorm, RoPE, SwiGLU, grouped-query attention, optional mixture of experts). Attention goes
through `F.scaled_dot_product_attention`, so it runs the fused kernels on GPU.

The model has seams, so that every parallelism applies to it from outside (as torchtitan's
`parallelize_*` functions do) and none re-implements its forward: `embed_inputs` (tokens and
positions), `blocks`, `project_logits` (final norm and head), the loss as the free function
`lm_loss`, and each attention's `core`, replaceable per instance. `trunk` runs whatever parts a
module holds, so a pipeline stage (`parallel.pipeline.Stage`) is the same class with fewer parts;
tensor parallelism swaps modules, context parallelism passes its shard's positions and core.

Chapter: book/start/first-run (the model); book/parallelism (every technique applies to it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from .configs import ModelConfig

Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin) rows of the rotary tables (llama)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 (Zhang and Sennrich 2019)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_tables(seq_len: int, head_dim: int, theta: float,
                device: torch.device | str | None = None) -> Rope:
    """cos and sin of shape (seq_len, head_dim // 2) for rotary embeddings (Su et al. 2021)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device).float(), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of x: (batch, heads, seq, head_dim), as HF Llama."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[: x.shape[-2]].to(x.dtype), sin[: x.shape[-2]].to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def make_norm(cfg: ModelConfig, dim: int) -> nn.Module:
    """The flavour's normalisation over `dim` features: LayerNorm (gpt2) or RMSNorm (llama)."""
    return nn.LayerNorm(dim, eps=cfg.norm_eps) if cfg.flavour == "gpt2" \
        else RMSNorm(dim, cfg.norm_eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        h, kv, hd, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_model
        gpt2 = cfg.flavour == "gpt2"
        self.q = nn.Linear(d, h * hd, bias=gpt2 or cfg.qkv_bias)
        self.k = nn.Linear(d, kv * hd, bias=gpt2 or cfg.qkv_bias)
        self.v = nn.Linear(d, kv * hd, bias=gpt2 or cfg.qkv_bias)
        self.o = nn.Linear(h * hd, d, bias=gpt2)
        # QK-norm (Dehghani et al. 2023; Wortsman et al. 2023): bounds the attention logits
        self.q_norm = make_norm(cfg, hd) if cfg.qk_norm else None
        self.k_norm = make_norm(cfg, hd) if cfg.qk_norm else None
        self.softmax_scale: float | None = None  # None: 1/sqrt(head_dim); muP uses 1/head_dim

    def forward(self, x: torch.Tensor, rope: Rope | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        hd = self.cfg.head_dim
        # heads = width / head_dim, so the same code runs on a tensor-parallel shard of q, k, v
        q = self.q(x).view(B, T, -1, hd).transpose(1, 2)  # (B, n_heads, T, hd)
        k = self.k(x).view(B, T, -1, hd).transpose(1, 2)  # (B, kv_heads, T, hd)
        v = self.v(x).view(B, T, -1, hd).transpose(1, 2)  # (B, kv_heads, T, hd)
        if self.q_norm is not None:  # per head, before the rotation (as Qwen3)
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        y = self.core(q, k, v)  # (B, n_heads, T, hd)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, n_heads * hd) -> (B, T, d)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention on (batch, heads, time, head_dim); context parallelism replaces it.
        Grouped-query attention (a kv head serves a group of q heads) goes to SDPA as it is
        (`enable_gqa`): no full-size copies of k and v, the same numbers."""
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                              enable_gqa=k.shape[1] != q.shape[1])


class MLP(nn.Module):
    """GELU MLP (gpt2) or SwiGLU MLP (llama, Shazeer 2020)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, ff = cfg.d_model, cfg.d_ff
        self.swiglu = cfg.flavour == "llama"
        if self.swiglu:
            self.gate = nn.Linear(d, ff, bias=False)
            self.up = nn.Linear(d, ff, bias=False)
            self.down = nn.Linear(ff, d, bias=False)
        else:
            self.up = nn.Linear(d, ff)
            self.down = nn.Linear(ff, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.down(F.gelu(self.up(x), approximate="tanh"))


class MoE(nn.Module):
    """Top-k routed mixture of SwiGLU experts (Mixtral): softmax over the chosen k logits."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = nn.ModuleList(MLP(cfg) for _ in range(cfg.n_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (tokens, d)
        weights, chosen = self.router(x).topk(self.top_k, dim=-1)  # (tokens, k) each
        weights = weights.softmax(dim=-1).to(x.dtype)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = (chosen == e).nonzero(as_tuple=True)
            if token.numel():
                out.index_add_(0, token, expert(x[token]) * weights[token, slot, None])
        return out.reshape(shape)  # (B, T, d)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm, self.attn = make_norm(cfg, cfg.d_model), Attention(cfg)
        self.mlp_norm = make_norm(cfg, cfg.d_model)
        self.mlp = MoE(cfg) if cfg.is_moe else MLP(cfg)

    def forward(self, x: torch.Tensor, rope: Rope | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope)
        return x + self.mlp(self.mlp_norm(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean",
            z_loss: float = 0.0) -> torch.Tensor:
    """Next-token cross-entropy in fp32: logits (batch, time, vocab), targets (batch, time).

    The one loss of the reference model: the trainer, the pipeline schedules and every Part 5
    technique use it (tensor parallelism has a vocabulary-parallel version that equals it).
    `z_loss` > 0 adds PaLM's z_loss * log^2 Z per counted token (Z the softmax normaliser),
    which keeps the output logits from drifting (Part 2's loss chapter derives it)."""
    flat = logits.float().reshape(-1, logits.size(-1))
    loss = F.cross_entropy(flat, targets.reshape(-1), reduction=reduction)
    if not z_loss:
        return loss
    counted = (targets.reshape(-1) != -100).float()  # F.cross_entropy's ignore_index
    z = flat.logsumexp(-1).pow(2) * counted
    if reduction == "none":
        return loss + z_loss * z
    z = z.sum() / counted.sum() if reduction == "mean" else z.sum()
    return loss + z_loss * z


class Transformer(nn.Module):
    """Decoder-only language model: forward(idx, targets) -> (logits, mean loss or None)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.flavour == "gpt2" else None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = make_norm(cfg, cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tied:
            self.head.weight = self.embed.weight
        if cfg.flavour == "llama":
            cos, sin = rope_tables(cfg.max_seq_len, cfg.head_dim, cfg.rope_theta)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        else:
            self.rope_cos = self.rope_sin = None
        self.z_loss = 0.0  # the trainer's --z-loss: PaLM's coefficient, in training mode only
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, 0.02), output projections scaled by 1/sqrt(2 n_layers), zero biases."""
        for name, p in self.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0 if name.endswith("weight") else 0.0)  # norm weights / biases
            else:
                out_proj = name.endswith(("o.weight", "down.weight"))
                std = 0.02 / math.sqrt(2 * self.cfg.n_layers) if out_proj else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def embed_inputs(self, idx: torch.Tensor,
                     positions: torch.Tensor | None = None) -> tuple[torch.Tensor, Rope | None]:
        """Token ids (batch, time) -> (hidden states (batch, time, d_model), RoPE tables or None).

        `positions` are the tokens' places in the whole sequence (default 0..time-1); context
        parallelism passes its shard's. Learned positions (gpt2) are added here, rotary ones
        (llama) are returned as (cos, sin) rows for the blocks' attention to apply."""
        x = self.embed(idx)  # (B, T, d)
        if self.cfg.embed_scale != 1.0:
            x = x * self.cfg.embed_scale
        if self.pos is not None:
            x = x + self.pos(positions if positions is not None
                             else torch.arange(idx.shape[1], device=idx.device))
        return x, self.rope_for(positions)

    def rope_for(self, positions: torch.Tensor | None) -> Rope | None:
        """(cos, sin) rows for `positions` (all rows when None: attention slices to its length)."""
        if self.pos is not None or self.rope_cos is None:
            return None
        if positions is None:
            return self.rope_cos, self.rope_sin
        return self.rope_cos[positions], self.rope_sin[positions]  # (T, head_dim / 2) each

    def layers(self) -> Iterable[nn.Module]:
        """The blocks in order (a pipeline stage keeps them keyed by their index in the model)."""
        return self.blocks.values() if isinstance(self.blocks, nn.ModuleDict) else self.blocks

    def project_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and head: (batch, time, d_model) -> logits (batch, time, vocab)."""
        return self.head(self.norm(x))

    def trunk(self, inputs: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Run the parts this module holds: token ids -> logits for a whole model; on a pipeline
        stage, ids or hidden states in (first stage or not), hidden states or logits out."""
        if self.embed is not None:
            T = inputs.shape[1]
            if T > self.cfg.max_seq_len:
                raise ValueError(f"sequence length {T} exceeds max_seq_len {self.cfg.max_seq_len}")
            x, rope = self.embed_inputs(inputs, positions)
        else:
            x, rope = inputs, self.rope_for(positions)
        for block in self.layers():
            x = block(x, rope)
        return x if self.head is None else self.project_logits(x)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits = self.trunk(idx, positions)
        if targets is None:
            return logits, None
        return logits, lm_loss(logits, targets, z_loss=self.z_loss if self.training else 0.0)

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample continuations of idx (batch, time); no KV cache: simple, fine for small models."""
        if temperature <= 0:
            raise ValueError(f"temperature must be positive, got {temperature}")
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.cfg.max_seq_len:])
            logits = logits[:, -1, :].float() / temperature
            if top_k is not None:
                kth = logits.topk(min(top_k, logits.size(-1))).values[:, -1, None]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(logits.softmax(-1), 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx


def count_parameters(model: nn.Module) -> int:
    """Unique parameters (a tied matrix counts once)."""
    return sum(p.numel() for p in model.parameters())
