"""The chapter's MoE experiments, each a set of `moe_runs` runs on the same seeds and batches,
and their storage: collapse and its fixes, the capacity factor, runs compared by loss against
training FLOPs (dense against MoE, expert granularity and shared experts), and upcycling.

The notebook runs the short ones live; `write_study` stores the longer, multi-seed ones with
their provenance (the command that regenerates them, date, versions, machine; the trainer is
deterministic on a CPU, so the tests re-run a stored point and find the same numbers) and
`read_study` reads them back.

Chapter: book/frontier/moe.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from ..bench.gpu_truth import header, read_record, write_record
from ..configs import resolve
from . import moe_router as R
from . import moe_runs as M
from .moe_layer import MoEOptions

SWITCH = MoEOptions(balance="switch", balance_coef=1e-2)  # Fedus et al.: alpha = 1e-2
COLLAPSE_VARIANTS: dict[str, MoEOptions] = {
    "no balancing": MoEOptions(),
    "Switch loss 0.01": SWITCH,
    "sequence-wise loss 0.01": MoEOptions(balance="sequence", balance_coef=1e-2),
    "z-loss 0.001": MoEOptions(z_coef=1e-3),
    "Switch loss 0.01 + z-loss 0.001": MoEOptions(balance="switch", balance_coef=1e-2,
                                                  z_coef=1e-3),
    "sigmoid, no bias": MoEOptions(router="sigmoid"),
    "sigmoid + bias, gamma 0.001": MoEOptions(router="sigmoid", bias_gamma=1e-3),
    "sigmoid + bias, gamma 0.01": MoEOptions(router="sigmoid", bias_gamma=1e-2),
}
# Equal active FLOPs (k x d_ff = 128 per layer) and, but for 16 x 64, equal total MLP
# parameters (E x d_ff = 512, as the wide dense model): (n_experts, top_k, d_ff), options,
# shared experts
SHAPES: dict[str, tuple[tuple[int, int, int], MoEOptions | None, int]] = {
    "dense, d_ff 128": ((1, 1, 128), None, 0),
    "dense, d_ff 512": ((1, 1, 512), None, 0),
    "MoE 8 x 64, top-2": ((8, 2, 64), SWITCH, 0),
    "MoE 16 x 64, top-2": ((16, 2, 64), SWITCH, 0),
    "MoE 16 x 32, top-4": ((16, 4, 32), SWITCH, 0),
    "MoE 1 shared + 15 x 32, top-3": ((16, 3, 32), MoEOptions(balance="switch", balance_coef=1e-2,
                                                              n_shared=1), 1),
}
STUDIES = ("collapse", "capacity", "compare", "upcycle")
THIN = 10  # stored loss curves keep every THIN-th step (and every evaluation)


def _seeds(seeds: Sequence[int]) -> list[int]:
    if not seeds or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in seeds):
        raise ValueError(f"seeds must be a non-empty list of whole numbers >= 0, got {seeds!r}")
    return list(seeds)


def _pick(names: Sequence[str], known: dict) -> list[str]:
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"unknown or no names {unknown}; choose from {', '.join(known)}")
    return list(names)


def step_loads(history: list[dict]) -> pd.DataFrame:
    """Per step: the busiest expert over the mean and the normalised entropy of the load, for
    the worst layer (largest max/mean, smallest entropy)."""
    rows = []
    for r in history:
        stats = [R.load_stats(torch.tensor(c)) for c in r["expert_counts"]]
        rows.append({"step": r["step"], "max_over_mean": max(s["max_over_mean"] for s in stats),
                     "entropy": min(s["entropy"] for s in stats)})
    return pd.DataFrame(rows)


def collapse_study(variants: Sequence[str] = tuple(COLLAPSE_VARIANTS), seeds: Sequence[int] = (0,),
                   shape: tuple[int, int, int] = (8, 2, 64), **overrides: Any
                   ) -> tuple[pd.DataFrame, dict[tuple[str, int], pd.DataFrame]]:
    """Train the proxy once per routing recipe and seed; (table, per-step loads). The table has,
    per run, the load over the last `moe_runs.WINDOW` steps of its worst layer, the dead experts
    summed over layers, the router z statistic (mean squared log-sum-exp of the router logits)
    over those steps, and the validation loss."""
    rows, hist = [], {}
    for seed in _seeds(seeds):
        cfg = M.proxy_config(*shape, seed=seed, **overrides)
        for name in _pick(variants, COLLAPSE_VARIANTS):
            res = M.run(cfg, COLLAPSE_VARIANTS[name])
            loads = M.load_table(res.history)
            rows.append({"variant": name, "seed": seed,
                         "max_over_mean": loads.max_over_mean.max(),
                         "entropy": loads.entropy.min(), "dead": int(loads.dead.sum()),
                         "router_z": sum(r["z_loss"] for r in res.history[-M.WINDOW:])
                         / M.WINDOW, "val_loss": res.val_loss})
            hist[(name, seed)] = step_loads(res.history)
    return pd.DataFrame(rows), hist


def capacity_study(factors: Sequence[float | None] = (0.5, 1.0, 1.25, 2.0, None),
                   balances: Sequence[str] = ("no balancing", "Switch loss 0.01"),
                   seeds: Sequence[int] = (0,), shape: tuple[int, int, int] = (8, 2, 64),
                   **overrides: Any) -> pd.DataFrame:
    """Train with each capacity factor (None: dropless) under each balancing recipe; the share
    of assignments dropped over the last window, and the validation loss (evaluated with the
    same capacity)."""
    rows = []
    for seed in _seeds(seeds):
        cfg = M.proxy_config(*shape, seed=seed, **overrides)
        for name in _pick(balances, COLLAPSE_VARIANTS):
            for cf in factors:
                opts = replace(COLLAPSE_VARIANTS[name], capacity_factor=cf)
                res = M.run(cfg, opts)
                tail = res.history[-M.WINDOW:]
                rows.append({"balance": name, "capacity_factor": cf, "seed": seed,
                             "dropped": sum(r["dropped_frac"] for r in tail) / len(tail),
                             "val_loss": res.val_loss})
    return pd.DataFrame(rows)


def compare_study(names: Sequence[str] = tuple(SHAPES), seeds: Sequence[int] = (0,),
                  **overrides: Any) -> pd.DataFrame:
    """Train each of SHAPES; loss and validation loss against training FLOPs, per run."""
    out = []
    for seed in _seeds(seeds):
        for name in _pick(names, SHAPES):
            shape, opts, shared = SHAPES[name]
            res = M.run(M.proxy_config(*shape, seed=seed, **overrides), opts)
            curve = M.loss_curve(res, shared)
            curve.insert(0, "seed", seed)
            curve.insert(0, "run", name)
            out.append(curve)
    return pd.concat(out, ignore_index=True)


def upcycle_study(dense_steps: int, moe_steps: int, seeds: Sequence[int] = (0,),
                  n_experts: int = 8, top_k: int = 2, d_ff: int = 128,
                  options: MoEOptions = SWITCH, **overrides: Any) -> pd.DataFrame:
    """A dense proxy (MLP width d_ff) trained `dense_steps`, then three ways to spend the same
    compute: its upcycled MoE (every expert the dense MLP) trained `moe_steps`; the dense model
    trained on for as many FLOPs; and the MoE trained from scratch for the FLOPs of both phases.
    Each run has its own full schedule (warmup, cosine), so each ends annealed. Loss against
    training FLOPs, the dense phase's included for the continued runs."""
    for name, v in (("dense_steps", dense_steps), ("moe_steps", moe_steps)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 2:
            raise ValueError(f"{name} must be a whole number >= 2, got {v!r}")
    out = []
    for seed in _seeds(seeds):
        dense_cfg = M.proxy_config(1, 1, d_ff, seed=seed, steps=dense_steps, **overrides)
        dense = M.run(dense_cfg)
        moe_cfg = M.proxy_config(n_experts, top_k, d_ff, seed=seed, steps=dense_steps,
                                 **overrides)
        ratio = M.flops_per_token(resolve(moe_cfg.model), dense_cfg.seq_len) / \
            M.flops_per_token(resolve(dense_cfg.model), dense_cfg.seq_len)
        base = M.loss_curve(dense)
        start = base.flops.iloc[-1]
        more = {"seed": seed + 1000, **overrides}  # new batches for the continued runs
        runs = {"upcycled MoE": M.upcycled_run(dense, M.proxy_config(
                    n_experts, top_k, d_ff, steps=moe_steps, **more), options),
                "dense, trained on": M.run(M.proxy_config(
                    1, 1, d_ff, steps=round(moe_steps * ratio), **more),
                    hooks=[M.StartFrom(dense)])}
        for name, res in runs.items():
            curve = M.loss_curve(res)
            curve["flops"] += start
            out.append(curve.assign(run=name, seed=seed))
        scratch = M.run(replace(moe_cfg, steps=round(dense_steps / ratio) + moe_steps), options)
        out += [base.assign(run="dense", seed=seed),
                M.loss_curve(scratch).assign(run="MoE from scratch", seed=seed)]
    return pd.concat(out, ignore_index=True)


def thin(curves: pd.DataFrame, every: int = THIN) -> pd.DataFrame:
    """Loss curves kept at every `every`-th step, at every evaluation and at each run's last
    step (what a stored study keeps)."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"every must be a whole number >= 1, got {every!r}")
    if "step" not in curves:
        return curves
    last = curves.groupby(["run", "seed"]).step.transform("max") if "run" in curves else \
        curves.step.max()
    keep = (curves.step % every == 0) | (curves.step == last)
    if "val_loss" in curves:
        keep |= curves.val_loss.notna()
    return curves[keep].reset_index(drop=True)


_RUNNERS = {"collapse": collapse_study, "capacity": capacity_study, "compare": compare_study,
            "upcycle": upcycle_study}


def write_study(path: str | Path, study: str, **kwargs: Any) -> Path:
    """Run one of STUDIES with `kwargs` and store it, with its provenance, as JSON."""
    if study not in STUDIES:
        raise ValueError(f"study must be one of {', '.join(STUDIES)}, got {study!r}")
    args = ", ".join([repr(str(path)), repr(study)] + [f"{k}={v!r}" for k, v in kwargs.items()])
    command = f'python -c "from trainbook.frontier import moe_studies as S; ' \
              f'S.write_study({args})"'
    result = _RUNNERS[study](**kwargs)
    record = header(f"moe-{study}", command, torch.device("cpu"), "small")
    record.update(study=study, arguments={k: v for k, v in kwargs.items()}, proxy=M.PROXY)
    if study == "collapse":  # the table; the per-step loads are for plotting live runs
        record["table"] = result[0].to_dict(orient="records")
    else:
        record["table"] = thin(result).to_dict(orient="records")
    path = Path(path)
    return write_record(path.parent, path.stem, record)


def read_study(path: str | Path, study: str) -> tuple[dict, pd.DataFrame]:
    """(record, table) of a stored study."""
    if study not in STUDIES:
        raise ValueError(f"study must be one of {', '.join(STUDIES)}, got {study!r}")
    record = read_record(path, f"moe-{study}", f"moe_studies.write_study(path, {study!r})")
    return record, pd.DataFrame(record["table"])
