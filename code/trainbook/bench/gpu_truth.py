"""GPU truth: the parts of `python -m trainbook gpumeasure`, which keeps a device's numbers as data.

The book promises that its GPU numbers are measurements kept in the repository, each saying how,
when, where and with which versions it was taken. This module holds what those measurements need
below the trainer's layer: the record header (versions, git commit, device), the shared time
budget, the MAMF shape grids, one training step of the reference model (the trainer's: forward
with the logits kept, backward, clipping, AdamW), a `torch.profiler` run of a few such steps
summed by operator class, and a GPU step's peak memory next to the estimator's. The trainer run
itself lives in the command (trainbook.train is a layer above this one).

Chapter: book/compute/throughput.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import statistics
import time
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .. import hardware
from ..compute import memory as M
from ..compute.flops import training_flops_per_token
from ..configs import ModelConfig
from ..model import Transformer
from .matmul import device_name
from .provenance import provenance, versions

if TYPE_CHECKING:
    from torch.autograd.profiler_util import FunctionEvent

SIZES = ("small", "large")
CLASSES = ("matmul", "attention", "norm/elementwise", "optimizer", "communication", "other")
AMP = {"bf16": torch.bfloat16, "fp16": torch.float16}


# ---- the record header ---------------------------------------------------------------------------

def device_info(device: torch.device) -> dict:
    """Which device measured: name, how many of its kind are visible, memory, compute capability."""
    info = {"type": device.type, "index": device.index, "name": device_name(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        spec = hardware.match_device_name(props.name)
        info.update(count=torch.cuda.device_count(), memory_gib=props.total_memory / 2**30,
                    capability=".".join(map(str, torch.cuda.get_device_capability(device))),
                    multiprocessors=props.multi_processor_count,
                    spec=spec.name if spec else None)
    else:
        info.update(count=1, memory_gib=None, capability=None, threads=torch.get_num_threads(),
                    cpu_cores=os.cpu_count(), spec=None)
    return info


def device_slug(device: torch.device) -> str:
    """A folder name for the device: 'nvidia-h100-80gb-hbm3', 'cpu-intel-r-xeon-r-...'."""
    name = (torch.cuda.get_device_name(device) if device.type == "cuda"
            else "cpu-" + device_name(device).split(",")[0])
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return slug[:60].rstrip("-") or device.type


def header(measurement: str, command: str, device: torch.device, size: str) -> dict:
    """The fields every record starts with: what was run, when, with what, on what."""
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return {"measurement": measurement, "command": command, "date_utc": now,
            "versions": versions(), "device": device_info(device), "size": size,
            "provenance": provenance(command, device)}


def write_record(out_dir: str | os.PathLike, name: str, record: dict) -> Path:
    """One JSON file per measurement, written whole or not at all (a rename)."""
    path = Path(out_dir) / f"{name}.json"
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=1, default=str) + "\n")
    os.replace(tmp, path)
    return path


def read_record(path: str | os.PathLike, measurement: str, writer: str) -> dict:
    """A stored record of `measurement`, or a ValueError naming the function (`writer`) that
    writes one."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read a stored {measurement} record from {path}: {e}; write "
                         f"one with {writer}") from None
    if record.get("measurement") != measurement:
        raise ValueError(f"{path} is not a {measurement} record (write one with {writer})")
    return record


# ---- the time budget -----------------------------------------------------------------------------

class Budget:
    """Seconds shared by the measurements. Each gets a slice of what is left, its weight over the
    weights of those not yet run, so time one measurement leaves unused goes to the later ones."""

    def __init__(self, total_s: float, weights: dict[str, float],
                 clock: Callable[[], float] = time.perf_counter):
        if not total_s > 0:
            raise ValueError(f"--budget-s must be > 0 seconds, got {total_s:g}")
        self.total_s, self.clock, self.start = total_s, clock, clock()
        self.pending = dict(weights)

    def left(self) -> float:
        return max(0.0, self.total_s - (self.clock() - self.start))

    def take(self, name: str) -> float:
        """The slice of the measurement `name` (it leaves the pending ones)."""
        w = self.pending.pop(name)
        total = w + sum(self.pending.values())
        return self.left() * (w / total if total else 1.0)


