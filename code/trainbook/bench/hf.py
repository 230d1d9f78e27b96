"""The reference model against Hugging Face transformers: same weights, same logits, and which
trains faster.

`hf_config` maps a `ModelConfig` onto a transformers `GPT2Config` or `LlamaConfig` of the same
architecture; `to_hf` copies the reference model's weights into `GPT2LMHeadModel` or
`LlamaForCausalLM`, so the two compute the same function (the tests hold the logits to 1e-5 in
fp32). `train_speed` then times training steps (forward, backward, AdamW) of both in one process,
repeats interleaved A B A B so that a noisy neighbour slows both alike, and reports the median
tokens/s of each and their ratio. A book can only call its reference model "as fast as the
library" if this measures it.

transformers is an optional dependency (`pip install "trainbook[hf]"`): it is imported when a
function here needs it, so the command line starts without it.

Chapter: book/compute/throughput
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from types import ModuleType
from typing import Any

import torch

from .. import configs
from ..configs import ModelConfig
from ..launch import resolve_device
from ..model import Transformer, count_parameters
from .timing import Timer

# The library facts the equivalence rests on; tests/test_bench_hf.py asserts each against the
# installed transformers, so an upgrade that changes one fails a test instead of a benchmark.
TRANSFORMERS_FLOOR = (5, 0)  # v5: LlamaConfig takes `rope_parameters`, not `rope_theta`
GPT2_ACTIVATION = "gelu_new"  # GPT-2's tanh-approximated GELU = F.gelu(approximate="tanh"), ours
HF_GPT2_DEFAULT_DROPOUT = 0.1  # GPT2Config's resid/embd/attn dropout: we set all three to 0
HF_LLAMA_DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}  # we always pass ours
HF_LLAMA_DEFAULT_RMS_EPS = 1e-6  # LlamaConfig's default differs from ours (1e-5): always passed
# "sdpa": HF calls F.scaled_dot_product_attention with no mask and is_causal=True, the very call
# the reference model makes, so logits agree to rounding and the timing compares the same kernel.
# "eager" would build the T x T scores with matmul + softmax: other rounding, and slower.
ATTN_IMPLEMENTATION = "sdpa"

# d_model 256 versions of the tiny presets (4 layers, vocabulary 2048): big enough that matmuls
# matter, small enough that both models train a step in well under a second on a laptop CPU.
BENCH_SIZES: dict[str, ModelConfig] = {
    c.name: c for c in [
        configs.get("tiny-gpt2").with_(name="small-gpt2", d_model=256, vocab_size=2048),
        configs.get("tiny-llama").with_(name="small-llama", d_model=256, d_ff=688, vocab_size=2048),
    ]
}
DEFAULT_MODELS = ("tiny-gpt2", "tiny-llama", *BENCH_SIZES)
# train_speed's and the command's defaults: about 40 s for DEFAULT_MODELS on one CPU thread
DEFAULTS = {"batch": 8, "seq_len": 128, "steps": 3, "repeats": 5, "warmup": 2}


def resolve(model: str | ModelConfig) -> ModelConfig:
    """A preset, a bench size (BENCH_SIZES) or a config.json path -> ModelConfig."""
    if isinstance(model, str) and model in BENCH_SIZES:
        return BENCH_SIZES[model]
    try:
        return configs.resolve(model)
    except ValueError as e:
        raise ValueError(f"{e}; bench sizes: {', '.join(BENCH_SIZES)}") from None


def require_transformers() -> ModuleType:
    """The transformers module, or a one-line reason it cannot be used (missing or too old)."""
    try:
        import transformers
    except ImportError:
        raise ValueError('transformers is not installed; pip install "trainbook[hf]"') from None
    have = tuple(int(p) for p in transformers.__version__.split(".")[:2])
    if have < TRANSFORMERS_FLOOR:
        raise ValueError(f"transformers {transformers.__version__} is older than "
                         f"{'.'.join(map(str, TRANSFORMERS_FLOOR))}; upgrade it")
    return transformers


def check_supported(cfg: ModelConfig) -> None:
    """Refuse the configs transformers' GPT-2 and Llama cannot express exactly."""
    if cfg.is_moe:
        raise ValueError(f"{cfg.name}: mixture of experts has no GPT-2/Llama equivalent here")
    if cfg.qkv_bias:  # LlamaConfig.attention_bias would put a bias on o_proj too
        raise ValueError(f"{cfg.name}: q/k/v-only biases (Qwen2) have no Llama equivalent")
    if cfg.embed_scale != 1.0:
        raise ValueError(f"{cfg.name}: embed_scale {cfg.embed_scale:g} has no GPT-2/Llama/Qwen3 "
                         "equivalent; compare with embed_scale 1")
    if cfg.qk_norm and cfg.flavour == "gpt2":
        raise ValueError(f"{cfg.name}: GPT-2 has no QK-norm; use the llama flavour (Qwen3)")
    if cfg.flavour == "llama" and cfg.d_model % cfg.n_heads:
        raise ValueError(f"{cfg.name}: transformers' Llama needs d_model divisible by n_heads")


