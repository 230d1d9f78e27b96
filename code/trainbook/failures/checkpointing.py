"""Checkpointing: what a checkpoint costs, how a write fails, and how to load one safely.

`state_sizes` and `stall_table` size a full checkpoint from the memory estimator (12 bytes per
parameter for AdamW: fp32 weights and two moments; `compute.cost.checkpoint_bytes`) and turn it
into the stall of a synchronous save at a write bandwidth, and into the checkpoint interval a
given overhead budget allows. `crash_during_write` kills real writer processes with SIGKILL in
the middle of torch.save, one writing the way most scripts do (straight to the final name)
and one the trainer's way (temporary file, fsync, rename), and reports what is left on disk.
`flip_bit` corrupts one bit of a tensor inside a checkpoint file, as a bad disk or a bad copy
does (torch.load accepts it; the recorded sha256 does not). `write_pickle_payload` stores an
object whose unpickling runs code: `weights_only=True` refuses it. `save_stall` measures what
a synchronous save costs the training loop against DCP's `async_save` (staging copy, then a
background write), and `trainer_stall` the same in the trainer (`--ckpt-async`).
Sharded checkpoints across layouts are in `ckpt_layouts`.

Chapter: book/failures/checkpointing.
"""

from __future__ import annotations

import os
import shutil
import signal
import struct
import subprocess
import sys
import time
import zipfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ..compute import cost
from ..train import TrainConfig, model_config, train
from ..train.checkpoint import (
    RATE_ENV,
    SUMS,
    load_checkpoint,
    save_checkpoint,
    single_process_dcp,
)
from ..train.hooks import Hook, StepContext

GB = 1e9


# ---------------------------------------------------------------------------------------------
# Size and stall
# ---------------------------------------------------------------------------------------------

def state_sizes(models: tuple[str, ...] = ("llama-3-8b", "llama-3-70b", "llama-3-405b"),
                dtype: str = "bf16", optimizer: str = "adamw") -> list[dict]:
    """Per model: parameters and the bytes of a full checkpoint by component (decimal GB)."""
    from ..configs import param_counts, resolve

    rows = []
    for name in models:
        b = cost.checkpoint_bytes(name, dtype, optimizer)
        rows.append({"model": name, "params_B": param_counts(resolve(name))["total"] / 1e9,
                     "weights_GB": b["weights"] / GB, "optimizer_GB": b["optimizer"] / GB,
                     "total_GB": sum(b.values()) / GB})
    return rows


def stall_table(model: str = "llama-3-405b", nodes: int = 2048,
                per_node_gbps: tuple[float, ...] = (0.1, 1.0, 10.0),
                fs_gbps: float = cost.LLAMA3_STORAGE_GBPS, overhead: float = 0.01,
                mtbf_s: float | None = None) -> list[dict]:
    """The stall of a synchronous full checkpoint of `model` when each of `nodes` nodes writes
    its share at `per_node_gbps` (capped by the file system's `fs_gbps`), the shortest interval
    that keeps checkpoint stalls under `overhead` of the time (delta / tau = overhead), and
    Young's interval for the cluster MTBF (default: Llama 3's for 8 GPUs per node)."""
    if not 0 < overhead < 1:
        raise ValueError(f"overhead must be a fraction in (0, 1), e.g. 0.01 for 1%, got "
                         f"{overhead}")
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    nbytes = sum(cost.checkpoint_bytes(model).values())
    if mtbf_s is None:
        mtbf_s = cost.cluster_mtbf_hours(8 * nodes, cost.LLAMA3_MTBF_GPU_HOURS) * 3600
    rows = []
    for per_node in per_node_gbps:
        bw = min(nodes * per_node, fs_gbps)
        delta = cost.checkpoint_seconds(nbytes, bw)
        rows.append({"per_node_GBps": per_node, "job_GBps": bw, "stall_s": delta,
                     "min_interval_min": delta / overhead / 60,
                     "young_interval_min": cost.young_interval(delta, mtbf_s) / 60,
                     "waste_at_young": cost.first_order_waste(
                         cost.young_interval(delta, mtbf_s), delta, mtbf_s)})
    return rows


# ---------------------------------------------------------------------------------------------
# A writer killed in the middle of a write
# ---------------------------------------------------------------------------------------------