def mamf_shapes(size: str, device_type: str) -> list[tuple[int, int, int]]:
    """The (m, n, k) grid the MAMF sweep tries; the budget skips those that do not fit."""
    if device_type == "cuda" and size == "large":
        ms, nks = range(2048, 16384 + 1, 2048), [(n, k) for n in (4096, 8192, 16384)
                                                 for k in (4096, 8192)]
        return [(m, n, k) for m in ms for n, k in nks]
    dims = {("cpu", "small"): (256, 512), ("cpu", "large"): (512, 1024, 2048),
            ("cuda", "small"): (1024, 2048, 4096)}[(device_type, size)]
    return [(m, n, k) for m in dims for n in dims for k in dims]


# ---- one training step of the reference model ----------------------------------------------------

def build(cfg: ModelConfig, device: torch.device,
          recompute: str = "none") -> tuple[Transformer, torch.optim.AdamW]:
    """The reference model and the trainer's optimizer (AdamW, torch's default kernels)."""
    if recompute not in ("none", "full"):
        raise ValueError(f"recompute {recompute!r}: the measurements use 'none' or 'full'")
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: seconds saved on a 1B model
        model = Transformer(cfg)
    if recompute == "full":
        from torch.distributed._composable import checkpoint
        for block in model.blocks:
            checkpoint(block)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95),
                                    weight_decay=0.1)