def hf_config(cfg: ModelConfig) -> Any:
    """A transformers GPT2Config, LlamaConfig or (with QK-norm) Qwen3Config with exactly this
    architecture.

    Every field that changes the function is set rather than left to a library default, dropout
    is 0 (ours has none), and use_cache is off: a KV cache is for generation and only costs time
    in training."""
    check_supported(cfg)
    tf = require_transformers()
    common = dict(vocab_size=cfg.vocab_size, tie_word_embeddings=cfg.tied, use_cache=False,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None,
                  attn_implementation=ATTN_IMPLEMENTATION)
    if cfg.flavour == "gpt2":
        return tf.GPT2Config(
            n_positions=cfg.max_seq_len, n_embd=cfg.d_model, n_layer=cfg.n_layers,
            n_head=cfg.n_heads, n_inner=cfg.d_ff, activation_function=GPT2_ACTIVATION,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=cfg.norm_eps,
            scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False,
            reorder_and_upcast_attn=False, **common)
    llama = dict(
        hidden_size=cfg.d_model, intermediate_size=cfg.d_ff, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
        hidden_act="silu", max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
        attention_bias=False, attention_dropout=0.0, **common)
    if cfg.qk_norm:  # Qwen3: Llama with an RMSNorm over head_dim on q and k, before RoPE
        return tf.Qwen3Config(use_sliding_window=False, **llama)
    return tf.LlamaConfig(mlp_bias=False, pretraining_tp=1, **llama)


def _hf_weights(model: Transformer) -> dict[str, torch.Tensor]:
    """Our parameters under transformers' names and layouts."""
    cfg = model.cfg
    out = {}
    if cfg.flavour == "gpt2":
        # GPT-2's Conv1D stores (in, out): the transpose of nn.Linear; q, k, v are one c_attn
        out["transformer.wte.weight"] = model.embed.weight
        out["transformer.wpe.weight"] = model.pos.weight
        for i, b in enumerate(model.blocks):
            p = f"transformer.h.{i}."
            a = b.attn
            out[p + "attn.c_attn.weight"] = torch.cat([a.q.weight, a.k.weight, a.v.weight]).t()
            out[p + "attn.c_attn.bias"] = torch.cat([a.q.bias, a.k.bias, a.v.bias])
            out[p + "attn.c_proj.weight"] = a.o.weight.t()
            out[p + "attn.c_proj.bias"] = a.o.bias
            out[p + "mlp.c_fc.weight"] = b.mlp.up.weight.t()
            out[p + "mlp.c_fc.bias"] = b.mlp.up.bias
            out[p + "mlp.c_proj.weight"] = b.mlp.down.weight.t()
            out[p + "mlp.c_proj.bias"] = b.mlp.down.bias
            for hf_norm, ours in (("ln_1", b.attn_norm), ("ln_2", b.mlp_norm)):
                out[p + hf_norm + ".weight"], out[p + hf_norm + ".bias"] = ours.weight, ours.bias
        out["transformer.ln_f.weight"] = model.norm.weight
        out["transformer.ln_f.bias"] = model.norm.bias
    else:
        out["model.embed_tokens.weight"] = model.embed.weight
        for i, b in enumerate(model.blocks):
            p = f"model.layers.{i}."
            for n in "qkvo":
                out[p + f"self_attn.{n}_proj.weight"] = getattr(b.attn, n).weight
            for n in ("gate", "up", "down"):
                out[p + f"mlp.{n}_proj.weight"] = getattr(b.mlp, n).weight
            if cfg.qk_norm:
                out[p + "self_attn.q_norm.weight"] = b.attn.q_norm.weight
                out[p + "self_attn.k_norm.weight"] = b.attn.k_norm.weight
            out[p + "input_layernorm.weight"] = b.attn_norm.weight
            out[p + "post_attention_layernorm.weight"] = b.mlp_norm.weight
        out["model.norm.weight"] = model.norm.weight
    out["lm_head.weight"] = model.head.weight
    return out


@torch.no_grad()
def to_hf(model: Transformer) -> torch.nn.Module:
    """A GPT2LMHeadModel or LlamaForCausalLM holding a copy of `model`'s weights, on its device
    and dtype, in train mode: the same function, in the library's code."""
    tf = require_transformers()
    cfg = model.cfg
    cls = tf.GPT2LMHeadModel if cfg.flavour == "gpt2" else \
        tf.Qwen3ForCausalLM if cfg.qk_norm else tf.LlamaForCausalLM
    ref = next(model.parameters())
    hf = cls(hf_config(cfg)).to(device=ref.device, dtype=ref.dtype)
    hf.loss_type = "ForCausalLM"  # GPT2LMHeadModel's name names no loss: set its fallback, unwarned
    weights = _hf_weights(model)
    params = dict(hf.named_parameters())  # a tied lm_head is listed once, as the embedding
    missing = sorted(set(params) - set(weights))
    unknown = sorted(set(weights) - set(params) - ({"lm_head.weight"} if cfg.tied else set()))
    if missing or unknown:
        raise RuntimeError(f"weight map out of date: missing {missing}, unknown {unknown}")
    for name, p in params.items():
        p.copy_(weights[name])
    if cfg.tied and hf.lm_head.weight.data_ptr() != hf.get_input_embeddings().weight.data_ptr():
        raise RuntimeError("transformers did not tie lm_head to the embedding")
    return hf.train()


