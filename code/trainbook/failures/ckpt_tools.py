"""Read, check and convert the trainer's checkpoints: what `python -m trainbook ckpt` runs.

`inspect` says what a checkpoint holds: its step, its files, the bytes of each component
(weights, optimizer state, random state, data position, history, configs), the tensors' dtypes
and whether its checksums are recorded. `verify` judges it: the recorded sha256 of every file,
a `weights_only=True` load, the weights against the model config (names and shapes), every
tensor finite, the optimizer state against the parameters, the training config valid, the step
against the history; any failed check is a problem (the command exits 1). `to_single` turns a
DCP folder into the trainer's single-file format (through the trainer's own `load_sharded`
into one process) and `to_dcp` a single file into a DCP folder (so a DDP run can move to
FSDP); `to_safetensors` writes the weights as a safetensors file that loads back into the
reference model, and `to_hf` a Hugging Face folder (config.json and safetensors weights) that
transformers loads where the architecture maps (`trainbook.bench.hf`).

Chapter: book/failures/checkpointing.
"""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path
from typing import Any

import torch

from ..configs import ModelConfig
from ..model import Transformer
from ..train.checkpoint import (
    EXTRA,
    SUMS,
    checksum_problems,
    is_sharded,
    load_checkpoint,
    load_sharded,
    read_sums,
    save_checkpoint,
    single_process_dcp,
)

TARGETS = ("single", "dcp", "safetensors", "hf")
# what each component of a trainer checkpoint is for (ckpt inspect, the chapter's table)
COMPONENTS = {
    "model": "the weights (fp32: the master copy)",
    "optimizer": "the optimizer's per-parameter state (AdamW: two moments and a step count) "
                 "and its param groups",
    "optim": "the optimizer's per-parameter state, sharded (DCP)",
    "scaler": "fp16 loss scaling: the scale and its growth tracker",
    "rng": "random generator states: torch (CPU, CUDA) and Python, every rank's",
    "loader": "the data position: epoch and step of the seeded order",
    "step": "optimizer steps taken (the learning rate is a function of step and config)",
    "history": "the per-step metrics so far: the loss curve",
    "model_config": "the architecture",
    "train_config": "every training setting (schedule, batch, seed, data)",
    "layout": "the parallel layout it was saved under",
    "data_sha256": "a fingerprint of the training data",
}


def _open(path: str | Path) -> Path:
    path = Path(path)
    if not path.exists():
        raise ValueError(f"no checkpoint at {path}: give a step-NNNNNN.pt file or step-NNNNNN "
                         "folder written by train --ckpt-dir")
    if path.is_dir() and not is_sharded(path):
        raise ValueError(f"{path} is a folder but not a complete DCP checkpoint (no .metadata "
                         f"or {EXTRA}): an interrupted save, or not a checkpoint")
    return path


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def component_rows(state: dict) -> list[dict]:
    """One row per top-level entry of a checkpoint's state: its tensor count, bytes (the
    tensors' data, counted once per storage, or the pickled size of what holds none), dtypes,
    and what it is for."""
    rows = []
    for key, value in state.items():
        ts = _tensors(value)
        seen, nbytes = set(), 0
        for t in ts:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in seen:
                seen.add(ptr)
                nbytes += t.untyped_storage().nbytes()
        if not ts:
            nbytes = len(pickle.dumps(value))
        dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in ts})
        rows.append({"component": key, "tensors": len(ts), "bytes": nbytes,
                     "dtypes": ", ".join(dtypes), "holds": COMPONENTS.get(key, "")})
    return rows


def _dcp_rows(path: Path) -> list[dict]:
    """Component rows of a DCP folder: model and optimizer tensors from its metadata."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    rows = {}
    for fqn, m in meta.items():
        part = fqn.split(".", 1)[0]
        row = rows.setdefault(part, {"component": part, "tensors": 0, "bytes": 0,
                                     "dtypes": set(), "holds": COMPONENTS.get(part, "")})
        if isinstance(m, TensorStorageMetadata):
            row["tensors"] += 1
            row["bytes"] += math.prod(m.size) * m.properties.dtype.itemsize
            row["dtypes"].add(str(m.properties.dtype).removeprefix("torch."))
    for row in rows.values():
        row["dtypes"] = ", ".join(sorted(row["dtypes"]))
    return list(rows.values())


def read_state(path: str | Path) -> dict:
    """A checkpoint's state without the checksum check: a single file's whole state, or a DCP
    folder's extra state (step, configs, history...)."""
    path = _open(path)
    try:
        return load_checkpoint(path / EXTRA if path.is_dir() else path, verify=False)
    except Exception as e:  # truncated, not a torch file, a pickle weights_only refuses
        raise ValueError(f"{path} does not load as a trainbook checkpoint with weights_only=True "
                         f"({type(e).__name__}: {str(e).splitlines()[0][:160]})") from None


