"""The reference model to a Hugging Face folder and back: what people fine-tune and evaluate is a
transformers checkpoint, so the book's models must become one and come back from one exactly.

`export` writes `config.json` and `model.safetensors` (transformers' own `save_pretrained` of
the same weights in `GPT2LMHeadModel`, `LlamaForCausalLM`, `Qwen3ForCausalLM` or, with q/k/v
biases, `Qwen2ForCausalLM`; `trainbook.bench.hf` maps the names), the tokenizer files
(`align.hf_tokenizer`: `tokenizer.json`, `tokenizer_config.json`, with the chat template for the
chat tokenizer) and `generation_config.json` (which token ends a turn).
`transformers.AutoModelForCausalLM` then loads the folder with the same logits (fp32, 1e-5;
`logit_gap` measures it).

`import_hf` reads such a folder, ours or anyone's: a Llama, Mistral, Qwen2, Qwen3 or GPT-2
checkpoint on local disk (one `model.safetensors` or shards with their index), and returns the
reference `Transformer` with its weights. The weight map is the inverse of
`bench.hf._hf_weights`, derived from it rather than written twice: on a model built on the meta
device, each transformers tensor is one of our parameters (Llama names), its transpose (GPT-2's
Conv1D stores (in, out)) or, for GPT-2's fused `c_attn`, q, k and v stacked. What the reference
model cannot compute is refused with the reason, before any weight is read: mixture of experts,
RoPE scaling (Llama 3.1's "llama3", YaRN, linear, dynamic), activations other than SiLU/tanh-GELU,
biases outside Qwen2's q/k/v, GPT-2's per-layer attention scaling. A sliding window (Mistral,
Qwen2) is not refused: attention within a window of W tokens equals full causal attention on any
sequence of at most W tokens, so the import caps the context at W and is exact wherever it runs.

Chapter: book/alignment/evaluation
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from .. import configs
from ..bench import hf as bench_hf
from ..configs import ModelConfig
from ..model import Transformer
from . import task
from .hf_tokenizer import as_folder, hf_tokenizer, save_tokenizer

# What the import maps; configs.from_hf_config also reads mixtral, but its experts are not mapped.
IMPORTABLE = ("llama", "mistral", "qwen2", "qwen3", "gpt2")
LLAMA_ACT = "silu"  # SwiGLU's gate: the reference model's only llama-flavour activation
GPT2_ACTS = ("gelu_new", "gelu_pytorch_tanh")  # both are F.gelu(approximate="tanh"), ours
ROPE_DEFAULT = "default"  # transformers v5 `rope_parameters["rope_type"]` of plain RoPE
# tensors of older checkpoints that are not weights (attention mask buffers, RoPE tables)
NOT_WEIGHTS = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")
WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"


# ---------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------

def hf_model(model: Transformer) -> nn.Module:
    """A transformers causal LM holding a copy of `model`'s weights: `bench.hf.to_hf`, plus
    Qwen2 (Llama with biases on q, k and v only) which bench.hf refuses to time."""
    if not isinstance(model, Transformer):
        raise ValueError(f"export takes the reference Transformer, got {type(model).__name__}")
    cfg = model.cfg
    if not (cfg.qkv_bias and cfg.flavour == "llama" and not cfg.qk_norm):
        return bench_hf.to_hf(model)
    tf = bench_hf.require_transformers()
    llama = bench_hf.hf_config(cfg.with_(qkv_bias=False)).to_dict()
    keep = set(tf.Qwen2Config().to_dict()) - {"layer_types", "architectures", "model_type"}
    hf_cfg = tf.Qwen2Config(**{k: v for k, v in llama.items() if k in keep},
                            use_sliding_window=False)
    ref = next(model.parameters())
    hf = tf.Qwen2ForCausalLM(hf_cfg).to(device=ref.device, dtype=ref.dtype)
    weights = bench_hf._hf_weights(model)
    for i, b in enumerate(model.blocks):
        for n in "qkv":
            weights[f"model.layers.{i}.self_attn.{n}_proj.bias"] = getattr(b.attn, n).bias
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(weights[name])
    return hf.train()


def export(model: Transformer, out: str | Path, tokenizer: object | None = None) -> list[Path]:
    """Write `model` (and its tokenizer, if given) as a Hugging Face folder; returns the files.

    The folder must be new or empty, so that no stale shard or tokenizer can mix in. With the
    chat tokenizer the config and generation config name `<|bos|>`, `<|eos|>` and `<|pad|>`,
    so `generate` stops at the end of a turn."""
    out = as_folder(out, "out")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not an empty folder; give a new folder")
    if tokenizer is not None:
        vocab = hf_tokenizer(tokenizer).get_vocab_size()
        if vocab > model.cfg.vocab_size:
            raise ValueError(f"the tokenizer has {vocab} tokens but the model only "
                             f"{model.cfg.vocab_size} embeddings: not this model's tokenizer")
    hf = hf_model(model)
    if isinstance(tokenizer, task.ChatTokenizer):
        for cfg in (hf.config, hf.generation_config):
            cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = task.BOS, task.EOS, task.PAD
    hf.save_pretrained(str(out))
    if tokenizer is not None:
        save_tokenizer(tokenizer, out)
    return sorted(p for p in out.iterdir() if p.is_file())


# ---------------------------------------------------------------------------------------------
# Import
# ---------------------------------------------------------------------------------------------

def read_hf_config(folder: str | Path) -> dict:
    """config.json of a model folder, as a dict."""
    folder = as_folder(folder, "folder")
    path = folder / "config.json" if folder.is_dir() else folder
    if not path.is_file():
        raise ValueError(f"no config.json in {folder}: give a Hugging Face model folder (written "
                         "by save_pretrained or export-hf)")
    try:
        hf = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path} as JSON ({e})") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{path} holds no JSON object")
    return hf


def import_config(hf: dict, name: str | None = None) -> ModelConfig:
    """The reference ModelConfig of a transformers config (a dict of config.json), or a
    ValueError saying what the reference model cannot represent."""
    kind = hf.get("model_type")
    what = f"{kind} checkpoint"
    if kind not in IMPORTABLE:
        raise ValueError(f"model_type {kind!r} cannot be imported; supported: "
                         f"{', '.join(IMPORTABLE)}" + (" (mixture-of-experts weights are not "
                                                       "mapped)" if kind == "mixtral" else ""))
    if (hf.get("num_local_experts") or 1) > 1 or (hf.get("num_experts") or 1) > 1:
        raise ValueError(f"{what}: mixture of experts is not mapped; import a dense model")
    hf = dict(hf)
    if kind == "gpt2":
        act = hf.get("activation_function", "gelu_new")
        if act not in GPT2_ACTS:
            raise ValueError(f"{what}: activation {act!r}; the reference GPT-2 computes "
                             f"tanh-approximated GELU ({', '.join(GPT2_ACTS)})")
        if hf.get("scale_attn_by_inverse_layer_idx") or not hf.get("scale_attn_weights", True):
            raise ValueError(f"{what}: attention scaled other than by 1/sqrt(head_dim) "
                             "(scale_attn_by_inverse_layer_idx / scale_attn_weights) is not in "
                             "the reference model")
        if hf.get("n_inner") is None:
            hf["n_inner"] = 4 * hf.get("n_embd", 0)
        return configs.from_hf_config(hf, name)
    act = hf.get("hidden_act", LLAMA_ACT)
    if act != LLAMA_ACT:
        raise ValueError(f"{what}: hidden_act {act!r}; the reference model's MLP is SwiGLU "
                         f"({LLAMA_ACT})")
    if kind != "qwen2" and hf.get("attention_bias"):
        raise ValueError(f"{what}: attention_bias puts a bias on o_proj too; the reference "
                         "model has q/k/v biases only (Qwen2)")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", ROPE_DEFAULT))
    if rope_type != ROPE_DEFAULT:
        raise ValueError(f"{what}: RoPE scaling {rope_type!r} is not in the reference model "
                         "(plain RoPE only); import a model without rope scaling")
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{what}: partial rotary embeddings are not in the reference model")
    if "rope_theta" in rope:  # transformers v5 keeps theta inside rope_parameters
        hf["rope_theta"] = rope["rope_theta"]
    window = hf.get("sliding_window")
    if kind in ("qwen2", "qwen3") and not (hf.get("use_sliding_window") and
                                          "sliding_attention" in (hf.get("layer_types") or
                                                                  ["sliding_attention"])):
        window = None
    if window:  # exact on sequences of at most `window` tokens: cap the context there
        hf["max_position_embeddings"] = min(int(window), int(hf["max_position_embeddings"]))
    if kind == "qwen2":  # from_hf_config refuses attention_bias; Qwen2's are q/k/v only
        hf.pop("attention_bias", None)
    return configs.from_hf_config(hf, name)


def _stored_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of model.safetensors, or of the shards its index lists."""
    from safetensors.torch import load_file

    if (folder / WEIGHTS).is_file():
        files = [folder / WEIGHTS]
    elif (folder / INDEX).is_file():
        index = json.loads((folder / INDEX).read_text())
        files = [folder / f for f in sorted(set(index.get("weight_map", {}).values()))]
    else:
        found = sorted(p.name for p in folder.glob("*.bin"))
        raise ValueError(f"{folder} has no {WEIGHTS} or {INDEX}" +
                         (f" (only {', '.join(found)}: load it in transformers and "
                          "save_pretrained it, which writes safetensors)" if found else ""))
    out: dict[str, torch.Tensor] = {}
    for f in files:
        if not f.is_file():
            raise ValueError(f"{f.name}, listed in {INDEX}, is missing from {folder}")
        out.update(load_file(str(f)))
    return out


