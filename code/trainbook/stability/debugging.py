"""Numerical debugging: how close every tensor comes to the edges of fp16 and bf16, what anomaly
mode reports, and what each tool costs.

The first inf or NaN is found by the trainer's detector, `train.monitor.find_nonfinite` (hooks
on every module; `--monitor nan` runs it on a bad step). Here: `module_stats` runs one
micro-batch with hooks on every module and records, per module and tensor (weights, inputs,
outputs, then in backward the gradients arriving at each output and each weight's gradient), the
absolute min and max as Hugging Face's `DebugUnderflowOverflow` prints them (`hf_frames` prints
our rows in its format), the smallest non-zero magnitude, and how many elements would overflow,
flush to zero or become subnormal if cast to fp16 or bf16 (torch's round-to-nearest-even casts,
which `formats.quantize` matches bit for bit); `risky`
picks the rows near a format's limits. `anomaly` runs a micro-batch under
`torch.autograd.detect_anomaly` and returns the backward function that first returned NaN and
the line of the forward call that created it. `step_cost` times a forward and backward plain
and under each tool (best of several runs).

Chapter: book/stability/debugging.
"""

from __future__ import annotations

import math
import re
import time
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import pandas as pd
import torch
from torch import nn

from .. import formats
from ..train.monitor import find_nonfinite

LIMIT_FORMATS = ("fp16", "bf16")
_PREFIX = " " * 17  # DebugUnderflowOverflow's indent before a module's name


def tensor_stats(t: torch.Tensor) -> dict:
    """|t|'s min and max over all elements (NaN propagates, as DebugUnderflowOverflow prints
    them), the largest finite and smallest non-zero finite magnitudes, the count of non-finite
    elements, and per format in LIMIT_FORMATS how many finite elements would overflow to inf,
    flush to zero or land among the subnormals when rounded to it (limits from `formats`)."""
    a = t.detach().float().abs()
    ok = torch.isfinite(a)
    finite = torch.where(ok, a, 0.0)  # masked, not indexed: no copy of the selection
    n = t.numel()
    positive = torch.where(finite > 0, finite, math.inf)
    row = {"shape": tuple(t.shape), "numel": n, "dtype": str(t.dtype).removeprefix("torch."),
           "abs_min": a.min().item() if n else math.nan,
           "abs_max": a.max().item() if n else math.nan,
           "max_finite": finite.max().item() if n else math.nan,
           "min_nonzero": positive.min().item() if n and (finite > 0).any() else math.nan,
           "nonfinite": n - int(ok.sum())}
    for name in LIMIT_FORMATS:
        fmt = formats.get(name)
        q = finite.to(getattr(torch, fmt.torch_dtype)).float()  # = formats.quantize, exactly
        row[f"{name}_over"] = int(torch.isinf(q).sum())
        row[f"{name}_flush"] = int(((q == 0) & (finite > 0)).sum())
        row[f"{name}_subnormal"] = int(((q > 0) & (q < fmt.min_normal)).sum())
    return row


def _entries(value: object, label: str, nested: bool = False) -> list[tuple[str, object]]:
    """(label, item) for what DebugUnderflowOverflow analyses: a tuple's items as label[i]
    (an output tuple one level deeper as label[i][j]), anything else as itself."""
    if not isinstance(value, tuple):
        return [(label, value)]
    out = []
    for i, item in enumerate(value):
        if nested and isinstance(item, tuple):
            out += [(f"{label}[{i}][{j}]", y) for j, y in enumerate(item)]
        else:
            out.append((f"{label}[{i}]", item))
    return out


def _row(frame: int, phase: str, module: str, cls: str, label: str, value: object) -> dict:
    base = {"frame": frame, "phase": phase, "module": module, "cls": cls, "tensor": label}
    if isinstance(value, torch.Tensor):
        return base | tensor_stats(value)
    return base | {"kind": "None" if value is None else "not a tensor"}


