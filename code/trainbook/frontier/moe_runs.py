"""The chapter's MoE runs over the trainer: the proxy model, one run with a routing recipe, and
what is read off its history (loads per expert, loss against training FLOPs).

The trainer builds a mixture of experts from a config.json (`model_file` writes one, Mixtral
style, for any number of experts, top k and expert width); `MoEHook` swaps the routing recipe
in; every run starts from the same seed on the same batches, so two recipes differ only in what
they change. FLOPs per token are the trainer's own count (`compute.flops`), with shared experts
counted as always-active experts. `upcycled_run` trains an MoE whose experts start as copies of
a trained dense model's MLP.

Chapter: book/frontier/moe.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from ..compute.flops import training_flops_per_token
from ..configs import ModelConfig, resolve
from ..pretrain.schedules import quiet
from ..train import TrainConfig, TrainResult, train
from ..train.hooks import Hook
from . import moe_router as R
from .moe_layer import MoEHook, MoEOptions, Upcycle

# The CPU proxy: two layers of width 64 on bytes (V = 256), a few hundred tokens a step.
PROXY: dict[str, Any] = {"tokenizer": "bytes", "d_model": 64, "n_layers": 2, "n_heads": 2,
                         "n_kv_heads": 2, "seq_len": 64, "batch_size": 8, "steps": 150,
                         "warmup_steps": 10, "log_every": 0, "progress": False,
                         "eval_batches": 4}
WINDOW = 20  # loads are measured over the last WINDOW steps of a run


def _whole(name: str, value: Any, least: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be a whole number >= {least}, got {value!r}")
    return value


def model_file(n_experts: int, top_k: int, d_ff: int, folder: str | Path | None = None) -> Path:
    """A Hugging Face style config.json the trainer builds the proxy from: Mixtral with
    `n_experts` experts of width `d_ff`, `top_k` per token, or with n_experts 1 a dense Llama
    whose MLP has width d_ff. The other sizes come from PROXY through the trainer's overrides."""
    _whole("n_experts", n_experts)
    _whole("top_k", top_k)
    _whole("d_ff", d_ff)
    if top_k > n_experts:
        raise ValueError(f"top_k {top_k} is larger than the number of experts {n_experts}")
    hf = {"model_type": "mixtral" if n_experts > 1 else "llama", "vocab_size": 256,
          "hidden_size": PROXY["d_model"], "num_hidden_layers": PROXY["n_layers"],
          "num_attention_heads": PROXY["n_heads"], "num_key_value_heads": PROXY["n_kv_heads"],
          "intermediate_size": d_ff, "max_position_embeddings": PROXY["seq_len"],
          "_name_or_path": f"proxy-{n_experts}x{d_ff}-top{top_k}"}
    if n_experts > 1:
        hf.update(num_local_experts=n_experts, num_experts_per_tok=top_k)
    folder = Path(folder or tempfile.mkdtemp(prefix="trainbook-moe-"))
    path = folder / f"{hf['_name_or_path']}.json"
    path.write_text(json.dumps(hf, indent=1))
    return path


def proxy_config(n_experts: int = 8, top_k: int = 2, d_ff: int = 64,
                 folder: str | Path | None = None, **overrides: Any) -> TrainConfig:
    """The trainer's options for the proxy with this MoE shape (PROXY, then `overrides`)."""
    unknown = set(overrides) - set(TrainConfig.__dataclass_fields__)
    if unknown:
        raise ValueError(f"{sorted(unknown)} are not trainer options; see TrainConfig")
    if "model" in overrides:
        raise ValueError("give the MoE shape as n_experts, top_k and d_ff, not a model")
    path = model_file(n_experts, top_k, d_ff, folder)
    cfg = TrainConfig(**{**PROXY, **overrides, "model": str(path)})
    if cfg.dtype == "fp16":
        raise ValueError("the MoE runs' auxiliary losses are not loss-scaled: use fp32 or bf16")
    return cfg