def _canonical(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Names as a *ForCausalLM saves them (a bare GPT2Model/LlamaModel has no prefix), without
    the buffers older checkpoints store."""
    prefix = "transformer." if cfg.flavour == "gpt2" else "model."
    out = {}
    for k, v in sd.items():
        if k.endswith(NOT_WEIGHTS):
            continue
        out[k if k.startswith(prefix) or k == "lm_head.weight" else prefix + k] = v
    return out


def reference_weights(cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers state dict -> the reference model's, by inverting `bench.hf._hf_weights`
    on a meta-device model (q/k/v biases of Qwen2 by name). Raises on a missing or an unknown
    tensor, so nothing is silently left at its initial value or dropped."""
    with torch.device("meta"):
        meta = Transformer(cfg)
    ours = {id(p): n for n, p in meta.named_parameters()}  # a tied head is listed once
    bias = {f"model.layers.{i}.self_attn.{n}_proj.bias": f"blocks.{i}.attn.{n}.bias"
            for i in range(cfg.n_layers) for n in "qkv"} if cfg.qkv_bias else {}
    sd = _canonical(sd, cfg)
    out, used = {}, set()

    def take(hf_name: str) -> torch.Tensor:
        if hf_name not in sd:
            raise ValueError(f"the checkpoint lacks {hf_name}: not a complete {cfg.flavour} "
                             "model of this config")
        used.add(hf_name)
        return sd[hf_name]

    for hf_name, t in bench_hf._hf_weights(meta).items():
        if hf_name == "lm_head.weight" and cfg.tied:
            used.add(hf_name)  # saved or not, the head is the embedding
            continue
        if id(t) in ours:
            out[ours[id(t)]] = take(hf_name)
        elif t._base is not None and id(t._base) in ours:  # GPT-2 Conv1D: (in, out)
            out[ours[id(t._base)]] = take(hf_name).t()
        else:  # GPT-2 c_attn: q, k, v stacked on the output dimension
            w = take(hf_name)
            parts = (w.t() if w.dim() == 2 else w).split(cfg.d_model)
            layer = hf_name.split(".")[2]
            for n, part in zip("qkv", parts):
                out[f"blocks.{layer}.attn.{n}.{hf_name.rpartition('.')[2]}"] = part
    for hf_name, name in bias.items():
        out[name] = take(hf_name)
    if cfg.tied:  # state_dict lists the shared matrix under both names
        out["head.weight"] = out["embed.weight"]
    unknown = sorted(set(sd) - used)
    if unknown:
        raise ValueError(f"the checkpoint has tensors the reference model has no place for: "
                         f"{', '.join(unknown[:4])}{' ...' if len(unknown) > 4 else ''}")
    return {k: v.contiguous() for k, v in out.items()}


def import_hf(folder: str | Path, dtype: torch.dtype = torch.float32,
              name: str | None = None) -> Transformer:
    """The reference Transformer with the weights of a Hugging Face folder, in `dtype`
    (fp32 by default: a bf16 checkpoint is upcast exactly)."""
    folder = as_folder(folder, "folder")
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a folder; give the folder save_pretrained wrote")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise ValueError(f"dtype must be a floating point torch dtype, got {dtype!r}")
    cfg = import_config(read_hf_config(folder), name or folder.name)
    sd = reference_weights(cfg, _stored_tensors(folder))
    model = Transformer(cfg)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:  # reference_weights covers every parameter: a bug if not
        raise RuntimeError(f"weight map out of date: missing {missing}, unknown {unexpected}")
    return model.to(dtype).eval()


@torch.no_grad()
def logit_gap(model: nn.Module, folder: str | Path, ids: torch.Tensor) -> float:
    """max |logits(model) - logits(transformers' load of folder, on the CPU)| on ids
    (batch, time), fp32: the export check (1e-5 is the bar)."""
    from .policy import logits_of

    tf = bench_hf.require_transformers()
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype != torch.long:
        raise ValueError("ids must be a (batch, time) tensor of token ids (torch.long)")
    theirs = tf.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    was = model.training
    model.eval()
    ours = logits_of(model, ids.to(next(model.parameters()).device)).cpu()
    model.train(was)
    return (ours - logits_of(theirs, ids.cpu())).abs().max().item()