def module_stats(model: nn.Module, x: torch.Tensor, y: torch.Tensor | None = None,
                 backward: bool = True,
                 autocast: Callable[[], AbstractContextManager] | None = None) -> pd.DataFrame:
    """One forward (and backward, when the model returns a loss) of `model(x, y)` with a hook
    on every module: one row per module and tensor in the order they were computed. Forward:
    the module's own parameters, input[i], output (as DebugUnderflowOverflow); backward:
    grad_output[i] (the gradient arriving at each output), then each parameter's gradient.
    Gradients already held by the parameters are left as they were."""
    rows: list[dict] = []
    frames = [0]  # one frame per hook call: a module's rows, as DebugUnderflowOverflow groups
    names = {m: n for n, m in model.named_modules()}

    def forward_hook(mod, inp, out):
        name, cls, frames[0] = names[mod], type(mod).__name__, frames[0] + 1
        for pname, p in mod.named_parameters(recurse=False):
            rows.append(_row(frames[0], "forward", name, cls, pname, p))
        for label, v in _entries(inp, "input") + _entries(out, "output", nested=True):
            rows.append(_row(frames[0], "forward", name, cls, label, v))

    def backward_hook(mod, _grad_in, grad_out):
        frames[0] += 1
        for label, v in _entries(grad_out, "grad_output"):
            rows.append(_row(frames[0], "backward", names[mod], type(mod).__name__, label, v))

    handles = [m.register_forward_hook(forward_hook) for m in model.modules()]
    if backward:
        handles += [m.register_full_backward_hook(backward_hook) for m in model.modules()]
    saved = [p.grad for p in model.parameters()]
    try:
        for p in model.parameters():
            p.grad = None
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            with autocast() if autocast else nullcontext():
                out = model(x, y) if y is not None else model(x)
            loss = out[1] if isinstance(out, tuple) else None
            if backward and loss is not None and loss.requires_grad:
                loss.backward()
                for mod, name in names.items():
                    frames[0] += 1
                    for pname, p in mod.named_parameters(recurse=False):
                        if p.grad is not None:
                            rows.append(_row(frames[0], "backward", name, type(mod).__name__,
                                             f"grad of {pname}", p.grad))
    finally:
        for h in handles:
            h.remove()
        for p, g in zip(model.parameters(), saved):
            p.grad = g
    return pd.DataFrame(rows)


def risky(stats: pd.DataFrame, fmt: str = "fp16", headroom: float = 2.0,
          underflow: float = 0.01) -> pd.DataFrame:
    """The floating-point rows of `module_stats` near the limits of `fmt`, in execution order:
    "inf/nan" when the tensor holds one, "overflow" when its largest finite magnitude is within
    `headroom` binades of the format's largest value (or would round to inf); "underflow" when
    more than `underflow` of its elements flush to zero or become subnormal when cast. Adds
    `headroom` (binades) and `reason`."""
    f = formats.get(fmt)
    if f.name not in LIMIT_FORMATS:
        raise ValueError(f"module_stats counts {', '.join(LIMIT_FORMATS)}; got {fmt!r}")
    if headroom < 0 or not 0 <= underflow <= 1:
        raise ValueError(f"need headroom >= 0 binades and underflow in [0, 1], got {headroom}, "
                         f"{underflow}")
    s = stats[stats["numel"].fillna(0) > 0]
    s = s[s["dtype"].str.contains("float")].copy()  # not token ids
    s["headroom"] = [math.log2(f.max / m) if m > 0 else math.inf
                     for m in s["max_finite"].fillna(0)]
    low = (s[f"{f.name}_flush"] + s[f"{f.name}_subnormal"]) / s["numel"].clip(lower=1)
    over = (s["headroom"] < headroom) | (s[f"{f.name}_over"] > 0)
    s["reason"] = ["inf/nan" if n else "overflow" if o else "underflow" if u > underflow
                   else "" for n, o, u in zip(s["nonfinite"] > 0, over, low)]
    return s[s["reason"] != ""]


