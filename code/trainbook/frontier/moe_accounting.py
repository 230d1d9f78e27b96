"""Total against active: the parameters and FLOPs of Mixtral 8x7B and DeepSeek-V3 from their
config.json, and the numbers their authors print, recomputed.

Mixtral has the reference model's shape (`configs.from_hf_config`, `configs.param_counts`).
DeepSeek-V3 does not: multi-head latent attention (queries and keys/values through low-rank
projections), three dense layers before 58 MoE layers of 256 routed experts and 1 shared
expert, a router bias per expert, and a multi-token-prediction (MTP) module stored beside the
main model in the checkpoint, in FP8 with a float32 scale per 128 x 128 weight block.
`deepseek_v3_counts` counts all of it by component. The tests check both counts against
transformers' own models, built on the meta device.

The config.json values are written here as dicts (`MIXTRAL_8X7B`: mistralai/Mixtral-8x7B-v0.1;
`DEEPSEEK_V3`: deepseek-ai/DeepSeek-V3, whose architecture fields are also those of
inference/configs/config_671B.json in DeepSeek's GitHub repository); `PUBLISHED` holds what is
printed, with where, and `published_check` recomputes each figure to its printed precision.

Chapter: book/frontier/moe.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from .. import configs
from ..compute.flops import training_flops_per_token

MIXTRAL_8X7B: dict[str, Any] = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 32000,
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
    "num_experts_per_tok": 2, "max_position_embeddings": 32768, "rope_theta": 1e6,
    "rms_norm_eps": 1e-5, "router_aux_loss_coef": 0.02, "output_router_logits": False,
    "sliding_window": None, "tie_word_embeddings": False, "hidden_act": "silu",
    "_name_or_path": "mixtral-8x7b"}

DEEPSEEK_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "first_k_dense_replace": 3, "moe_layer_freq": 1,
    "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8,
    "topk_group": 4, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "seq_aux": True,
    "aux_loss_alpha": 0.001, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
    "num_nextn_predict_layers": 1, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
    "rope_theta": 10000, "tie_word_embeddings": False, "hidden_act": "silu",
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "_name_or_path": "deepseek-v3"}

MODELS = {"mixtral-8x7b": MIXTRAL_8X7B, "deepseek-v3": DEEPSEEK_V3}

# What is printed, as printed, in billions of parameters: (model, quantity, value, where).
# The quantity names the count of `counts()` that reproduces it (see the chapter).
PUBLISHED: list[tuple[str, str, str, str]] = [
    ("mixtral-8x7b", "total", "47", "Jiang et al. 2024, abstract: 'each token has access to 47B "
     "parameters, but only uses 13B active parameters'"),
    ("mixtral-8x7b", "active", "13", "Jiang et al. 2024, abstract"),
    ("mixtral-8x7b", "total", "46.7", "Mistral AI's release announcement and model card: "
     "'46.7B total parameters but only uses 12.9B parameters per token'"),
    ("mixtral-8x7b", "active", "12.9", "Mistral AI's release announcement and model card"),
    ("deepseek-v3", "total", "671", "DeepSeek-V3 technical report, abstract: '671B total "
     "parameters with 37B activated for each token'"),
    ("deepseek-v3", "active_no_embedding", "37", "DeepSeek-V3 technical report, abstract"),
    ("deepseek-v3", "active_no_embedding", "36.6", "DeepSeek-V3 README_WEIGHTS.md (one "
     "revision): main model 'Activation parameters: 36.6B (including 0.9B for the output "
     "Head)'; another revision prints 36.7B 'including 0.9B for Embedding and 0.9B for the "
     "output Head', which no count reproduces"),
    ("deepseek-v3", "checkpoint", "685", "DeepSeek-V3 README: 'The total size of DeepSeek-V3 "
     "models on Hugging Face is 685B, which includes 671B of the Main Model weights and 14B of "
     "the Multi-Token Prediction (MTP) Module weights.'"),
    ("deepseek-v3", "mtp_block", "11.5", "DeepSeek-V3 README_WEIGHTS.md: MTP modules, '11.5B "
     "unique parameters'"),
]


def load(source: str | Path | dict) -> dict:
    """A config.json as a dict: one of MODELS by name, a path, or a dict (returned as is)."""
    if isinstance(source, dict):
        return source
    if str(source) in MODELS:
        return MODELS[str(source)]
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"{str(source)!r} is neither one of {', '.join(MODELS)} nor a "
                         "config.json file: give one of those names, or the path of a "
                         "config.json (or of a folder holding one)")
    try:
        hf = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path} as a config.json: {e}") from None
    if not isinstance(hf, dict) or "model_type" not in hf:
        raise ValueError(f"{path} is not a Hugging Face config.json (no model_type)")
    return hf


def _need(hf: dict, *keys: str) -> list[int]:
    out = []
    for k in keys:
        v = hf.get(k)
        if v is None:
            raise ValueError(f"deepseek_v3 config.json lacks {k}; give the model's whole "
                             "config.json")
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"deepseek_v3 config.json: {k} must be a whole number >= 0, "
                             f"got {v!r}")
        out.append(v)
    return out


def _blocks(rows: int, cols: int, block: tuple[int, int]) -> int:
    return math.ceil(rows / block[0]) * math.ceil(cols / block[1])


def deepseek_v3_counts(hf: dict) -> dict[str, int]:
    """Parameters of a DeepSeek-V3 style config by component, plus "total" (the main model),
    "active" and "active_no_embedding" (per token: 8 routed + the shared expert, the router,
    everything else; without the embedding lookup, which does no FLOPs), "mtp_block" (one MTP
    module's transformer layer), "mtp_unique" (with its eh_proj and norms), "checkpoint" (the
    tensors a checkpoint stores: main model, MTP modules with their own copies of the embedding
    and head, and with FP8 weights their float32 block scales, "fp8_scales")."""
    d, V, L, H, ff, eff = _need(hf, "hidden_size", "vocab_size", "num_hidden_layers",
                                "num_attention_heads", "intermediate_size",
                                "moe_intermediate_size")
    qn, qr, vd, kvr, qlr = _need(hf, "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                                 "kv_lora_rank", "q_lora_rank")
    E, shared, k, dense, mtp = _need(hf, "n_routed_experts", "n_shared_experts",
                                     "num_experts_per_tok", "first_k_dense_replace",
                                     "num_nextn_predict_layers")
    if hf.get("model_type") != "deepseek_v3":
        raise ValueError(f"deepseek_v3_counts reads a deepseek_v3 config.json, got model_type "
                         f"{hf.get('model_type')!r}")
    if hf.get("moe_layer_freq", 1) != 1 or hf.get("tie_word_embeddings"):
        raise ValueError("only moe_layer_freq 1 and untied embeddings are counted here")
    if not 1 <= k <= E or dense > L or min(d, V, L, H, eff) < 1:
        raise ValueError(f"inconsistent config: top_k {k} of {E} experts, {dense} dense of "
                         f"{L} layers")
    # multi-head latent attention: q through a rank-qlr bottleneck (or direct), k/v through kvr
    q_mats = [(qlr, d), (H * (qn + qr), qlr)] if qlr else [(H * (qn + qr), d)]
    mats = q_mats + [(kvr + qr, d), (H * (qn + vd), kvr), (d, H * vd)]
    attn = sum(r * c for r, c in mats) + (qlr + kvr)  # + the q and kv latent norms
    expert = 3 * d * eff
    router = E * d + (E if hf.get("topk_method") == "noaux_tc" else 0)  # + the bias
    moe = (E + shared) * expert + router
    n_moe = L - dense
    c = {"embedding": V * d, "head": V * d, "norms": L * 2 * d + d, "attention": L * attn,
         "dense_mlp": dense * 3 * d * ff, "routed_experts": n_moe * E * expert,
         "shared_experts": n_moe * shared * expert, "router": n_moe * router}
    c["total"] = sum(c.values())
    c["active"] = c["total"] - n_moe * (E - k) * expert
    c["active_no_embedding"] = c["active"] - c["embedding"]
    c["mtp_block"] = attn + 2 * d + moe
    c["mtp_unique"] = c["mtp_block"] + 2 * d * d + 3 * d  # eh_proj; enorm, hnorm, head norm
    c["mtp_active"] = c["mtp_unique"] - (E - k) * expert + V * d  # + the (shared) head
    block = tuple((hf.get("quantization_config") or {}).get("weight_block_size") or ())
    scales = 0
    if block:  # FP8: every attention and MLP matrix has a scale per block (not the router,
        # embeddings, head, or eh_proj)
        per_attn = sum(_blocks(r, cc, block) for r, cc in mats)
        per_expert = 2 * _blocks(eff, d, block) + _blocks(d, eff, block)
        per_dense = 2 * _blocks(ff, d, block) + _blocks(d, ff, block)
        scales = (L + mtp) * per_attn + dense * per_dense \
            + (n_moe + mtp) * (E + shared) * per_expert
    c["fp8_scales"] = scales
    c["checkpoint"] = c["total"] + mtp * (c["mtp_unique"] + 2 * V * d) + scales
    return c


def counts(source: str | Path | dict) -> dict[str, int]:
    """Parameter counts of a config.json: DeepSeek-V3 style by `deepseek_v3_counts`, any model
    the reference config reads (Mixtral, Llama, Qwen, ...) by `configs.param_counts`, with
    "active_no_embedding" added."""
    hf = load(source)
    if hf.get("model_type") == "deepseek_v3":
        return deepseek_v3_counts(hf)
    c = dict(configs.param_counts(configs.from_hf_config(hf)))
    c["active_no_embedding"] = c["active"] - c["embedding"]
    return c


def flops_per_token(source: str | Path | dict, seq_len: int = 4096) -> dict[str, float]:
    """Training FLOPs per token (forward and backward, matmuls): "moe" for the model as it runs
    (6 N_active + attention over the full seq_len square), "dense_equivalent" for a dense model
    with every parameter active, and their ratio. DeepSeek-V3's attention multiplies queries by
    keys of width qk_nope + qk_rope and weights by values of width v_head, per head; the MTP
    module is left out (it runs in training only)."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a whole number >= 1, got {seq_len!r}")
    hf = load(source)
    c = counts(hf)
    inactive = c["total"] - c["active"]
    if hf.get("model_type") == "deepseek_v3":
        L, H = hf["num_hidden_layers"], hf["num_attention_heads"]
        qk, v = hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"], hf["v_head_dim"]
        moe = 6 * c["active_no_embedding"] + 6 * L * seq_len * H * (qk + v)
    else:
        moe = training_flops_per_token(configs.from_hf_config(hf), seq_len)
    return {"moe": float(moe), "dense_equivalent": float(moe + 6 * inactive),
            "ratio": (moe + 6 * inactive) / moe}


