"""Model configurations: one `ModelConfig` for every decoder-only transformer in the book.

Two flavours share one config. "gpt2": LayerNorm, learned positions, GELU MLP, biases, tied
embeddings. "llama": RMSNorm, RoPE, SwiGLU MLP, grouped-query attention, untied head, and,
with `n_experts > 1`, a mixture-of-experts MLP (Mixtral). `param_counts` is the analytic
parameter count by component; `trainbook.model.Transformer` instantiates exactly that many.

Chapter: book/compute/flops.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

FLAVOURS = ("gpt2", "llama")


@dataclass(frozen=True)
class ModelConfig:
    name: str
    flavour: str  # "gpt2" or "llama"
    vocab_size: int
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int | None = None  # None: same as n_heads (multi-head attention)
    d_ff: int | None = None  # None: 4 * d_model
    head_dim: int | None = None  # None: d_model // n_heads
    max_seq_len: int = 1024
    tie_embeddings: bool | None = None  # None: True for gpt2, False for llama
    qkv_bias: bool = False  # bias on q, k, v only (Qwen2); gpt2 has biases everywhere
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    n_experts: int = 1  # > 1: mixture-of-experts MLP
    top_k: int = 1  # experts per token
    qk_norm: bool = False  # normalise q and k per head before attention (Qwen3, OLMo 2, ViT-22B)
    embed_scale: float = 1.0  # multiplier on the token embeddings (Gemma: sqrt(d_model))
    # which of n_kv_heads, d_ff, head_dim were left to their defaults (and so follow `with_`)
    _derived: frozenset = field(init=False, repr=False, compare=False, default=frozenset())

    def __post_init__(self):
        """Validate, then resolve the defaults: after construction n_kv_heads, d_ff and
        head_dim are always whole numbers (one name per quantity, no None to test)."""
        def need(ok: bool, msg: str):
            if not ok:
                raise ValueError(f"config {self.name!r}: {msg}")

        need(self.flavour in FLAVOURS,
             f"flavour {self.flavour!r} is unknown; use one of {FLAVOURS}")
        for f in ("vocab_size", "n_layers", "d_model", "n_heads", "max_seq_len", "n_experts",
                  "top_k"):
            v = getattr(self, f)
            need(isinstance(v, int) and not isinstance(v, bool) and v > 0,
                 f"{f} must be a positive integer, got {v!r}")
        for f in ("n_kv_heads", "d_ff", "head_dim"):
            v = getattr(self, f)
            need(v is None or (isinstance(v, int) and not isinstance(v, bool) and v > 0),
                 f"{f} must be a positive integer or None, got {v!r}")
        if self.head_dim is None:
            need(self.d_model % self.n_heads == 0,
                 f"hidden size {self.d_model} is not divisible by {self.n_heads} heads; "
                 "change n_heads or d_model, or set head_dim explicitly")
        kv_heads = self.n_kv_heads or self.n_heads
        need(self.n_heads % kv_heads == 0,
             f"{kv_heads} kv heads do not divide {self.n_heads} query heads; "
             "grouped-query attention needs n_heads to be a multiple of n_kv_heads")
        need(self.top_k <= self.n_experts,
             f"top_k {self.top_k} is larger than the number of experts {self.n_experts}")
        need(self.norm_eps > 0, f"norm_eps must be positive, got {self.norm_eps}")
        need(isinstance(self.embed_scale, (int, float)) and 0 < self.embed_scale < float("inf"),
             f"embed_scale must be a positive number, got {self.embed_scale!r}")
        if self.flavour == "gpt2":
            need(kv_heads == self.n_heads, "the gpt2 flavour has no grouped-query attention; "
                 "set n_kv_heads to n_heads or use the llama flavour")
            need(self.n_experts == 1, "the gpt2 flavour has no mixture of experts; use llama")
            need(self.head_dim is None or self.head_dim * self.n_heads == self.d_model,
                 "the gpt2 flavour needs head_dim * n_heads == d_model")
        else:
            head = self.head_dim or self.d_model // self.n_heads
            need(head % 2 == 0, f"RoPE needs an even head dimension, got {head}")
            need(self.rope_theta > 0, f"rope_theta must be positive, got {self.rope_theta}")
        defaults = {"n_kv_heads": self.n_heads, "d_ff": 4 * self.d_model,
                    "head_dim": self.d_model // self.n_heads}
        derived = frozenset(k for k in defaults if getattr(self, k) is None)
        for k in derived:
            object.__setattr__(self, k, defaults[k])
        object.__setattr__(self, "_derived", derived)

    @property
    def tied(self) -> bool:
        return self.flavour == "gpt2" if self.tie_embeddings is None else self.tie_embeddings

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 1

    def with_(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (validated again). Sizes that were defaults are
        derived again: `with_(d_model=256)` of a config without an explicit d_ff gets 1024."""
        return replace(self, **{**{k: None for k in self._derived}, **changes})

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "_derived"}


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """Exact parameter counts by component, plus total, non-embedding and active per token.

    non_embedding leaves out every vocabulary- or position-sized matrix (token embedding,
    learned positions, an untied output head), as Kaplan et al. 2020 do. active counts the
    parameters one token touches: for a mixture of experts, top_k of the n_experts MLPs.
    """
    d, h, kv, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    ff, L = cfg.d_ff, cfg.n_layers
    gpt2 = cfg.flavour == "gpt2"
    norm = 2 * d if gpt2 else d  # LayerNorm has weight and bias; RMSNorm a weight only

    q, k_or_v, o = d * h * hd, d * kv * hd, h * hd * d
    attn = q + 2 * k_or_v + o
    if gpt2:
        attn += 3 * h * hd + d  # biases of qkv and of the output projection
    elif cfg.qkv_bias:
        attn += h * hd + 2 * kv * hd

    if gpt2:
        expert = d * ff + ff + ff * d + d  # fc (+bias), proj (+bias)
    else:
        expert = 3 * d * ff  # gate, up, down (SwiGLU)
    router = d * cfg.n_experts if cfg.is_moe else 0
    mlp = cfg.n_experts * expert + router

    if cfg.qk_norm:  # one norm over head_dim for q and one for k, shared by the heads
        attn += 2 * (2 * hd if gpt2 else hd)
    counts = {
        "embedding": cfg.vocab_size * d,
        "position": cfg.max_seq_len * d if gpt2 else 0,
        "attention": L * attn,
        "mlp": L * mlp,
        "norms": L * 2 * norm + norm,  # two per block plus the final norm
        "head": 0 if cfg.tied else cfg.vocab_size * d,
    }
    counts["total"] = sum(counts.values())
    counts["non_embedding"] = (counts["total"] - counts["embedding"] - counts["position"]
                               - counts["head"])
    counts["active"] = counts["total"] - L * (cfg.n_experts - cfg.top_k) * expert
    return counts


