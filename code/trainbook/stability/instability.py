"""The two instabilities large runs hit, reproduced at small scale with a high learning rate.

Wortsman et al. (2023) showed that a small model trained at a high learning rate diverges the
way large models do at ordinary ones. This module measures that on the reference model: a
learning-rate sweep per mitigation (`lr_sweep`; QK-norm, z-loss, beta2, warmup, embedding
scale, each as trainer options), the paper's LR sensitivity (`lr_sensitivity`), and during every
run the signatures, recorded by `LogitProbe` (a trainer hook): the largest attention logit
q.k * scale of each layer, and the output logits' normaliser log Z and mean. Two mechanisms
are measured without training: Adam's update size as the gradients shrink towards epsilon
(`update_rms_vs_gradient_scale`, on a real optimizer state) and the gradient norms that the
embedding's scale sets through the first normalisation (`embedding_scale_gradients`, Takase et
al. 2023). `write_sweep` stores a larger sweep with its provenance; `read_sweep` reads it.

Chapter: book/stability/loss-spikes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from torch import nn

from ..bench.gpu_truth import header, write_record
from ..bench.gpu_truth import read_record as read_stored
from ..configs import ModelConfig
from ..launch import resolve_device
from ..model import Transformer
from ..pretrain.schedules import adam_update_rms, quiet
from ..train import TrainConfig, TrainResult, model_config, train
from ..train.hooks import Hook, StepContext

# The CPU proxy: a two-layer Llama on bytes (V = 256, ln V = 5.55) with one head of width 32,
# trained for short runs. Wide heads and no QK-norm let the attention logits grow fast.
PROXY: dict[str, Any] = {"model": "tiny-llama", "tokenizer": "bytes", "d_model": 32,
                         "n_layers": 2, "n_heads": 1, "n_kv_heads": 1, "d_ff": 96, "seq_len": 64,
                         "batch_size": 8, "steps": 100, "warmup_steps": 10, "log_every": 0,
                         "progress": False, "eval_batches": 4}

# each mitigation as the trainer options it changes ("sqrt" embed_scale: sqrt(d_model))
VARIANTS: dict[str, dict[str, Any]] = {
    "baseline": {},
    "qk-norm": {"qk_norm": True},
    "z-loss": {"z_loss": 1e-4},
    "beta2 0.999": {"beta2": 0.999},
    "warmup x4": {"warmup_steps": "x4"},
    "embed scale": {"embed_scale": "sqrt"},
}


def proxy_config(**overrides: Any) -> TrainConfig:
    """The chapter's CPU proxy run (PROXY) with trainer options changed; checked by TrainConfig."""
    unknown = set(overrides) - set(TrainConfig.__dataclass_fields__)
    if unknown:
        raise ValueError(f"{sorted(unknown)} are not trainer options; see TrainConfig")
    return TrainConfig(**{**PROXY, **overrides})