def inspect(path: str | Path) -> dict:
    """What a checkpoint holds, as a dict (`python -m trainbook ckpt inspect`)."""
    path = _open(path)
    state = read_state(path)
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    rows = component_rows(state)
    if path.is_dir():
        rows = _dcp_rows(path) + rows
    sums = read_sums(path if path.is_dir() else path.parent)
    listed = [f.name for f in files if f.name in sums]
    hist = state.get("history") or []
    mcfg = state.get("model_config") or {}
    tcfg = state.get("train_config") or {}
    keys = ("batch_size", "grad_accum", "seq_len", "steps", "lr", "schedule", "optimizer",
            "dtype", "seed", "corpus", "tokenizer")
    return {"path": str(path), "kind": "DCP folder" if path.is_dir() else "single file",
            "step": state.get("step"),
            "files": [{"name": f.name, "bytes": f.stat().st_size} for f in files
                      if f.is_file() and f.name != SUMS],
            "bytes_on_disk": sum(f.stat().st_size for f in files if f.is_file()),
            "components": rows,
            "model": {k: mcfg.get(k) for k in ("name", "flavour", "d_model", "n_layers",
                                               "n_heads", "n_kv_heads", "d_ff", "vocab_size")},
            "train": {k: tcfg.get(k) for k in keys if k in tcfg},
            "layout": state.get("layout"),
            "loader": state.get("loader"),
            "last_loss": hist[-1]["loss"] if hist else None,
            "checksums": f"{len(listed)} of {len([f for f in files if f.name != SUMS])} files "
                         f"recorded in {SUMS}"}


def reference_model(model_config: dict, device: str = "cpu") -> Transformer:
    """The reference model a checkpoint's model_config describes (on `device`; "meta" for
    shapes only)."""
    try:
        cfg = ModelConfig(**model_config)
    except (TypeError, ValueError) as e:
        raise ValueError(f"the checkpoint's model_config does not build a model: {e}") from None
    with torch.device(device):
        return Transformer(cfg)


def _check(checks: list, name: str, problems: list[str], ok_detail: str) -> None:
    checks.append({"check": name, "ok": not problems,
                   "detail": "; ".join(problems[:5]) + (f" (+{len(problems) - 5} more)"
                                                        if len(problems) > 5 else "")
                   if problems else ok_detail})


def _weights(path: Path, state: dict) -> dict[str, torch.Tensor]:
    """The model's tensors of a checkpoint (a DCP folder's read through DCP into full ones)."""
    if not path.is_dir():
        return state["model"]
    model = reference_model(state["model_config"])
    import torch.distributed.checkpoint as dcp

    sd = {"model": model.state_dict()}
    with single_process_dcp():
        dcp.load(sd, checkpoint_id=str(path), no_dist=True)
    return sd["model"]


def verify(path: str | Path) -> dict:
    """Check a checkpoint (`python -m trainbook ckpt verify`); {'ok': bool, 'checks': rows}."""
    from ..train import TrainConfig, make_optimizer

    path = _open(path)
    checks: list[dict] = []
    checked, problems = checksum_problems(path)
    _check(checks, "checksums", problems, f"{len(checked)} file(s) match {SUMS}")
    try:
        state = read_state(path)
        weights = _weights(path, state)
    except Exception as e:  # noqa: BLE001 (reported, not raised: verify judges)
        _check(checks, "loads with weights_only=True", [str(e).splitlines()[0]], "")
        return {"path": str(path), "ok": False, "checks": checks}
    _check(checks, "loads with weights_only=True", [], "no code can run on load")
    try:
        ref = reference_model(state["model_config"], "meta").state_dict()
        shape_problems = [f"{k}: missing" for k in ref if k not in weights] + \
            [f"{k}: not in the model" for k in weights if k not in ref] + \
            [f"{k}: shape {tuple(weights[k].shape)}, the model has {tuple(ref[k].shape)}"
             for k in ref if k in weights and weights[k].shape != ref[k].shape]
    except (KeyError, ValueError) as e:
        shape_problems = [f"no usable model_config: {e}"]
    _check(checks, "weights match the model config", shape_problems,
           f"{len(weights)} tensors, names and shapes as the config builds them")
    bad = [k for k, t in weights.items() if t.is_floating_point() and not torch.isfinite(t).all()]
    _check(checks, "weights finite", [f"{k} holds inf or NaN" for k in bad], "no inf or NaN")
    try:
        cfg = TrainConfig(**state["train_config"])
        cfg_problems = []
    except (KeyError, TypeError, ValueError) as e:
        cfg, cfg_problems = None, [f"train_config is not a valid TrainConfig: {e}"]
    _check(checks, "training config valid", cfg_problems, "builds a TrainConfig")
    if "optimizer" in state and cfg is not None and not shape_problems:
        _check(checks, "optimizer state matches the parameters",
               _optimizer_problems(state, cfg, make_optimizer), "one state per parameter, "
               "same shapes")
    hist = state.get("history") or []
    step_problems = [] if state.get("step") == len(hist) and \
        (not hist or hist[-1]["step"] == state.get("step")) else \
        [f"step {state.get('step')} but {len(hist)} history rows"]
    _check(checks, "step matches the history", step_problems, f"step {state.get('step')}")
    return {"path": str(path), "ok": all(c["ok"] for c in checks), "checks": checks}


