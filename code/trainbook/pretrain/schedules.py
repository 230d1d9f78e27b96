"""Learning-rate schedule experiments on the reference trainer: warmup, stability, WSD branching.

Three measurements back the schedules chapter: what Adam's first steps do without warmup (the
size of its normalised step, read from the optimizer state after every step, and the loss of a
run at a high learning rate with and without warmup); the largest stable learning rate for each
warmup length on a small grid; and one warmup-stable-decay run that serves several token
budgets, its cooldowns branched from saved states of the stable phase, against a full cosine run
of each length. `native_lrs` builds the same schedules from torch.optim.lr_scheduler and
transformers, to check the trainer's own function against what most training code uses.

Chapter: book/pretraining/schedules.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from ..launch import threads
from ..train import TrainConfig, TrainResult, train
from ..train.schedule import check_schedule, decay_start

# the chapter's small reference run: a two-layer Llama on bytes (vocabulary 256: ln V = 5.55)
BASE = {"model": "tiny-llama", "tokenizer": "bytes", "d_model": 32, "n_layers": 2, "n_heads": 2,
        "n_kv_heads": 2, "d_ff": 96, "seq_len": 32, "batch_size": 16, "log_every": 0,
        "progress": False, "eval_batches": 8}


def scratch_dir() -> str | None:
    """Where throwaway checkpoints go: memory-backed /dev/shm when there is one (the trainer
    fsyncs every checkpoint, which costs more than a tiny model's step on a disk), else the
    default temporary folder."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """One thread for tiny runs (they are overhead-bound), and no trainer log lines."""
    with threads(1), contextlib.redirect_stdout(io.StringIO()):
        yield


def run(**overrides: Any) -> TrainResult:
    """Train the chapter's reference run (BASE) with `overrides` applied, quietly."""
    cfg = TrainConfig(**{**BASE, **overrides})
    with quiet():
        return train(cfg)


def adam_update_rms(optimizer_state: dict) -> float:
    """RMS of Adam's normalised step m_hat / (sqrt(v_hat) + eps) over every parameter entry a
    gradient has reached, from an Adam or AdamW state_dict: the update is lr times this (plus
    decoupled weight decay). 1.0 on the first step whatever the gradients' scale (m_hat = g,
    v_hat = g^2), smaller once m averages the noise in the gradients out."""
    groups = optimizer_state.get("param_groups")
    states = optimizer_state.get("state")
    if not groups or states is None:
        raise ValueError("adam_update_rms needs an optimizer state_dict (param_groups, state)")
    total, count = 0.0, 0
    for group in groups:
        if "betas" not in group:
            raise ValueError("adam_update_rms needs an Adam or AdamW state (no betas found)")
        (b1, b2), eps = group["betas"], group["eps"]
        for idx in group["params"]:
            s = states.get(idx)
            if not s or "exp_avg_sq" not in s:
                continue
            t = float(s["step"])
            seen = s["exp_avg_sq"] > 0  # rows no gradient has reached yet (unseen tokens) skip
            m_hat = s["exp_avg"][seen].double() / (1 - b1 ** t)
            v_hat = s["exp_avg_sq"][seen].double() / (1 - b2 ** t)
            total += float(((m_hat / (v_hat.sqrt() + eps)) ** 2).sum())
            count += int(seen.sum())
    if not count:
        raise ValueError("the optimizer state holds no Adam moments: take a step first")
    return math.sqrt(total / count)


def update_rms_trace(steps: int, **overrides: Any) -> list[float]:
    """adam_update_rms after each of the first `steps` steps of a trainer run, read from the
    optimizer's state by a PyTorch optimizer step hook (the trainer itself is not touched)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    trace: list[float] = []

    def after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        trace.append(adam_update_rms(optimizer.state_dict()))

    handle = register_optimizer_step_post_hook(after_step)
    try:
        run(**{**overrides, "steps": steps})
    finally:
        handle.remove()
    return trace


def warmup_ablation(lr: float, warmup_steps: int, steps: int, **overrides: Any) -> pd.DataFrame:
    """Two runs at the same peak `lr` and schedule, one without warmup and one with
    `warmup_steps`: per-step loss, learning rate and gradient norm (before clipping), one row
    per (warmup_steps, step)."""
    if warmup_steps < 1:
        raise ValueError(f"warmup_steps must be >= 1 to compare with no warmup, got "
                         f"{warmup_steps}")
    frames = []
    for w in (0, warmup_steps):
        res = run(**{**overrides, "lr": lr, "steps": steps, "warmup_steps": w})
        h = pd.DataFrame(res.history)[["step", "loss", "lr", "grad_norm"]]
        frames.append(h.assign(warmup_steps=w))
    return pd.concat(frames, ignore_index=True)


def instability(losses: Sequence[float], vocab_size: int, spike: float = 0.5,
                margin: float = 1.0) -> str:
    """Why a run is unstable, or "" if it is stable. Stable means: every loss is finite; no loss
    after the first exceeds the first by more than `spike` nats (a loss spike); and the mean of
    the last 5 losses is below ln(vocab_size) - `margin` (it learned more than unigram-free
    guessing would give)."""
    if not losses:
        raise ValueError("instability needs at least one loss")
    if vocab_size < 2 or spike < 0 or margin < 0:
        raise ValueError(f"need vocab_size >= 2 and spike, margin >= 0, got {vocab_size}, "
                         f"{spike}, {margin}")
    if not all(math.isfinite(x) for x in losses):
        return "non-finite loss"
    if max(losses[1:], default=losses[0]) > losses[0] + spike:
        return f"spike: loss rose {max(losses[1:]) - losses[0]:.2f} nats above its start"
    final = sum(losses[-5:]) / len(losses[-5:])
    if final >= math.log(vocab_size) - margin:
        return f"did not learn: final loss {final:.2f} >= ln V - {margin:g}"
    return ""


def stability_grid(lrs: Sequence[float], warmups: Sequence[int], steps: int,
                   spike: float = 0.5, margin: float = 1.0, **overrides: Any
                   ) -> tuple[pd.DataFrame, dict[tuple[float, int], list[float]]]:
    """Train every (peak lr, warmup steps) pair for `steps` steps of a constant schedule after
    warmup (so only the warmup differs) and judge each run with `instability`.

    Returns (table, losses): one row per run (lr, warmup_steps, first, peak and final loss,
    stable, why), and each run's per-step training losses."""
    if not lrs or not warmups:
        raise ValueError("stability_grid needs at least one learning rate and one warmup")
    if max(warmups) >= steps:
        raise ValueError(f"warmups up to {max(warmups)} leave no steps at the peak learning "
                         f"rate in a {steps}-step run; give steps > {max(warmups)}")
    rows, histories = [], {}
    for w in sorted(warmups):
        for lr in sorted(lrs):
            res = run(**{**overrides, "steps": steps, "warmup_steps": w, "lr": lr,
                         "schedule": "constant"})
            losses = res.losses()
            why = instability(losses, res.model_config.vocab_size, spike, margin)
            rows.append({"lr": lr, "warmup_steps": w, "first_loss": losses[0],
                         "peak_loss": max(losses), "final_loss": sum(losses[-5:]) / 5,
                         "stable": not why, "why": why})
            histories[(lr, w)] = losses
    return pd.DataFrame(rows), histories


def largest_stable_lr(grid: pd.DataFrame) -> pd.Series:
    """Per warmup length, the largest grid learning rate up to which every run was stable (NaN
    if even the smallest was not): a stable lr above an unstable one does not count."""
    if not {"lr", "warmup_steps", "stable"} <= set(grid.columns):
        raise ValueError("largest_stable_lr needs stability_grid's table (lr, warmup_steps, "
                         "stable)")
    out = {}
    for w, g in grid.sort_values("lr").groupby("warmup_steps"):
        best = math.nan
        for lr, ok in zip(g.lr, g.stable):
            if not ok:
                break
            best = lr
        out[w] = best
    return pd.Series(out, name="largest_stable_lr").rename_axis("warmup_steps")


def wsd_branches(lengths: Sequence[int], decay_frac: float = 0.2,
                 shapes: Sequence[str] = ("1-sqrt", "linear"), workdir: str | Path | None = None,
                 **overrides: Any) -> tuple[pd.DataFrame, dict[tuple[str, int], list[float]]]:
    """One stable run serves every length in `lengths`: WSD's cooldowns (one per shape) branch
    from the stable run's checkpoints at each length's decay start, and each length also gets a
    full cosine run of its own (the cosine floor is overrides' min_lr_ratio; WSD's too).

    A WSD run of N steps is a constant run up to decay_start(N, decay_frac), so resuming that
    checkpoint with the WSD schedule of N steps reproduces the from-scratch WSD run exactly.
    Returns (table, losses): one row per (schedule, steps) with the validation and final
    training loss and the steps it cost (a branch: its cooldown only), and the per-step
    training losses (a branch's include its stable phase)."""
    if not lengths or not shapes:
        raise ValueError("wsd_branches needs at least one length and one decay shape")
    warmup = overrides.get("warmup_steps", TrainConfig.warmup_steps)
    for n in lengths:
        for shape in shapes:
            check_schedule("wsd", n, warmup, decay_frac, shape)
    starts = {n: decay_start(n, decay_frac) for n in lengths}
    base = {k: v for k, v in overrides.items() if k not in ("steps", "schedule")}
    rows, histories = [], {}
    with tempfile.TemporaryDirectory(dir=workdir or scratch_dir()) as tmp:
        stable = Path(tmp) / "stable"
        every = math.gcd(*starts.values())
        longest = max(starts.values())
        res = run(**{**base, "schedule": "constant", "steps": longest, "ckpt_dir": str(stable),
                     "ckpt_every": every})
        histories[("stable", longest)] = res.losses()
        rows.append({"schedule": "stable (constant)", "steps": longest, "val_loss": res.val_loss,
                     "final_loss": sum(res.losses()[-5:]) / 5, "steps_trained": longest})
        for n in sorted(lengths):
            for shape in shapes:
                res = run(**{**base, "schedule": "wsd", "steps": n, "decay_frac": decay_frac,
                             "decay_shape": shape,
                             "resume_from": str(stable / f"step-{starts[n]:06d}.pt")})
                name = f"wsd {shape}"
                histories[(name, n)] = res.losses()
                rows.append({"schedule": name, "steps": n, "val_loss": res.val_loss,
                             "final_loss": sum(res.losses()[-5:]) / 5,
                             "steps_trained": n - starts[n]})
            res = run(**{**base, "schedule": "cosine", "steps": n})
            histories[("cosine", n)] = res.losses()
            rows.append({"schedule": "cosine", "steps": n, "val_loss": res.val_loss,
                         "final_loss": sum(res.losses()[-5:]) / 5, "steps_trained": n})
    return pd.DataFrame(rows), histories


def native_lrs(kind: str, steps: int, lr: float, warmup_steps: int = 0,
               min_lr_ratio: float = 0.0, decay_frac: float = 0.2,
               decay_shape: str = "1-sqrt") -> list[float]:
    """The same schedule from the libraries most training code uses, stepped on a dummy
    optimizer: torch.optim.lr_scheduler for cosine, linear and constant (LinearLR warmup, then
    CosineAnnealingLR / LinearLR / ConstantLR in a SequentialLR), transformers.get_wsd_schedule
    for wsd. transformers warms up from min_lr_ratio * lr at step 0 (ours: lr / warmup_steps),
    so for wsd only the steps from warmup_steps on are comparable."""
    from torch.optim import lr_scheduler as S

    check_schedule(kind, steps, warmup_steps, decay_frac, decay_shape, lr, min_lr_ratio)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    if kind == "wsd":
        from transformers import get_wsd_schedule

        sched = get_wsd_schedule(opt, num_warmup_steps=warmup_steps,
                                 num_decay_steps=steps - decay_start(steps, decay_frac),
                                 num_training_steps=steps, decay_type=decay_shape,
                                 min_lr_ratio=min_lr_ratio)
    else:
        rest = steps - warmup_steps
        after = {"cosine": lambda: S.CosineAnnealingLR(opt, T_max=max(1, rest),
                                                       eta_min=min_lr_ratio * lr),
                 "linear": lambda: S.LinearLR(opt, start_factor=1.0, end_factor=min_lr_ratio,
                                              total_iters=max(1, rest)),
                 "constant": lambda: S.ConstantLR(opt, factor=1.0, total_iters=0)}[kind]
        if warmup_steps:
            warm = S.LinearLR(opt, start_factor=1 / warmup_steps, end_factor=1.0,
                              total_iters=warmup_steps - 1)
            sched = S.SequentialLR(opt, [warm, after()], milestones=[warmup_steps])
        else:
            sched = after()
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out