def variant_options(name: str, cfg: TrainConfig) -> dict[str, Any]:
    """The trainer options of the mitigation `name` (VARIANTS) for this run: 'x4' warmup is four
    times cfg's warmup, 'sqrt' embed scale is sqrt(d_model)."""
    if name not in VARIANTS:
        raise ValueError(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")
    out = dict(VARIANTS[name])
    if out.get("warmup_steps") == "x4":
        out["warmup_steps"] = min(cfg.steps, 4 * cfg.warmup_steps)
    if out.get("embed_scale") == "sqrt":
        out["embed_scale"] = math.sqrt(model_config(cfg, 256).d_model)
    return out


def attention_logit_max(q: torch.Tensor, k: torch.Tensor, scale: float | None = None) -> float:
    """The largest causal attention logit scale * q_i . k_j (j <= i) over batch and heads, for q
    (batch, heads, time, head_dim) and k with the same or fewer (grouped) heads. scale None:
    1/sqrt(head_dim), as the reference attention."""
    if q.dim() != 4 or k.dim() != 4 or q.shape[-1] != k.shape[-1] or q.shape[1] % k.shape[1]:
        raise ValueError(f"need q (B, H, T, d) and k (B, H_kv, T, d) with H_kv dividing H, got "
                         f"{tuple(q.shape)} and {tuple(k.shape)}")
    with torch.no_grad():
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        s = (q.float() @ k.float().transpose(-1, -2)) * (scale or q.shape[-1] ** -0.5)
        tq, tk = s.shape[-2:]
        future = torch.ones(tq, tk, dtype=torch.bool, device=s.device).triu(tk - tq + 1)
        return s.masked_fill(future, -math.inf).amax().item()


class LogitProbe(Hook):
    """Records, for every training step, the largest attention logit of each layer and over all
    layers (`attn_logit_max`), and of the output logits their mean log-normaliser `log_z` (the
    logsumexp over the vocabulary, averaged over tokens) and mean (`logit_mean`). It wraps each
    attention's `core` (the model's seam for it) and hooks the head; evaluation passes, in eval
    mode, are not recorded. Costs one extra q k^T per layer and step (`attention=False`: none).
    Keeps the run's optimizer (`optimizer`) for inspection after training."""

    def __init__(self, attention: bool = True):
        self.attention = attention
        self.optimizer: torch.optim.Optimizer | None = None  # the run's, kept for inspection
        self._attn: dict[int, float] = {}
        self._out: list[tuple[float, float]] = []

    def on_model(self, model: nn.Module) -> None:
        if self.attention:
            for i, block in enumerate(model.layers()):
                self._wrap(i, block.attn)
        model.head.register_forward_hook(self._head)

    def _wrap(self, i: int, attn: nn.Module) -> None:
        core = attn.core

        def probed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if attn.training:
                m = attention_logit_max(q, k, attn.softmax_scale)
                self._attn[i] = max(m, self._attn.get(i, -math.inf))
            return core(q, k, v)

        attn.core = probed

    def _head(self, module: nn.Module, _inputs: tuple, out: torch.Tensor) -> None:
        if module.training:
            with torch.no_grad():
                o = out.detach().float()
                self._out.append((o.logsumexp(-1).mean().item(), o.mean().item()))

    def after_update(self, ctx: StepContext) -> None:
        rec, self.optimizer = ctx.record, ctx.optimizer
        if self._attn:
            layers = [self._attn[i] for i in sorted(self._attn)]
            rec["attn_logit_max"] = max(layers)
            rec["attn_logit_max_layers"] = layers
        if self._out:
            rec["log_z"] = sum(z for z, _ in self._out) / len(self._out)
            rec["logit_mean"] = sum(m for _, m in self._out) / len(self._out)
        self._attn, self._out = {}, []


def probed_run(cfg: TrainConfig, probe: LogitProbe | None = None) -> TrainResult:
    """Train `cfg` quietly (one thread on a CPU) with a LogitProbe (a new one by default)."""
    with quiet():
        return train(cfg, hooks=[probe or LogitProbe()])


def logits_by_token(model: Transformer, blocks: torch.Tensor, train_blocks: torch.Tensor,
                    batch: int = 8) -> pd.DataFrame:
    """Per vocabulary entry: how often it occurs as a target in `train_blocks`, and its mean
    output logit and log-probability over the first `batch` blocks of `blocks` (eval mode).
    Tokens the training data never shows have no gradient pulling them up: their logits show
    where Adam's normalised steps have pushed them."""
    if blocks.dim() != 2 or train_blocks.dim() != 2 or batch < 1:
        raise ValueError("give packed blocks (n, seq_len + 1), as data.build_dataset makes, "
                         "and batch >= 1")
    was = model.training
    model.eval()
    with torch.no_grad():
        x = blocks[:batch, :-1].to(next(model.parameters()).device)
        logits = model(x)[0].float().reshape(-1, model.cfg.vocab_size)
    model.train(was)
    counts = torch.bincount(train_blocks[:, 1:].reshape(-1), minlength=model.cfg.vocab_size)
    return pd.DataFrame({"train_count": counts.tolist(), "mean_logit": logits.mean(0).tolist(),
                         "mean_logprob": logits.log_softmax(-1).mean(0).tolist()})


def _finite(x: float) -> float:
    return x if math.isfinite(x) else math.inf


def lr_sweep(variants: Sequence[str], lrs: Sequence[float], **overrides: Any
             ) -> tuple[pd.DataFrame, dict[tuple[str, float], pd.DataFrame]]:
    """Train the proxy (PROXY with `overrides`) once per (variant, peak lr), every run from the
    same initial weights and batches (one seed).

    Returns (table, histories). table: one row per run: variant, lr, val_loss (the final
    validation loss; inf if the run went non-finite), train_loss (mean of the last 5 steps),
    first_loss, attn_logit_max (the largest over the run) and the final step's attention logit
    max, log_z and logit_mean, seconds. histories: (variant, lr) -> per-step step, loss,
    grad_norm, attn_logit_max, log_z, logit_mean."""
    if len(variants) == 0 or len(lrs) == 0 or min(lrs) <= 0:
        raise ValueError(f"lr_sweep needs variants and positive learning rates, got "
                         f"{list(variants)}, {list(lrs)}")
    base = proxy_config(**overrides)
    for v in variants:
        variant_options(v, base)  # every name checked before any work
    rows, histories = [], {}
    for v in variants:
        for lr in lrs:
            cfg = replace(base, lr=lr, **variant_options(v, base))
            t0 = time.perf_counter()
            res = probed_run(cfg)
            h = pd.DataFrame(res.history)
            cols = ["step", "loss", "grad_norm", "attn_logit_max", "log_z", "logit_mean"]
            histories[(v, lr)] = h[cols]
            ok = len(h) == cfg.steps and bool(h.loss.map(math.isfinite).all())
            rows.append({"variant": v, "lr": lr,
                         "val_loss": _finite(res.val_loss) if ok else math.inf,
                         "train_loss": float(h.loss.tail(5).mean()) if ok else math.inf,
                         "first_loss": float(h.loss.iloc[0]),
                         "attn_logit_max": float(h.attn_logit_max.max()),
                         "final_attn_logit_max": float(h.attn_logit_max.iloc[-1]),
                         "final_log_z": float(h.log_z.iloc[-1]),
                         "final_logit_mean": float(h.logit_mean.iloc[-1]),
                         "seconds": time.perf_counter() - t0})
    return pd.DataFrame(rows), histories


def lr_sensitivity(table: pd.DataFrame, loss: str = "val_loss") -> pd.Series:
    """Wortsman et al.'s LR sensitivity (their Section 2.2) per variant: the mean over the swept
    learning rates of min(loss, L0) - L*, where L* is the variant's best loss and L0 the loss at
    initialisation (here the mean first-step loss), so a diverged run counts as L0 - L*, not
    infinity."""
    need = {"variant", "lr", loss, "first_loss"}
    if not need <= set(table.columns):
        raise ValueError(f"lr_sensitivity needs lr_sweep's table with columns {sorted(need)}")
    out = {}
    for v, g in table.groupby("variant", sort=False):
        l0 = float(g.first_loss.mean())
        capped = g[loss].clip(upper=l0)
        out[v] = float((capped - capped.min()).mean())
    return pd.Series(out, name="lr_sensitivity")


def update_rms_vs_gradient_scale(optimizer_state: dict, scales: Sequence[float],
                                 eps: Sequence[float] = (1e-8, 1e-15)) -> pd.DataFrame:
    """Adam's update RMS (in units of the learning rate) for the same optimizer state with every
    gradient multiplied by s: m -> s m and v -> s^2 v, so m_hat / (sqrt(v_hat) + eps) becomes
    m_hat / (sqrt(v_hat) + eps / s). Once s * sqrt(v) nears eps the update shrinks: the
    update-size collapse of Wortsman et al. (2023, Section 3.4) when gradients get small at
    scale."""
    if len(scales) == 0 or min(scales) <= 0 or len(eps) == 0 or min(eps) <= 0:
        raise ValueError("scales and eps must be positive numbers")
    if "state" not in optimizer_state or "param_groups" not in optimizer_state:
        raise ValueError("give an Adam or AdamW state_dict (optimizer.state_dict())")
    rows = []
    for e in eps:
        for s in scales:
            groups = [{**g, "eps": e / s} for g in optimizer_state["param_groups"]]
            rms = adam_update_rms({"param_groups": groups, "state": optimizer_state["state"]})
            rows.append({"eps": e, "gradient_scale": s, "update_rms": rms})
    return pd.DataFrame(rows)


def gradient_rms(optimizer_state: dict) -> pd.Series:
    """sqrt(v_hat) averaged over each tensor's entries: the gradient RMS Adam divides by, per
    parameter tensor, from an Adam or AdamW state_dict (the number to compare with eps)."""
    out = {}
    for group in optimizer_state.get("param_groups", []):
        b2 = group["betas"][1]
        for idx in group["params"]:
            s = optimizer_state["state"].get(idx)
            if s and "exp_avg_sq" in s:
                t = float(s["step"])
                out[idx] = float((s["exp_avg_sq"] / (1 - b2 ** t)).sqrt().mean())
    if not out:
        raise ValueError("no Adam second moments in this state: take optimizer.state_dict() "
                         "after at least one step")
    return pd.Series(out, name="gradient_rms")


def embedding_scale_gradients(scales: Sequence[float], mcfg: ModelConfig, batch: int = 8,
                              seq_len: int = 64, seed: int = 0) -> pd.DataFrame:
    """At initialisation, for each embedding multiplier: the RMS of the residual stream entering
    the first block (the embedding output), and the gradient norms of the blocks and of the
    embedding for one batch of random tokens. A pre-norm block's normalisation divides by the
    RMS of its input, so its Jacobian grows as that RMS shrinks (Takase et al. 2023)."""
    if len(scales) == 0 or min(scales) <= 0:
        raise ValueError(f"scales must be positive multipliers, got {list(scales)}")
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, mcfg.vocab_size, (batch, seq_len + 1), generator=g)
    rows = []
    for s in scales:
        torch.manual_seed(seed)
        model = Transformer(mcfg.with_(embed_scale=float(s), max_seq_len=seq_len))
        model(x[:, :-1], x[:, 1:])[1].backward()
        with torch.no_grad():
            rms = model.embed_inputs(x[:, :-1])[0].pow(2).mean().sqrt().item()
        norm = lambda ps: math.sqrt(sum(float(p.grad.pow(2).sum()) for p in ps))  # noqa: E731
        rows.append({"embed_scale": float(s), "residual_rms": rms,
                     "blocks_grad_norm": norm(model.blocks.parameters()),
                     "embed_grad_norm": norm([model.embed.weight])})
    return pd.DataFrame(rows)