def _whole(name: str, value, least: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be a whole number >= {least}, got {value!r}")
    return value


def check_inputs(cfg: ModelConfig, batch: int, seq_len: int, steps: int, repeats: int,
                 device: str | torch.device, warmup: int = 0) -> torch.device:
    """Everything train_speed would refuse, refused before any work; returns the device."""
    for name, v in (("batch", batch), ("steps", steps), ("repeats", repeats)):
        _whole(name, v)
    _whole("warmup", warmup, least=0)
    configs.check_seq_len(cfg, seq_len)
    if seq_len > cfg.max_seq_len:
        raise ValueError(f"sequence length {seq_len} exceeds {cfg.name}'s max_seq_len "
                         f"{cfg.max_seq_len}; use a shorter sequence")
    check_supported(cfg)
    require_transformers()
    return resolve_device(str(device))


def precision(device: torch.device) -> str:
    """What train_speed runs in: fp32 on CPU (bf16 is emulated on many), bf16 autocast on GPU."""
    return "bf16 autocast" if torch.device(device).type == "cuda" else "fp32"


@dataclass
class TrainSpeed:
    """Training throughput of the reference model and of transformers at one configuration."""

    model: str
    flavour: str
    params: int
    batch: int
    seq_len: int
    steps: int
    repeats: int
    device: str
    precision: str
    ours_tokens_per_s: float  # median over repeats
    hf_tokens_per_s: float
    ratio: float  # ours / hf: >= 1 means the reference model is at least as fast
    ours_samples: list[float] = field(repr=False)
    hf_samples: list[float] = field(repr=False)

    def to_dict(self) -> dict:
        return asdict(self)


def train_speed(cfg: ModelConfig | str, batch: int = DEFAULTS["batch"],
                seq_len: int = DEFAULTS["seq_len"], steps: int = DEFAULTS["steps"],
                repeats: int = DEFAULTS["repeats"], device: str | torch.device = "cpu",
                warmup: int = DEFAULTS["warmup"], seed: int = 0,
                on_repeat: Callable[[], None] | None = None) -> TrainSpeed:
    """Tokens/s of training steps (forward + backward + AdamW step), ours vs transformers.

    Both models hold the same weights (`to_hf`), see the same batch and run the same optimizer;
    each takes `warmup` untimed steps first (allocations, AdamW state, autotuning). Then
    `repeats` rounds of `steps` timed steps, ours then HF's in each round, so that drift in the
    machine's speed falls on both. fp32 on CPU; bf16 autocast on CUDA (weights stay fp32, as in
    mixed-precision training). HF computes its loss from `labels=idx` (it shifts inside), the
    way a transformers training loop calls it; ours takes the already-shifted targets."""
    cfg = resolve(cfg)
    dev = check_inputs(cfg, batch, seq_len, steps, repeats, device, warmup)
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):  # seeded init without moving the caller's RNG
        torch.manual_seed(seed)
        ours = Transformer(cfg).to(dev).train()
        hf = to_hf(ours)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), generator=gen).to(dev)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    gpu = dev.type == "cuda"

    def stepper(model, loss_fn):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def run_steps(n: int):
            for _ in range(n):
                opt.zero_grad(set_to_none=True)
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=gpu):
                    loss = loss_fn()
                loss.backward()
                opt.step()
        return run_steps

    runners = {"ours": stepper(ours, lambda: ours(x, y)[1]),
               "hf": stepper(hf, lambda: hf(input_ids=x, labels=x).loss)}
    timer = Timer(dev)
    samples: dict[str, list[float]] = {k: [] for k in runners}
    for run_steps in runners.values():
        run_steps(warmup)
    timer.sync()
    for _ in range(repeats):
        for name, run_steps in runners.items():  # A B A B ...
            seconds = timer(partial(run_steps, steps))
            samples[name].append(batch * seq_len * steps / seconds)
        if on_repeat:
            on_repeat()
    med = {k: statistics.median(v) for k, v in samples.items()}
    return TrainSpeed(cfg.name, cfg.flavour, count_parameters(ours), batch, seq_len, steps,
                      repeats, str(dev), precision(dev), med["ours"],
                      med["hf"], med["ours"] / med["hf"], samples["ours"], samples["hf"])