def run(cfg: TrainConfig, options: MoEOptions | None = None,
        hooks: list[Hook] | tuple[Hook, ...] = ()) -> TrainResult:
    """Train `cfg` quietly with the MoE layers swapped for `options` (a dense model: as is).
    `hooks` run before the swap's hook (an `Upcycle` must)."""
    if not isinstance(cfg, TrainConfig):
        raise ValueError(f"cfg must be a TrainConfig (see proxy_config), got {type(cfg).__name__}")
    moe = resolve(cfg.model).is_moe
    if not moe and options is not None:
        raise ValueError("routing options need an MoE model; this config is dense")
    all_hooks = list(hooks) + ([MoEHook(options or MoEOptions())] if moe else [])
    with quiet():
        return train(cfg, all_hooks)


def window_counts(history: list[dict], last: int = WINDOW) -> torch.Tensor:
    """Assignments per layer and expert (layers, E) summed over the last `last` steps."""
    _whole("last", last)
    rows = [r["expert_counts"] for r in history[-last:] if "expert_counts" in r]
    if not rows:
        raise ValueError("the history has no expert_counts: train the MoE with MoEHook "
                         "(moe_runs.run)")
    return torch.tensor(rows).sum(0)


def load_table(history: list[dict], last: int = WINDOW) -> pd.DataFrame:
    """`moe_router.load_stats` per layer over the last `last` steps, one row per layer."""
    return pd.DataFrame([{"layer": i, **R.load_stats(c)}
                         for i, c in enumerate(window_counts(history, last))])


def flops_per_token(cfg: ModelConfig, seq_len: int, n_shared: int = 0) -> float:
    """Training FLOPs per token (forward and backward, `compute.flops`): a dense model as is, an
    MoE with its top_k routed plus `n_shared` shared experts active and a router over the
    n_experts - n_shared routed ones."""
    _whole("n_shared", n_shared, 0)
    if n_shared and (not cfg.is_moe or n_shared >= cfg.n_experts):
        raise ValueError(f"n_shared {n_shared} must be below the {cfg.n_experts} experts of an "
                         "MoE config")
    if not n_shared:
        return float(training_flops_per_token(cfg, seq_len))
    active = cfg.with_(top_k=cfg.top_k + n_shared)
    return float(training_flops_per_token(active, seq_len)
                 - 6 * cfg.n_layers * cfg.d_model * n_shared)


def loss_curve(result: TrainResult, n_shared: int = 0) -> pd.DataFrame:
    """Training loss and validation loss (where evaluated, and at the last step the run's final
    evaluation) against tokens and training FLOPs."""
    per_token = flops_per_token(result.model_config, result.config.seq_len, n_shared)
    tokens = result.config.seq_len * result.config.batch_size * result.config.grad_accum
    h = pd.DataFrame(result.history)
    out = pd.DataFrame({"step": h.step, "tokens": h.step * tokens,
                        "flops": h.step * tokens * per_token, "loss": h.loss})
    out["val_loss"] = h.val_loss if "val_loss" in h else float("nan")
    if result.val_loss is not None and len(out):
        out.loc[out.index[-1], "val_loss"] = result.val_loss
    return out


class StartFrom(Hook):
    """At on_model, load a finished run's weights (the new run has a fresh optimizer and
    schedule): the dense baseline that an upcycled run is compared with trains on this way."""

    def __init__(self, result: TrainResult):
        if not isinstance(result, TrainResult):
            raise ValueError(f"StartFrom needs a TrainResult, got {type(result).__name__}")
        self.state = {k: v.detach().clone() for k, v in result.model.state_dict().items()}

    def on_model(self, model: torch.nn.Module) -> None:
        try:
            model.load_state_dict(self.state)
        except RuntimeError as e:
            raise ValueError(f"the new run's model does not match the finished run's: {e}") \
                from None


def upcycled_run(dense: TrainResult, cfg: TrainConfig,
                 options: MoEOptions | None = None) -> TrainResult:
    """Continue a trained dense model as an MoE: `cfg` is the MoE proxy (its experts as wide as
    the dense MLP); every expert starts as the dense MLP, the router fresh (`Upcycle`)."""
    if dense.model_config.is_moe:
        raise ValueError("upcycle from a dense run (n_experts 1)")
    state = {k: v.detach().clone() for k, v in dense.model.state_dict().items()}
    return run(cfg, options, hooks=[Upcycle(state)])