def call_command(function: Any, *args: Any, **kwargs: Any) -> str:
    """The shell command that calls a package function with these arguments (for a stored
    record's provenance): python -c "from trainbook.x import y; y.f(...)"."""
    module, name = function.__module__, function.__qualname__
    parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    pkg, _, mod = module.rpartition(".")
    return f'python -c "from {pkg} import {mod}; {mod}.{name}({", ".join(parts)})"'


def write_sweep(path: str | Path, variants: Sequence[str] = tuple(VARIANTS),
                lrs: Sequence[float] = (1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0),
                every: int = 5, **overrides: Any) -> Path:
    """Run lr_sweep and store it as JSON with its provenance (command, date, versions, machine):
    the table, and every run's history at every `every`-th step (and the last)."""
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    cfg = proxy_config(**overrides)
    command = call_command(write_sweep, str(path), variants=list(variants), lrs=list(lrs),
                           every=every, **overrides)
    table, hist = lr_sweep(variants, lrs, **overrides)
    keep = {f"{v}|{lr:g}": h[(h.step % every == 0) | (h.step == h.step.max())]
            .round(5).to_dict(orient="list") for (v, lr), h in hist.items()}
    record = header("spikes-sweep", command, resolve_device(cfg.device, 0), "small")
    record.update(config={k: v for k, v in vars(cfg).items() if isinstance(v, (int, float, str,
                                                                               bool))},
                  variants={v: VARIANTS[v] for v in variants}, lrs=list(lrs),
                  table=table.to_dict(orient="records"), histories=keep)
    path = Path(path)
    return write_record(path.parent, path.stem, record)


def read_sweep(path: str | Path) -> tuple[dict, pd.DataFrame, dict[tuple[str, float],
                                                                  pd.DataFrame]]:
    """(record, table, histories) from a file write_sweep wrote."""
    record = read_stored(path, "spikes-sweep", "instability.write_sweep")
    hist = {}
    for key, cols in record["histories"].items():
        v, lr = key.rsplit("|", 1)
        hist[(v, float(lr))] = pd.DataFrame(cols)
    return record, pd.DataFrame(record["table"]), hist
