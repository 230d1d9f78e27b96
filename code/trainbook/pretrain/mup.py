"""muP's two checks on the reference model: the coordinate check and learning-rate transfer.

The coordinate check (Yang et al. 2022, and the `mup` package's "coord check") trains models of
several widths for a few steps and records the average size, mean |x|, of every layer's output
at each step. Under the standard parametrisation (SP: the trainer's "scaled" init with one
learning rate for all) Adam's updates make the outputs grow with width; under muP
(train/init.py) they stay flat. `slopes` fits the growth exponent: log2 of mean |x| against
log2 of the width.

Learning-rate transfer trains each width at a grid of learning rates: under SP the best learning
rate drifts with width, under muP it stays where the base width found it.

Chapter: book/pretraining/initialisation.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch

from ..model import Transformer
from ..train.init import lr_scale, mup_rule, param_kind
from .init_scale import build_model, eval_loss, family, short_run

PARAMETRISATIONS = {"SP": "scaled", "muP": "mup"}  # name in the chapter -> trainer init


def _check_widths(widths: Sequence[int], base_width: int) -> None:
    if len(widths) < 2 or any(w < 1 for w in widths):
        raise ValueError(f"need at least two positive widths, got {list(widths)}")
    if base_width < 1:
        raise ValueError(f"base_width must be positive, got {base_width}")


def _recorders(model: Transformer, sink: dict[str, float]) -> list:
    """Forward hooks that store mean |output| of the embedding, each block's attention and MLP
    (what each adds to the residual stream) and the logits (after muP's output multiplier)."""
    named = [("embed", model.embed), ("logits", model.head)]
    for i, block in enumerate(model.blocks):
        named += [(f"attn.{i}", block.attn), (f"mlp.{i}", block.mlp)]

    def hook(name):
        return lambda mod, args, out: sink.__setitem__(name, float(out.detach().abs().mean()))
    return [module.register_forward_hook(hook(name)) for name, module in named]


def rules_table(model: Transformer) -> pd.DataFrame:
    """What muP did to each parameter of `model` (initialised under "mup"): its class, the
    factor on its init std, on its learning rate (read back through `lr_scale`, as the
    optimizer does) and on its module's output. Blocks are alike: one row per name with the
    block index written "i"."""
    m = getattr(model, "mup_width_mult", None)
    if m is None:
        raise ValueError("the model was not initialised under mup")
    rows = {}
    for name, p in model.named_parameters():
        parts = name.split(".")
        key = ".".join("i" if parts[0] == "blocks" and k == 1 else x for k, x in enumerate(parts))
        kind = param_kind(name, p.dim())
        rows.setdefault(key, {"parameter": key, "shape": tuple(p.shape), "kind": kind,
                              "init_std x": mup_rule(kind, m).init_std,
                              "lr x": lr_scale(model, name, "mup"),
                              "output x": mup_rule(kind, m).multiplier})
    return pd.DataFrame(rows.values()).set_index("parameter")


def coord_check(widths: Sequence[int], blocks: torch.Tensor, base_width: int, lr: float = 1e-2,
                steps: int = 4, batch_size: int = 8, n_layers: int = 2, seed: int = 0,
                parametrisations: Sequence[str] = ("SP", "muP"), device: str = "cpu"
                ) -> pd.DataFrame:
    """Mean |x| of each layer's output at steps 1..`steps` (step 1: at initialisation, the
    forward before the first update) for every width and parametrisation; Adam at a constant
    learning rate `lr`, the same data for all. One row per (parametrisation, width, step,
    layer)."""
    _check_widths(widths, base_width)
    rows = []
    for name in parametrisations:
        init = PARAMETRISATIONS[name]
        for width in widths:
            cfg = family(width, n_layers=n_layers, seq_len=blocks.shape[1] - 1)
            model = build_model(cfg, init, seed, base_width)
            sink: dict[str, float] = {}
            hooks = _recorders(model, sink)

            def record(step, _model, width=width, name=name, sink=sink):
                rows.extend({"param": name, "width": width, "step": step + 1, "layer": k,
                             "l1": v} for k, v in sink.items())
            short_run(model, init, blocks, lr, steps, batch_size, seed=seed, on_step=record,
                      device=device)
            for h in hooks:
                h.remove()
    return pd.DataFrame(rows)


def slopes(coords: pd.DataFrame, step: int | None = None) -> pd.DataFrame:
    """Least-squares slope of log2(mean |x|) against log2(width) for each parametrisation and
    layer at `step` (default: the last recorded): 0 is flat in width, 1 doubles with it."""
    step = int(coords.step.max()) if step is None else step
    at = coords[coords.step == step]
    if at.empty:
        raise ValueError(f"no coordinates recorded at step {step}")
    rows = []
    for (param, layer), g in at.groupby(["param", "layer"], sort=False):
        slope = np.polyfit(np.log2(g.width), np.log2(g.l1), 1)[0]
        rows.append({"param": param, "layer": layer, "slope": float(slope)})
    return pd.DataFrame(rows).pivot(index="layer", columns="param", values="slope")


def lr_sweep(widths: Sequence[int], lrs: Sequence[float], blocks: torch.Tensor,
             val_blocks: torch.Tensor, base_width: int, steps: int = 50, batch_size: int = 8,
             n_layers: int = 2, warmup_steps: int = 5, seed: int = 0,
             parametrisations: Sequence[str] = ("SP", "muP"), device: str = "cpu"
             ) -> pd.DataFrame:
    """Train every (parametrisation, width, learning rate) for `steps` steps from the same
    seed on the same batches; `loss` is the loss on `val_blocks` after training (inf if the
    run diverged). At the base width muP is SP, so that run is shared. One row per run."""
    _check_widths(widths, base_width)
    if not lrs or min(lrs) <= 0:
        raise ValueError(f"need positive learning rates, got {list(lrs)}")
    rows, done = [], {}
    for name in parametrisations:
        init = PARAMETRISATIONS[name]
        for width in widths:
            cfg = family(width, n_layers=n_layers, seq_len=blocks.shape[1] - 1)
            for lr in lrs:
                key = ("scaled" if width == base_width else init, width, lr)
                if key not in done:
                    model = build_model(cfg, key[0], seed, base_width)
                    losses = short_run(model, key[0], blocks, lr, steps, batch_size,
                                       warmup_steps, seed=seed, device=device)
                    done[key] = (eval_loss(model, val_blocks) if np.isfinite(losses[-1])
                                 else float("inf"))
                rows.append({"param": name, "width": width, "lr": lr, "loss": done[key]})
    return pd.DataFrame(rows)


def best_lrs(sweep: pd.DataFrame) -> pd.DataFrame:
    """The best learning rate for each parametrisation and width: the grid's minimum refined
    by a parabola through it and its two neighbours in log2(lr) (a grid edge stays as it is),
    and its log2 distance from the smallest width's best (0: it transferred)."""
    if sweep.empty:
        raise ValueError("empty sweep")
    rows = []
    for (param, width), g in sweep.groupby(["param", "width"], sort=False):
        g = g.sort_values("lr")
        x, y = np.log2(g.lr.to_numpy()), g.loss.to_numpy()
        i = int(np.argmin(y))
        best = x[i]
        if 0 < i < len(x) - 1 and np.isfinite(y[i - 1:i + 2]).all():
            a, b, _ = np.polyfit(x[i - 1:i + 2], y[i - 1:i + 2], 2)
            best = -b / (2 * a) if a > 0 else best
        rows.append({"param": param, "width": width, "grid_lr": 2.0 ** x[i],
                     "best_lr": 2.0 ** best, "loss": y[i]})
    out = pd.DataFrame(rows)
    out["shift_log2"] = np.log2(out.best_lr / out.groupby("param").best_lr.transform("first"))
    return out