def rewrite(path: str, atomic: bool) -> None:
    """(Run in a child process.) Load the checkpoint at `path` and write it again as the next
    step, to the same name: atomically (the trainer's save_checkpoint) or straight to the
    final name, as `torch.save(state, path)` does. TRAINBOOK_CKPT_WRITE_MBPS slows both."""
    from ..train.checkpoint import HashingWriter, write_rate_limit

    state = load_checkpoint(path)
    state["step"] += 1
    if atomic:
        save_checkpoint(path, state)
        return
    with open(path, "wb") as fh:  # truncates the old checkpoint at once
        torch.save(state, HashingWriter(fh, write_rate_limit()))


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except FileNotFoundError:
        return -1


METHODS = {"plain": "torch.save(state, path)", "atomic": "tmp, fsync, rename (the trainer's)"}


def crash_during_write(folder: str | Path, mbytes: float = 4.0, rate_mbps: float = 4.0,
                       timeout_s: float = 60) -> list[dict]:
    """For each write method (METHODS), in its own subfolder of `folder` at once: write a
    checkpoint of about `mbytes` MB (step 1) to latest.pt, start a child process that writes
    step 2 to the same name (`rewrite`) at `rate_mbps` MB/s, and SIGKILL it once a quarter of
    the new bytes are out. Per method: what is on disk, and whether latest.pt still loads and
    at which step."""
    n = max(1, int(mbytes * 1e6 / 4))
    env = {**os.environ, RATE_ENV: str(rate_mbps), "OMP_NUM_THREADS": "1"}
    runs = {}
    for method in METHODS:
        path = Path(folder) / method / "latest.pt"
        save_checkpoint(path, {"model": {"w": torch.randn(n, generator=torch.Generator()
                                                          .manual_seed(0))}, "step": 1})
        atomic = method == "atomic"
        code = ("from trainbook.failures import checkpointing as c; "
                f"c.rewrite({str(path)!r}, {atomic})")
        child = subprocess.Popen([sys.executable, "-c", code], env=env,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        runs[method] = {"path": path, "size": path.stat().st_size, "child": child,
                        "target": path.with_suffix(".pt.tmp") if atomic else path,
                        "killed_at": None}
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and any(r["killed_at"] is None and
                                                  r["child"].poll() is None
                                                  for r in runs.values()):
            for r in runs.values():
                now = _size(r["target"])
                # the plain write truncates first: wait until it is rewriting, not the old file
                if r["killed_at"] is None and 0 < now < r["size"] and now >= r["size"] // 4:
                    r["child"].send_signal(signal.SIGKILL)
                    r["killed_at"] = now
            time.sleep(0.002)
        for r in runs.values():
            r["child"].wait(timeout=10)
    finally:
        for r in runs.values():
            if r["child"].poll() is None:
                r["child"].kill()
                r["child"].wait()
    out = []
    for method, r in runs.items():
        err = r["child"].stderr.read().decode()[-500:]
        r["child"].stderr.close()
        if r["killed_at"] is None:
            raise RuntimeError(f"the {method} writer finished or failed before it could be "
                               f"killed (exit {r['child'].returncode}): {err}")
        try:
            step, error = load_checkpoint(r["path"])["step"], None
        except Exception as e:  # noqa: BLE001 (what a resume would meet)
            step, error = None, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        out.append({"method": METHODS[method], "exit": r["child"].returncode,
                    "bytes_when_killed": r["killed_at"], "full_bytes": r["size"],
                    "files": {p.name: p.stat().st_size for p in sorted(r["path"].parent.iterdir())
                              if p.name != SUMS},
                    "loads": error is None, "step": step, "error": error})
    return out


# ---------------------------------------------------------------------------------------------
# Silent corruption and unsafe pickles
# ---------------------------------------------------------------------------------------------

def _storage_key(path: Path, tensor: str) -> str:
    """The zip record of a trainer checkpoint's model tensor: torch.save numbers storages in
    the order it pickles them, and the trainer's state starts with the model's tensors."""
    model = load_checkpoint(path, verify=False).get("model", {})
    seen: dict[int, int] = {}
    for name, t in model.items():
        key = seen.setdefault(t.untyped_storage().data_ptr(), len(seen))
        if name == tensor:
            return str(key)
    raise ValueError(f"{path} has no model tensor {tensor!r}; names: {', '.join(list(model)[:6])}"
                     " ...")


def flip_bit(path: str | Path, tensor: str = "blocks.0.attn.q.weight") -> dict:
    """Flip the top exponent bit of the middle element of one of a trainer checkpoint's model
    tensors in the file, in place, as a bad disk or copy might: the zip stays valid and
    torch.load does not notice. Returns the tensor, the byte offset and the element's value
    before and after (a weight below 2 in magnitude grows 2**128-fold)."""
    path = Path(path)
    key = _storage_key(path, tensor)
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(f"/data/{key}"))
    with open(path, "r+b") as fh:
        fh.seek(info.header_offset)
        header = fh.read(30)
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        start = info.header_offset + 30 + name_len + extra_len
        element = (info.file_size // 2) // 4 * 4  # a float32 element's first byte
        fh.seek(start + element)
        raw = bytearray(fh.read(4))
        before = struct.unpack("<f", bytes(raw))[0]
        raw[3] ^= 0x40  # the exponent's top bit: x * 2**128 (or / 2**128)
        fh.seek(start + element)
        fh.write(raw)
    return {"tensor": tensor, "offset": start + element, "before": before,
            "after": struct.unpack("<f", bytes(raw))[0]}


class _RunsOnLoad:
    """An object whose unpickling executes `source` (pickle calls exec with it)."""

    def __init__(self, source: str):
        self.source = source

    def __reduce__(self):
        return (exec, (self.source,))


def write_pickle_payload(path: str | Path, marker: str | Path) -> Path:
    """A checkpoint-looking file with weights and an object whose unpickling creates the file
    `marker`: harmless, but it could run anything. Loading it with weights_only=False runs it."""
    source = f"open({str(marker)!r}, 'w').write('written by code inside a checkpoint')"
    path = Path(path)
    torch.save({"model": {"w": torch.zeros(4)}, "step": 1, "note": _RunsOnLoad(source)}, path)
    return path


def try_load(path: str | Path, weights_only: bool) -> str:
    """'loaded', or the error type and the line of its message that says what was refused."""
    import re

    try:
        torch.load(path, map_location="cpu", weights_only=weights_only)
    except Exception as e:  # noqa: BLE001 (shown, not raised)
        lines = [re.sub(r"\x1b\[[0-9;]*m", "", x).strip() for x in str(e).splitlines()]
        lines = [x for x in lines if x]
        why = next((x for x in lines if "Unsupported global" in x), lines[0] if lines else "")
        return f"{type(e).__name__}: {why[:200]}"
    return "loaded"


# ---------------------------------------------------------------------------------------------
# Synchronous against asynchronous saves
# ---------------------------------------------------------------------------------------------

def _state_of(mbytes: float) -> dict:
    n = max(1, int(mbytes * 1e6 / 4 / 8))
    g = torch.Generator().manual_seed(0)
    return {"model": {f"w{i}": torch.randn(n, generator=g) for i in range(8)}}


def save_stall(folder: str | Path, mbytes: float = 64.0, repeats: int = 3) -> dict:
    """Seconds the caller waits for a checkpoint of `mbytes` MB (median of `repeats`): the
    trainer's atomic torch.save, DCP's synchronous save, and DCP's async_save until it returns
    (the stall: a staging copy) and until the write is done. Also checks what async saving
    rests on: weights changed right after async_save returns are saved as they were."""
    import statistics

    if repeats < 1 or not mbytes > 0:
        raise ValueError(f"need repeats >= 1 and mbytes > 0, got {repeats}, {mbytes}")
    folder = Path(folder)
    state = _state_of(mbytes)
    times: dict[str, list[float]] = {"torch_save_s": [], "dcp_save_s": [], "async_stall_s": [],
                                     "async_total_s": []}
    snapshot_ok = True
    for i in range(repeats):
        with single_process_dcp():
            snapshot_ok &= _one_of_each(folder, i, state, times)
    shutil.rmtree(folder, ignore_errors=True)
    out: dict[str, Any] = {k: statistics.median(v) for k, v in times.items()}
    out.update(mbytes=mbytes, repeats=repeats, snapshot_ok=snapshot_ok)
    return out


def _one_of_each(folder: Path, i: int, state: dict, times: dict[str, list[float]]) -> bool:
    """One timed save of each kind (save_stall); whether the async save kept the weights as
    they were when it returned."""
    import torch.distributed.checkpoint as dcp

    t0 = time.perf_counter()
    save_checkpoint(folder / f"single-{i}.pt", state)
    times["torch_save_s"].append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    dcp.save(state, checkpoint_id=str(folder / f"sync-{i}"), no_dist=True)
    times["dcp_save_s"].append(time.perf_counter() - t0)
    before = state["model"]["w0"].clone()
    t0 = time.perf_counter()
    future = dcp.async_save(state, checkpoint_id=str(folder / f"async-{i}"), no_dist=True)
    times["async_stall_s"].append(time.perf_counter() - t0)
    for w in state["model"].values():  # training goes on: the next step changes them
        w.add_(1.0)
    future.result()
    times["async_total_s"].append(time.perf_counter() - t0)
    back = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()}}
    dcp.load(back, checkpoint_id=str(folder / f"async-{i}"), no_dist=True)
    return torch.equal(back["model"]["w0"], before)