def check_seq_len(cfg: ModelConfig, seq_len: int) -> int:
    """seq_len, if the model can run it: learned positions (gpt2 flavour) end at max_seq_len."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be >= 1 and a whole number (--seq-len), got {seq_len!r}")
    if cfg.flavour == "gpt2" and seq_len > cfg.max_seq_len:
        raise ValueError(f"sequence length {seq_len} exceeds {cfg.name}'s {cfg.max_seq_len} "
                         "learned positions; use a shorter sequence")
    return seq_len


def _llama(name, vocab, layers, d, heads, kv, ff, seq, theta=10000.0, eps=1e-5, **kw):
    return ModelConfig(name, "llama", vocab, layers, d, heads, kv, ff, max_seq_len=seq,
                       rope_theta=theta, norm_eps=eps, **kw)


def _gpt2(name, d, layers, heads, vocab=50257, seq=1024):
    return ModelConfig(name, "gpt2", vocab, layers, d, heads, max_seq_len=seq)


PRESETS: dict[str, ModelConfig] = {
    c.name: c
    for c in [
        # GPT-2: Radford et al. 2019, Table 2; released checkpoints' config.json.
        _gpt2("gpt2", 768, 12, 12),
        _gpt2("gpt2-medium", 1024, 24, 16),
        _gpt2("gpt2-large", 1280, 36, 20),
        _gpt2("gpt2-xl", 1600, 48, 25),
        # Llama 2: Touvron et al. 2023, Table 1 and the released config.json files.
        _llama("llama-2-7b", 32000, 32, 4096, 32, 32, 11008, 4096),
        _llama("llama-2-13b", 32000, 40, 5120, 40, 40, 13824, 4096),
        _llama("llama-2-70b", 32000, 80, 8192, 64, 8, 28672, 4096),
        # Llama 3 / 3.1: Dubey et al. 2024, Table 3 and the released config.json files.
        _llama("llama-3-8b", 128256, 32, 4096, 32, 8, 14336, 8192, theta=500000.0),
        _llama("llama-3-70b", 128256, 80, 8192, 64, 8, 28672, 8192, theta=500000.0),
        _llama("llama-3-405b", 128256, 126, 16384, 128, 8, 53248, 8192, theta=500000.0),
        # Mistral 7B (Jiang et al. 2023, Table 1) and Mixtral 8x7B (Jiang et al. 2024, Table 1).
        _llama("mistral-7b", 32000, 32, 4096, 32, 8, 14336, 32768),
        _llama("mixtral-8x7b", 32000, 32, 4096, 32, 8, 14336, 32768, theta=1e6,
               n_experts=8, top_k=2),
        # Tiny presets that train in seconds on a laptop CPU. The vocabulary is the
        # tokenizer's; set it with cfg.with_(vocab_size=tokenizer.vocab_size).
        _gpt2("tiny-gpt2", 128, 4, 4, vocab=512, seq=256),
        _llama("tiny-llama", 512, 4, 128, 4, 2, 352, 256),
        _llama("tiny-mixtral", 512, 4, 128, 4, 2, 176, 256, n_experts=4, top_k=2),
    ]
}


def get(name: str) -> ModelConfig:
    """A named preset ('llama-3-8b', 'gpt2', 'tiny-llama', ...)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; presets: {', '.join(PRESETS)} "
                         "(or pass a path to a Hugging Face config.json)")
    return PRESETS[name]