def hf_frames(stats: pd.DataFrame) -> str:
    """The forward rows of `module_stats` printed as DebugUnderflowOverflow traces a batch: per
    module call, its name and class, then `abs min  abs max  metadata` lines."""
    lines = []
    for _, frame in stats[stats["phase"] == "forward"].groupby("frame", sort=True):
        lines.append(f"{_PREFIX} {frame['module'].iloc[0]} {frame['cls'].iloc[0]}")
        for r in frame.itertuples():
            kind = getattr(r, "kind", None)
            if isinstance(kind, str):
                lines.append(f"{kind:>17} {r.tensor}")
            else:
                lines.append(f"{r.abs_min:8.2e} {r.abs_max:8.2e} {r.tensor}")
    return "\n".join(lines)


@dataclass
class Anomaly:
    """What `torch.autograd.detect_anomaly` reported: the backward function that returned NaN
    (`op`, e.g. LogBackward0) and which of its outputs, the forward line that created that
    function (`frame`: file, line, code), and the full error message."""

    op: str | None
    output: int | None
    frame: str
    message: str

    def __str__(self) -> str:
        what = f"{self.op} returned NaN in its output {self.output}" if self.op else self.message
        return f"{what}; created by the forward call at {self.frame}" if self.frame else what


_FUNCTION = re.compile(r"Function '(\w+)' returned nan values in its (\d+)th output")
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n\s+(.+)')


def anomaly(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
            autocast: Callable[[], AbstractContextManager] | None = None) -> Anomaly | None:
    """One forward and backward under detect_anomaly(check_nan=True): None when backward ran
    clean. Anomaly mode checks the outputs of every backward function, so a NaN made in the
    forward pass is reported at the first backward function it reaches, near the loss."""
    saved = [p.grad for p in model.parameters()]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.autograd.detect_anomaly(check_nan=True):
                with autocast() if autocast else nullcontext():
                    _, loss = model(x, y)
                if not loss.requires_grad:  # nothing to run backward through
                    return None
                try:
                    loss.backward()
                except RuntimeError as e:
                    message = str(e)
                else:
                    return None
    finally:
        for p, g in zip(model.parameters(), saved):
            p.grad = g
    m = _FUNCTION.search(message)
    traces = [str(w.message) for w in caught if "Traceback of forward call" in str(w.message)]
    frames = _FRAME.findall(traces[-1]) if traces else []
    ours = [f for f in frames if "/site-packages/torch/" not in f[0]] or frames  # not torch's
    frame = ""
    if ours:
        path, line, fn, code = ours[-1]
        short = "trainbook/" + path.split("/trainbook/")[-1] if "/trainbook/" in path else path
        frame = f"{short}:{line} in {fn}: {code.strip()}"
    return Anomaly(m[1] if m else None, int(m[2]) if m else None, frame, message)


def _time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)  # the least disturbed run: on a shared machine the rest is noise


def step_cost(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
              repeats: int = 5) -> pd.DataFrame:
    """Best-of-`repeats` seconds of one forward and backward of model(x, y): plain, with the NaN
    detector's hooks (find_nonfinite), with the statistics hooks (module_stats) and under
    anomaly mode. Speeds are this machine's: show them, do not assert them."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")

    def plain():
        model(x, y)[1].backward()

    def anomalous():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.autograd.detect_anomaly(check_nan=True):
                model(x, y)[1].backward()

    saved = [p.grad for p in model.parameters()]
    tools = {"plain": plain, "NaN detector hooks": lambda: find_nonfinite(model, x, y),
             "statistics hooks": lambda: module_stats(model, x, y),
             "detect_anomaly": anomalous}
    try:
        rows = [{"tool": k, "seconds": _time(f, repeats)} for k, f in tools.items()]
    finally:
        for p, g in zip(model.parameters(), saved):
            p.grad = g
    out = pd.DataFrame(rows).set_index("tool")
    out["x plain"] = out["seconds"] / out.loc["plain", "seconds"]
    return out