class StepClock(Hook):
    """Records the wall-clock at the end of every step: the gap between two steps includes
    whatever the loop did between them (a checkpoint)."""

    def __init__(self):
        self.times: list[tuple[int, float]] = []

    def after_update(self, ctx: StepContext) -> None:
        self.times.append((ctx.step, time.perf_counter()))


def trainer_stall(cfg: TrainConfig, ckpt_every: int = 2) -> dict:
    """Train `cfg` twice with a checkpoint every `ckpt_every` steps, synchronous and
    `ckpt_async`; for each, the median gap between steps that follow a checkpoint and steps
    that do not, and their difference: what one checkpoint costs the loop."""
    import statistics
    import tempfile

    from ..launch import threads

    if cfg.steps < 3 * ckpt_every:
        raise ValueError(f"give at least {3 * ckpt_every} steps for {ckpt_every}-step intervals")
    out = {}
    for mode in (False, True):
        clock = StepClock()
        with tempfile.TemporaryDirectory() as tmp, threads(1):
            train(replace(cfg, ckpt_dir=tmp, ckpt_every=ckpt_every, ckpt_async=mode,
                          log_every=0, progress=False), hooks=[clock])
        gaps = [(s, t - t0) for (_, t0), (s, t) in zip(clock.times, clock.times[1:])]
        after = [g for s, g in gaps[1:] if (s - 1) % ckpt_every == 0]
        plain = [g for s, g in gaps[1:] if (s - 1) % ckpt_every]
        key = "async" if mode else "sync"
        out[key] = {"step_s": statistics.median(plain),
                    "stall_s": statistics.median(after) - statistics.median(plain)}
    return out