def hf_param_count(source: str | Path | dict) -> int:
    """The parameters of transformers' own model for a mixtral or deepseek_v3 config.json, built
    on the meta device (no memory), plus DeepSeek-V3's router biases (a buffer there): what
    `counts(...)["total"]` must equal."""
    import torch
    import transformers

    hf = load(source)
    kinds = {"mixtral": "Mixtral", "deepseek_v3": "DeepseekV3"}
    if hf.get("model_type") not in kinds:
        raise ValueError(f"hf_param_count builds {' or '.join(kinds)} models, got model_type "
                         f"{hf.get('model_type')!r}")
    kind = kinds[hf["model_type"]]
    keys = {k: v for k, v in hf.items() if not k.startswith("_")
            and k not in ("architectures", "model_type", "quantization_config")}
    with torch.device("meta"):
        model = getattr(transformers, f"{kind}ForCausalLM")(
            getattr(transformers, f"{kind}Config")(**keys))
    biases = sum(b.numel() for n, b in model.named_buffers() if "correction_bias" in n)
    return sum(p.numel() for p in model.parameters()) + biases


def published_check(models: list[str] | tuple[str, ...] = tuple(MODELS)) -> list[dict]:
    """Every PUBLISHED figure of `models` next to our count in billions, rounded to the printed
    number of decimals, and whether they agree."""
    unknown = set(models) - set(MODELS)
    if unknown:
        raise ValueError(f"no published figures for {sorted(unknown)}; choose from "
                         f"{', '.join(MODELS)}")
    out, cache = [], {}
    for model, quantity, printed, where in PUBLISHED:
        if model not in models:
            continue
        ours = cache.setdefault(model, counts(model))[quantity] / 1e9
        decimals = len(printed.partition(".")[2])
        out.append({"model": model, "quantity": quantity, "printed (B)": printed,
                    "ours (B)": ours, "ours, as printed": f"{ours:.{decimals}f}",
                    "agrees": f"{ours:.{decimals}f}" == printed, "where": where})
    return out