_HF_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "gpt2")


def from_hf_config(source: str | Path | dict, name: str | None = None) -> ModelConfig:
    """Build a ModelConfig from a Hugging Face config.json (path or dict); no transformers
    needed."""
    if isinstance(source, dict):
        hf, name = source, name or source.get("_name_or_path") or "hf-config"
    else:
        path = Path(source)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(f"no config.json at {str(source)!r}; pass a file or a model folder")
        try:
            hf = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
        name = name or hf.get("_name_or_path") or path.parent.name or "hf-config"
    kind = hf.get("model_type")
    if kind not in _HF_TYPES:
        raise ValueError(f"model_type {kind!r} is not supported; supported: {', '.join(_HF_TYPES)}")

    def field(*keys, default=None):
        for k in keys:
            if hf.get(k) is not None:
                return hf[k]
        if default is None:
            raise ValueError(f"{kind} config.json lacks {' or '.join(keys)}")
        return default

    if kind == "gpt2":
        if hf.get("n_inner") not in (None, 4 * hf.get("n_embd", 0)):
            raise ValueError("gpt2 configs with n_inner != 4 * n_embd are not supported")
        return ModelConfig(name, "gpt2", field("vocab_size"), field("n_layer"), field("n_embd"),
                           field("n_head"), max_seq_len=field("n_positions", "n_ctx"),
                           norm_eps=field("layer_norm_epsilon", default=1e-5),
                           tie_embeddings=hf.get("tie_word_embeddings", True))
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ValueError("attention_bias/mlp_bias in a llama-style config are not supported")
    return ModelConfig(
        name, "llama", field("vocab_size"), field("num_hidden_layers"), field("hidden_size"),
        field("num_attention_heads"), n_kv_heads=hf.get("num_key_value_heads"),
        d_ff=field("intermediate_size"), head_dim=hf.get("head_dim"),
        max_seq_len=field("max_position_embeddings"),
        tie_embeddings=hf.get("tie_word_embeddings", False), qkv_bias=kind == "qwen2",
        norm_eps=field("rms_norm_eps", default=1e-5),
        # transformers v5 writes theta inside rope_parameters; v4 configs have it at the top
        rope_theta=float((hf.get("rope_parameters") or {}).get("rope_theta")
                         or field("rope_theta", default=1e4)),
        n_experts=hf.get("num_local_experts") or 1, top_k=hf.get("num_experts_per_tok") or 1,
        qk_norm=kind == "qwen3",
    )


def resolve(model: str | Path | ModelConfig) -> ModelConfig:
    """A preset name, a path to a config.json, or a ModelConfig -> ModelConfig."""
    if isinstance(model, ModelConfig):
        return model
    if str(model) in PRESETS:
        return PRESETS[str(model)]
    if Path(model).exists() or str(model).endswith(".json") or "/" in str(model):
        return from_hf_config(model)  # a path: says clearly when the file is missing
    return get(str(model))  # raises with the list of presets