def tiny_config(**overrides: Any) -> TrainConfig:
    """The chapters' small run: a one-layer Llama on bytes, a few steps, quiet."""
    base = dict(model="tiny-llama", tokenizer="bytes", d_model=32, n_layers=2, n_heads=2,
                n_kv_heads=2, d_ff=64, seq_len=32, batch_size=4, steps=8, warmup_steps=2,
                log_every=0, progress=False, eval_batches=1, device="cpu")
    return TrainConfig(**{**base, **overrides})


def model_bytes_check(cfg: TrainConfig, state: dict) -> dict:
    """A trainer checkpoint's weight and optimizer bytes against the estimator's for the same
    model (fp32 training: 4 bytes of weights and 8 of AdamW moments per parameter)."""
    from ..configs import param_counts

    mcfg = model_config(cfg, 256 if cfg.tokenizer == "bytes" else cfg.vocab_size)
    est = cost.checkpoint_bytes(mcfg, "fp32", cfg.optimizer)
    weights = sum(t.untyped_storage().nbytes() for t in
                  {t.untyped_storage().data_ptr(): t for t in state["model"].values()}.values())
    moments = sum(t.numel() * t.element_size() for s in state["optimizer"]["state"].values()
                  for k, t in s.items() if k != "step")
    return {"params": param_counts(mcfg)["total"], "weights": weights,
            "weights_est": est["weights"], "moments": moments, "moments_est": est["optimizer"]}