def _optimizer_problems(state: dict, cfg: Any, make_optimizer: Any) -> list[str]:
    """The saved optimizer state against a fresh optimizer over the model: same parameter
    count, and every per-parameter tensor the shape of its parameter (or a scalar)."""
    model = reference_model(state["model_config"], "meta")
    params = [p for g in make_optimizer(model, cfg).param_groups for p in g["params"]]
    saved = state["optimizer"]
    ids = [i for g in saved["param_groups"] for i in g["params"]]
    if len(ids) != len(params):
        return [f"{len(ids)} parameters in the optimizer state, {len(params)} in the model"]
    out = []
    for i, p in zip(ids, params):
        for name, t in saved["state"].get(i, {}).items():
            if isinstance(t, torch.Tensor) and t.ndim == p.ndim and t.shape != p.shape:
                out.append(f"parameter {i} {name}: shape {tuple(t.shape)}, parameter "
                           f"{tuple(p.shape)}")
    return out


def to_single(path: str | Path, out: str | Path) -> Path:
    """A DCP folder as the trainer's single-file checkpoint (weights, optimizer, extra state),
    loaded into one process by the trainer's load_sharded; resumable wherever the loader's
    data-parallel size matches (`train --resume-from`)."""
    from ..train import TrainConfig, make_optimizer

    path = _open(path)
    if not path.is_dir():
        raise ValueError(f"{path} is already a single file; --to single converts a DCP folder")
    extra = read_state(path)
    model = reference_model(extra["model_config"])
    optimizer = make_optimizer(model, TrainConfig(**extra["train_config"]))
    extra = load_sharded(path, [model], optimizer)
    scaler = torch.amp.GradScaler("cpu", enabled=False).state_dict()
    out = Path(out)
    save_checkpoint(out, {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                          "scaler": scaler, **extra})
    return out


def to_dcp(path: str | Path, out: str | Path) -> Path:
    """A single-file checkpoint as a DCP folder (written by one process with the trainer's
    save_sharded), which any layout with the same data-parallel size resumes from: a DDP run
    that moves to FSDP, TP or PP."""
    from ..train import TrainConfig, make_optimizer
    from ..train.checkpoint import save_sharded

    path = _open(path)
    if path.is_dir():
        raise ValueError(f"{path} is already a DCP folder; --to dcp converts a single file")
    state = read_state(path)
    model = reference_model(state["model_config"])
    model.load_state_dict(state["model"])
    optimizer = make_optimizer(model, TrainConfig(**state["train_config"]))
    optimizer.load_state_dict(state["optimizer"])
    extra = {k: v for k, v in state.items() if k not in ("model", "optimizer", "scaler")}
    save_sharded(out, [model], optimizer, extra)
    return Path(out)


def load_model(path: str | Path) -> tuple[Transformer, dict]:
    """The reference model with a checkpoint's weights (file or DCP folder), and its state
    (a DCP folder: the extra state)."""
    path = _open(path)
    state = read_state(path)
    model = reference_model(state["model_config"])
    model.load_state_dict(_weights(path, state))
    return model, state


def to_safetensors(path: str | Path, out: str | Path) -> Path:
    """The weights as one safetensors file (reference names; the model config and step in its
    metadata). A tied head is stored once; `from_safetensors` ties it again."""
    from safetensors.torch import save_model

    model, state = load_model(path)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_model(model, str(out), metadata={"model_config": json.dumps(state["model_config"]),
                                          "step": str(state.get("step"))})
    return out


def from_safetensors(path: str | Path) -> Transformer:
    """The reference model from a file written by to_safetensors (strict: every tensor)."""
    from safetensors import safe_open
    from safetensors.torch import load_model as load_st

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no safetensors file at {path}: write one with ckpt convert --to "
                         "safetensors")
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    if "model_config" not in meta:
        raise ValueError(f"{path} has no model_config in its metadata: not written by "
                         "ckpt convert --to safetensors")
    model = reference_model(json.loads(meta["model_config"]))
    load_st(model, str(path), strict=True)
    return model


def to_hf(path: str | Path, out: str | Path) -> Path:
    """A Hugging Face folder (config.json, model.safetensors) with the checkpoint's weights,
    for transformers' GPT-2, Llama or Qwen3 classes (trainbook.bench.hf maps the names)."""
    from ..bench.hf import check_supported
    from ..bench.hf import to_hf as hf_model

    model, _ = load_model(path)
    check_supported(model.cfg)
    out = Path(out)
    hf_model(model).save_pretrained(str(out))
    return out


def convert(path: str | Path, to: str, out: str | Path) -> Path:
    """`ckpt convert`: to 'single' (DCP folder -> one file), 'dcp' (one file -> DCP folder),
    'safetensors' or 'hf'."""
    if to not in TARGETS:
        raise ValueError(f"--to must be one of {', '.join(TARGETS)}, got {to!r}")
    return {"single": to_single, "dcp": to_dcp, "safetensors": to_safetensors,
            "hf": to_hf}[to](path, out)
