"""Training sweeps: the reference model trained at many sizes and lengths, for fitting laws.

It sits above the trainer (it runs it), so the analytic scaling-law code in
`trainbook.compute.scaling` stays free of the runtime.

Chapter: book/compute/scaling-laws ("Fitting your own").
"""

from __future__ import annotations

import contextlib
import io
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from .. import configs
from ..launch import threads
from ..train import TrainConfig, train


def train_sweep(shapes: Sequence[tuple[int, int]], steps: Sequence[int], **train_kwargs: Any
                ) -> tuple[pd.DataFrame, dict[tuple[int, int, int], list[float]]]:
    """Train the reference model at each (d_model, n_layers) in `shapes` for each step count.

    Returns (table, histories): one row per run with N (all parameters, Chinchilla's count),
    N_nonembed (Kaplan's), D (training tokens), C = 6ND, the final validation loss and the
    final training loss (mean of the last 5 steps); histories maps (d_model, n_layers, steps)
    to the per-step training losses. Every run gets its own cosine schedule matched to its
    length, as Chinchilla does. Extra keyword arguments go to TrainConfig.
    """
    if not shapes or not steps:
        raise ValueError("train_sweep needs at least one shape and one step count")
    base = {"model": "tiny-llama", "tokenizer": "bytes", "seq_len": 64, "batch_size": 16,
            "lr": 3e-3, "progress": False, "log_every": 0, "eval_batches": 8}
    base.update(train_kwargs)
    rows, histories = [], {}
    with threads(1):  # tiny models are overhead-bound: spare the threads
        for d_model, n_layers in shapes:
            heads = max(1, d_model // 16)
            for n_steps in steps:
                cfg = TrainConfig(**{"d_model": d_model, "n_layers": n_layers, "n_heads": heads,
                                     "n_kv_heads": heads, "d_ff": (8 * d_model // 3 + 7) // 8 * 8,
                                     "steps": n_steps, "warmup_steps": min(10, n_steps // 5),
                                     **base})
                t0 = time.perf_counter()
                with contextlib.redirect_stdout(io.StringIO()):  # the trainer's "done" line
                    res = train(cfg)
                counts = configs.param_counts(res.model_config)
                losses = res.losses()
                D = n_steps * cfg.batch_size * cfg.seq_len * cfg.grad_accum
                rows.append({"d_model": d_model, "n_layers": n_layers, "steps": n_steps,
                             "N": counts["total"], "N_nonembed": counts["non_embedding"], "D": D,
                             "C": 6 * counts["total"] * D, "loss": res.val_loss,
                             "train_loss": float(np.mean(losses[-5:])),
                             "seconds": time.perf_counter() - t0})
                histories[(d_model, n_layers, n_steps)] = losses
    return pd.DataFrame(rows), histories
