"""Where one training step's time goes: a `torch.profiler` trace of the trainer's step, summed by
operator class, and the Chrome/Perfetto trace file.

`classify(op_name)` puts one profiler event name into a class: matmul (mm, addmm, bmm, linear),
attention (the SDPA kernels), elementwise (norms, activations, adds and multiplies), optimizer
(the optimizer's step and zero_grad, foreach and fused kernels, gradient clipping's foreach
ops), loss (cross-entropy: log-softmax and NLL), communication, and copies/other (casts, copies,
concatenation, embedding lookups, whatever else). It refines `bench.gpu_truth.classify`, which
has no separate loss or copy classes. `event_class` adds the call tree: everything under an
optimizer, communication, loss or attention event belongs to it (the math SDPA backend's
matmuls and softmax are attention); any other event keeps its own class, so a copy a matmul
makes of its input counts as a copy.

`profile_step` runs warm-up steps, profiles a few more (CPU activity, and CUDA kernels on a GPU,
where kernel time is attributed to the host operator that launched it), writes the trace and
returns the time per class. The trace opens in https://ui.perfetto.dev ("Open trace file") or
chrome://tracing.

Chapter: book/compute/throughput.
"""

from __future__ import annotations

import os
import re
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd
import torch

from . import gpu_truth

if TYPE_CHECKING:
    from torch.autograd.profiler_util import FunctionEvent

CLASSES = ("matmul", "attention", "elementwise", "optimizer", "loss", "communication",
           "copies/other")
_LOSS = re.compile(r"cross_?entropy|nll_?loss|log_?softmax")
_COPY = re.compile(r"^_?(copy|to_copy|to|clone|contiguous|cat|stack|fill|zero|zeros_like|"
                   r"ones_like|embedding|embedding_dense|index_select|index|gather|scatter|"
                   r"unsafe_view_copy|item|local_scalar_dense)_?$")
# gpu_truth's class names -> ours
_COARSE = {"matmul": "matmul", "attention": "attention", "norm/elementwise": "elementwise",
           "optimizer": "optimizer", "communication": "communication", "other": "copies/other"}


def classify(op_name: str) -> str:
    """The operator class of one profiler event name, from the name alone."""
    if not isinstance(op_name, str) or not op_name.strip():
        raise ValueError(f"op_name must be a profiler event name such as 'aten::mm', "
                         f"got {op_name!r}")
    coarse = gpu_truth.classify(op_name)
    if coarse in ("optimizer", "communication"):
        return coarse
    base = gpu_truth._base(op_name)  # 'autograd::...: NllLossBackward0' -> 'nllloss'
    if _LOSS.search(base):
        return "loss"
    if _COPY.search(base):
        return "copies/other"
    return _COARSE[coarse]


def event_class(event: FunctionEvent) -> str:
    """An event's class with its call tree: optimizer, communication, loss or attention if it or a
    parent is one (in that order), else its own."""
    chain, p = [classify(event.name)], event.cpu_parent
    while p is not None:
        chain.append(classify(p.name))
        p = p.cpu_parent
    return next((c for c in ("optimizer", "communication", "loss", "attention") if c in chain),
                chain[0])


def class_seconds(events: list, use_device: bool) -> tuple[dict[str, float], list[dict]]:
    """Self time (seconds) by class, and the operators that took the most. use_device: kernel
    time attributed to the launching host operator (a GPU), else host self time (a CPU)."""
    from torch.autograd import DeviceType

    by_class, by_op = dict.fromkeys(CLASSES, 0.0), {}
    for e in events:
        if e.device_type != DeviceType.CPU or e.is_async:
            continue  # device-side events: their time is in their launcher's
        us = e.self_device_time_total if use_device else e.self_cpu_time_total
        if us > 0:
            cls = event_class(e)
            by_class[cls] += us / 1e6
            by_op[(e.name, cls)] = by_op.get((e.name, cls), 0.0) + us / 1e6
    top = sorted(by_op.items(), key=lambda kv: -kv[1])[:12]
    return by_class, [{"op": n, "class": c, "seconds": s} for (n, c), s in top]


@contextmanager
def quiet_profiler_lines() -> Iterator[None]:
    """Kineto writes a line to the process's stderr (fd 2) when tracing starts and stops
    ("USDT: ... profiler_start"); a notebook build treats stderr as an error. Hold fd 2 in a
    file meanwhile and pass on every other line."""
    import sys

    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            rest = [ln for ln in tmp.read().decode(errors="replace").splitlines()
                    if ln.strip() and not ln.startswith("USDT:")]
    if rest:
        print("\n".join(rest), file=sys.stderr)


def default_trace_path() -> Path:
    """A file under the system's temporary folder: never inside the book or the repository."""
    return Path(tempfile.gettempdir()) / "trainbook-profile" / "step-trace.json.gz"


def profile_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
                 y: torch.Tensor, step: Callable[..., object] | None = None, dtype: str = "fp32",
                 steps: int = 3, warmup: int = 2,
                 trace_path: str | os.PathLike | None = None) -> tuple[pd.DataFrame, Path]:
    """Profile `steps` training steps after `warmup` unprofiled ones; the time per class and the
    trace file (gzipped Chrome trace JSON).

    step(model, optimizer, x, y) is one step, by default the trainer's (`gpu_truth.train_step`:
    autocast in `dtype`, forward with the logits kept, backward, clipping, optimizer step,
    zero_grad). The table has one row per class: seconds per step and share of the operator
    time; `table.attrs` holds the step's wall time unprofiled and profiled, the operator time
    per step, the basis of the times and the top operators.
    """
    if not (isinstance(steps, int) and isinstance(warmup, int)) or steps < 1 or warmup < 1:
        raise ValueError(f"steps and warmup must be whole numbers >= 1, got {steps!r}, "
                         f"{warmup!r}")
    if x.shape != y.shape or x.dim() != 2:
        raise ValueError(f"x and y must be (batch, seq) token ids of one shape, got "
                         f"{tuple(x.shape)} and {tuple(y.shape)}")
    from torch.profiler import ProfilerActivity, profile

    step = step or partial(gpu_truth.train_step, dtype=dtype)
    gpu = x.device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(x.device)) if gpu else (lambda: None)
    times = []
    for _ in range(warmup):
        t0 = time.perf_counter()
        step(model, optimizer, x, y)
        sync()
        times.append(time.perf_counter() - t0)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    prof = profile(activities=activities)
    with quiet_profiler_lines():
        prof.start()
    t0 = time.perf_counter()
    for _ in range(steps):
        step(model, optimizer, x, y)
    sync()
    wall = time.perf_counter() - t0
    with quiet_profiler_lines():
        prof.stop()
    path = Path(trace_path) if trace_path is not None else default_trace_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    seconds, top = class_seconds(prof.events(), use_device=gpu)
    busy = sum(seconds.values())
    if busy <= 0:
        raise ValueError("the profiler recorded no operator time; nothing to classify")
    table = pd.DataFrame({"seconds per step": {c: s / steps for c, s in seconds.items()},
                          "share": {c: s / busy for c, s in seconds.items()}})
    table.index.name = "class"
    table.attrs.update(
        steps=steps, warmup=warmup, step_s_unprofiled=statistics.median(times[1:] or times),
        step_s_profiled=wall / steps, busy_s_per_step=busy / steps,
        basis="kernel time by launching operator" if gpu else "operator self time on the host",
        top_ops=top)
    return table, path