def random_batch(cfg: ModelConfig, micro_batch: int, seq_len: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids: speed and memory do not depend on the text, and no data is loaded."""
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, cfg.vocab_size, (micro_batch, seq_len), generator=g) for _ in "xy")
    return x.to(device), y.to(device)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
               y: torch.Tensor, dtype: str = "fp32") -> None:
    """As train.train does it: autocast forward (logits kept to the end), backward, clip, AdamW."""
    amp = AMP.get(dtype)
    with torch.autocast(x.device.type, dtype=amp) if amp else nullcontext():
        logits, loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    del logits


def step_flops(cfg: ModelConfig, micro_batch: int, seq_len: int) -> float:
    """Model FLOPs of one step (forward and backward), as the trainer counts them for MFU."""
    return training_flops_per_token(cfg, seq_len) * micro_batch * seq_len


def estimate(cfg: ModelConfig, micro_batch: int, seq_len: int, dtype: str,
             recompute: str = "none", microbatches: int = 1) -> M.MemoryBreakdown:
    """The estimator's breakdown for one single-device training setup."""
    return M.estimate(M.MemoryInputs(model=cfg, dtype=dtype, micro_batch=micro_batch,
                                     seq_len=seq_len, recompute=recompute,
                                     microbatches=microbatches, activations="reference"))


def fit_micro_batch(cfg: ModelConfig, seq_len: int, dtype: str, capacity: float,
                    candidates: Iterable[int] = (8, 4, 2, 1),
                    recompute: str = "none") -> int | None:
    """The largest candidate micro-batch whose estimated peak stays under `capacity` bytes."""
    for mb in sorted(candidates, reverse=True):
        if estimate(cfg, mb, seq_len, dtype, recompute).peak <= capacity:
            return mb
    return None


def cuda_step_peak(cfg: ModelConfig, micro_batch: int, seq_len: int, recompute: str,
                   dtype: str, device: torch.device) -> dict:
    """torch.cuda.max_memory_allocated over one steady-state step (a step first makes the
    optimizer state), less what was allocated before the model existed."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device)
    model, opt = build(cfg, device, recompute)
    x, y = random_batch(cfg, micro_batch, seq_len, device)
    train_step(model, opt, x, y, dtype)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    train_step(model, opt, x, y, dtype)
    torch.cuda.synchronize(device)
    step_s = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) - base
    del model, opt, x, y
    torch.cuda.empty_cache()
    return {"peak": int(peak), "baseline_bytes": int(base), "step_s": step_s}


# ---- the step profile ----------------------------------------------------------------------------

_COMM = re.compile(r"nccl|rccl|gloo|c10d::|record_param_comms|all_?reduce|all_?gather|"
                   r"reduce_?scatter|all_?to_?all|^(send|recv)")
_ATTN = re.compile(r"attention|flash|sdpa|scaled_dot_product")
_MATMUL = {"mm", "addmm", "bmm", "matmul", "linear", "_scaled_mm", "baddbmm", "addmv", "mv",
           "dot", "_addmm_activation", "einsum"}
_ELEMENTWISE = re.compile(
    r"norm|softmax|cross_entropy|nll_loss|^_?(mul|add|sub|div|pow|sqrt|rsqrt|exp|log|silu|gelu|"
    r"relu|tanh|sigmoid|neg|mean|sum|copy|to_copy|to|fill|zero|zeros_like|ones_like|cat|stack|"
    r"clone|where|clamp|dropout|sin|cos|abs|max|min|maximum|minimum|lerp|addcmul|addcdiv|"
    r"reciprocal|square|threshold|masked_fill|rotary|rope|accumulategrad|unsafe_view_copy)_?$")


def _base(name: str) -> str:
    """'autograd::engine::evaluate_function: MmBackward0' -> 'mm'; 'aten::add_' -> 'add_'."""
    name = name.split(": ", 1)[-1]
    name = re.sub(r"^(aten|torch::autograd|autograd|c10d|cuda|prim)::", "", name)
    return re.sub(r"backward\d*$", "", name.lower())


def classify(name: str) -> str:
    """The operator class of one profiler event name (its own; `op_class` adds the parents)."""
    base, low = _base(name), name.lower()
    if low.startswith("optimizer.") or base.startswith("_foreach_") or "fused_adam" in low:
        return "optimizer"
    if _COMM.search(low):
        return "communication"
    if _ATTN.search(base):
        return "attention"
    if base.rstrip("_") in _MATMUL or "gemm" in low or "cublas" in low:
        return "matmul"
    if _ELEMENTWISE.search(base):
        return "norm/elementwise"
    return "other"


def op_class(event: FunctionEvent) -> str:
    """An event's class: communication by its own name; optimizer when it runs inside the
    optimizer step, zero_grad or gradient clipping (foreach ops); else its own class, or failing
    that (views, allocations) the class of the nearest parent that has one."""
    own = classify(event.name)
    if own == "communication":
        return own
    parents, p = [], event.cpu_parent
    while p is not None:
        parents.append(classify(p.name))
        p = p.cpu_parent
    if own == "optimizer" or "optimizer" in parents:
        return "optimizer"
    return next((c for c in [own, *parents] if c != "other"), "other")


def class_fractions(events: list, use_device: bool) -> tuple[dict, float, list[dict]]:
    """Self time by class as fractions summing to 1, the total seconds, and the top operators.

    use_device: kernel time attributed to the host operator that launched it (a GPU), else
    host self time (a CPU). Device-side events are skipped: their time is in their launcher's."""
    from torch.autograd import DeviceType

    by_class, by_op = dict.fromkeys(CLASSES, 0.0), {}
    for e in events:
        if e.device_type != DeviceType.CPU or e.is_async:
            continue
        us = e.self_device_time_total if use_device else e.self_cpu_time_total
        if us <= 0:
            continue
        cls = op_class(e)
        by_class[cls] += us
        key = (e.name, cls)
        by_op[key] = by_op.get(key, 0.0) + us
    total = sum(by_class.values())
    if total <= 0:
        raise ValueError("the profiler recorded no operator time; nothing to classify")
    fractions = {c: v / total for c, v in by_class.items()}
    top = sorted(by_op.items(), key=lambda kv: -kv[1])[:12]
    top_ops = [{"name": n, "class": c, "seconds": us / 1e6, "fraction": us / total}
               for (n, c), us in top]
    return fractions, total / 1e6, top_ops


def profile_steps(cfg: ModelConfig, micro_batch: int, seq_len: int, dtype: str,
                  device: torch.device, trace_path: str | os.PathLike, steps: int = 3,
                  warmup: int = 2) -> dict:
    """Time `warmup` steps unprofiled (the step time the budget sizes the trainer by), then
    profile `steps` steps; export the chrome trace (Perfetto opens it, gzipped or not)."""
    from torch.profiler import ProfilerActivity, profile

    if steps < 1 or warmup < 1:
        raise ValueError(f"need steps >= 1 and warmup >= 1, got {steps} and {warmup}")
    gpu = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if gpu else (lambda: None)
    model, opt = build(cfg, device)
    x, y = random_batch(cfg, micro_batch, seq_len, device)
    times = []
    for _ in range(warmup):
        t0 = time.perf_counter()
        train_step(model, opt, x, y, dtype)
        sync()
        times.append(time.perf_counter() - t0)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            train_step(model, opt, x, y, dtype)
        sync()
        wall = time.perf_counter() - t0
    prof.export_chrome_trace(str(trace_path))
    fractions, busy, top = class_fractions(prof.events(), use_device=gpu)
    del model, opt
    if gpu:
        torch.cuda.empty_cache()
    return {"fractions": fractions, "basis": "kernel time by launching operator" if gpu
            else "operator self time on the host (CPU)", "busy_s": busy, "profiled_wall_s": wall,
            "busy_over_wall": busy / wall, "steps": steps, "warmup": warmup,
            "step_s_unprofiled": statistics.median(times[1:] or times),
            "step_s_profiled": wall / steps, "top_ops": top}
