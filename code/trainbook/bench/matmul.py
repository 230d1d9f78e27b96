"""Maximum achievable matmul FLOPS (MAMF): sweep matmul shapes, time each, keep the best.

A datasheet peak is a ceiling no kernel reaches; the best matmul you can actually run on a device
is the honest denominator for "how good is my training run". This finder times `a @ b` for every
(m, n, k) in a sweep, in one dtype, on CPU, CUDA or ROCm (ROCm builds of PyTorch expose the GPU
as `cuda`), and reports mean, median and max TFLOPS per shape and the best shape overall.

Method, per shape: allocate a (m, k), b (k, n) and the output once; run `warmup` untimed
matmuls; then `repeats` timed ones, each preceded by a cache flush (a write of a buffer larger
than the last-level cache, so every timed matmul reads its operands from memory, as a matmul in a
training step does). A GPU is timed with CUDA events around the matmul alone; a CPU with
`time.perf_counter`. Results are appended to a JSON-lines file as they come, so an interrupted
sweep keeps what it measured, and Ctrl-C ends the sweep with a summary instead of a traceback.

Chapter: book/compute/throughput.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import hardware
from ..launch import resolve_device
from .provenance import cpu_model
from .timing import CacheFlusher, Timer, default_flush_bytes

TORCH_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16,
                "fp16": torch.float16, "fp8": getattr(torch, "float8_e4m3fn", None)}


# ---- inputs ------------------------------------------------------------------------------------

def parse_range(start: int, stop: int, step: int, name: str = "range") -> list[int]:
    """START, START+STEP, ... up to and including STOP (when it lands on the grid)."""
    if step <= 0:
        raise ValueError(f"--{name}-range STEP must be > 0, got {step}")
    if start < 1:
        raise ValueError(f"--{name}-range START must be >= 1 (a matmul dimension), got {start}")
    if stop < start:
        raise ValueError(f"--{name}-range is empty: STOP {stop} < START {start}; "
                         "give START <= STOP")
    return list(range(start, stop + 1, step))


def make_shapes(ms: Sequence[int], ns: Sequence[int],
                ks: Sequence[int]) -> list[tuple[int, int, int]]:
    """Every (m, n, k) of the cartesian product, in sweep order (k fastest)."""
    for name, values in (("m", ms), ("n", ns), ("k", ks)):
        if not values:
            raise ValueError(f"no values for {name}: give --{name} or --{name}-range")
        bad = [v for v in values if int(v) != v or v < 1]
        if bad:
            raise ValueError(f"{name} must be positive integers, got {bad[0]}")
    return [(int(m), int(n), int(k)) for m in ms for n in ns for k in ks]


def check_dtype(dtype: str, device: torch.device) -> str:
    """Normalise the dtype name and refuse the ones this device cannot multiply in."""
    key = hardware.normalize_dtype(dtype)
    if device.type == "cpu" and key in ("tf32", "fp8"):
        raise ValueError(f"{key} matmuls need a GPU with {key} tensor cores; on cpu use "
                         "fp32, bf16 or fp16")
    if key == "fp8":
        if TORCH_DTYPES["fp8"] is None or not hasattr(torch, "_scaled_mm"):
            raise ValueError(f"this PyTorch {torch.__version__} has no fp8 matmul")
        if torch.version.hip is None and torch.cuda.get_device_capability(device) < (8, 9):
            raise ValueError(f"fp8 needs compute capability >= 8.9 (L4, H100, ...); "
                             f"{torch.cuda.get_device_name(device)} has "
                             f"{torch.cuda.get_device_capability(device)}")
    if key == "tf32" and torch.version.hip is None and \
            torch.cuda.get_device_capability(device) < (8, 0):
        raise ValueError("tf32 needs an Ampere or newer GPU (compute capability >= 8.0)")
    return key


# ---- one shape ---------------------------------------------------------------------------------

@dataclass
class ShapeResult:
    """Timings of one (m, n, k) matmul and the TFLOPS they imply."""

    m: int
    n: int
    k: int
    dtype: str
    times_s: list[float] = field(repr=False)

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k

    @property
    def mean_tflops(self) -> float:  # total work over total time: what a long run sustains
        return self.flops / statistics.fmean(self.times_s) / 1e12

    @property
    def median_tflops(self) -> float:  # robust to the odd slow repeat on a busy machine
        return self.flops / statistics.median(self.times_s) / 1e12

    @property
    def max_tflops(self) -> float:  # the fastest repeat: the most this shape has shown it can do
        return self.flops / min(self.times_s) / 1e12

    @property
    def min_tflops(self) -> float:
        return self.flops / max(self.times_s) / 1e12

    @property
    def shape(self) -> str:
        return f"{self.m}x{self.n}x{self.k}"

    def to_dict(self) -> dict:
        return {"m": self.m, "n": self.n, "k": self.k, "dtype": self.dtype,
                "mean_tflops": self.mean_tflops, "median_tflops": self.median_tflops,
                "max_tflops": self.max_tflops, "min_tflops": self.min_tflops,
                "median_ms": 1e3 * statistics.median(self.times_s), "repeats": len(self.times_s)}


def _operands(m, n, k, dtype: str, device):
    """a, b, out and the matmul to time; fp8 goes through torch._scaled_mm (b column-major)."""
    if dtype == "fp8":  # MI300 (ROCm) uses the "fnuz" variant of e4m3
        f8 = torch.float8_e4m3fnuz if torch.version.hip else TORCH_DTYPES["fp8"]
        a = torch.randn(m, k, device=device).to(f8)
        b = torch.randn(n, k, device=device).to(f8).t()  # column-major, as _scaled_mm wants
        one = torch.ones((), device=device)
        return lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)
    a = torch.randn(m, k, device=device, dtype=TORCH_DTYPES[dtype])
    b = torch.randn(k, n, device=device, dtype=TORCH_DTYPES[dtype])
    out = torch.empty(m, n, device=device, dtype=TORCH_DTYPES[dtype])
    return lambda: torch.matmul(a, b, out=out)


def time_matmul(m: int, n: int, k: int, dtype: str = "fp32", device: str | torch.device = "cpu",
                repeats: int = 10, warmup: int = 2, flush: Callable[[], None] | None = None,
                timer: Timer | None = None, budget_s: float | None = None) -> ShapeResult:
    """Time `repeats` matmuls of (m, k) @ (k, n), flushing the cache before each.

    With `budget_s`, timed repeats stop once that many seconds are spent (at least one runs):
    the same call then costs about the same time on a CPU that emulates bf16 as on one that
    has it natively, with fewer repeats on the slow one.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats} and {warmup}")
    if budget_s is not None and budget_s <= 0:
        raise ValueError(f"budget_s must be > 0 seconds, got {budget_s}")
    device = torch.device(device)
    timer = timer or Timer(device)
    flush = flush or (lambda: None)
    matmul = _operands(m, n, k, dtype, device)
    tf32_before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
    try:
        for _ in range(warmup):
            matmul()
        timer.sync()
        times = []
        deadline = None if budget_s is None else time.perf_counter() + budget_s
        while len(times) < repeats and (deadline is None or not times
                                         or time.perf_counter() < deadline):
            flush()
            timer.sync()
            times.append(timer(matmul))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32_before
    return ShapeResult(m, n, k, dtype, times)


def probe_tflops(dtype: str = "fp32", device: str | torch.device = "cpu", seconds: float = 0.05,
                 size: int = 256) -> float:
    """The best rate of `size`-cube matmuls over `seconds`: a yardstick to size work by.

    A 256-cube matmul takes about 15 ms where bf16 is emulated (about 2 GFLOPS) and well under
    a millisecond where it is native, so the probe is cheap on both kinds of CPU.
    """
    dev = resolve_device(str(device))
    dtype = check_dtype(dtype, dev)
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    r = time_matmul(size, size, size, dtype, dev, repeats=10**6, warmup=1, budget_s=seconds)
    return r.max_tflops


# ---- the sweep ---------------------------------------------------------------------------------

@dataclass
class Sweep:
    """What a sweep measured (all of it, or what it had when interrupted)."""

    results: list[ShapeResult]
    planned: int
    dtype: str
    device: str
    device_name: str
    interrupted: bool = False
    output: str | None = None
    budget_s: float | None = None
    skipped: list[tuple[int, int, int]] = field(default_factory=list)

    def best(self, stat: str = "max") -> ShapeResult:
        """The shape with the highest `stat` TFLOPS (stat: mean, median or max)."""
        if stat not in ("mean", "median", "max"):
            raise ValueError(f"stat must be mean, median or max, got {stat!r}")
        if not self.results:
            raise ValueError("nothing was measured (the sweep stopped before the first shape)")
        return max(self.results, key=lambda r: getattr(r, f"{stat}_tflops"))

    def summary(self) -> dict:
        """Best shape per statistic, and how much of the sweep ran."""
        out = {"dtype": self.dtype, "device": self.device, "device_name": self.device_name,
               "measured": len(self.results), "planned": self.planned,
               "interrupted": self.interrupted, "output": self.output,
               "budget_s": self.budget_s, "skipped": len(self.skipped)}
        if self.results:
            for stat in ("mean", "median", "max"):
                r = self.best(stat)
                out[f"best_{stat}"] = {"tflops": getattr(r, f"{stat}_tflops"), "shape": r.shape,
                                       "m": r.m, "n": r.n, "k": r.k}
        return out

    def rows(self) -> list[dict]:
        return [r.to_dict() for r in self.results]


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model name (from /proc/cpuinfo where there is one)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_model()}, {torch.get_num_threads()} threads"


def metadata(device: torch.device, dtype: str, command: str | None = None) -> dict:
    """What a results file must say so that its numbers can be trusted later (and stored)."""
    meta = {"kind": "meta", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"), "device": str(device), "device_name": device_name(device),
            "dtype": dtype, "torch": torch.__version__, "cuda": torch.version.cuda,
            "hip": torch.version.hip, "host": platform.node(), "threads": torch.get_num_threads()}
    if command:
        meta["command"] = command
    return meta


def sweep(shapes: Sequence[tuple[int, int, int]], dtype: str = "bf16", device: str = "auto",
          repeats: int = 10, warmup: int = 2, flush_bytes: int | None = None,
          output: str | os.PathLike | None = None, progress: bool = True,
          command: str | None = None, timer: Timer | None = None,
          budget_s: float | None = None) -> Sweep:
    """Time every shape; append each result to `output` (JSON lines) as it is measured.

    With `budget_s`, the sweep first probes this dtype's rate (`probe_tflops`), skips every shape
    whose warmup and one repeat would not fit in what is left of the budget, and gives each shape
    an equal share of the rest for its repeats: a sweep sized for a CPU with native bf16 then
    ends in time on one that emulates it, and says how many shapes it measured.
    Ctrl-C (KeyboardInterrupt) stops the sweep and returns what was measured, marked interrupted.
    """
    shapes = list(shapes)
    if not shapes:
        raise ValueError("no shapes to measure")
    dev = resolve_device(device)
    dtype = check_dtype(dtype, dev)
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need --repeats >= 1 and --warmup >= 0, got {repeats} and {warmup}")
    if budget_s is not None and budget_s <= 0:
        raise ValueError(f"the time budget must be > 0 seconds, got {budget_s}")
    if dtype == "fp8" and any(d % 16 for shape in shapes for d in shape):
        raise ValueError("fp8 matmuls (torch._scaled_mm) need m, n and k divisible by 16")
    flush = CacheFlusher(dev, default_flush_bytes(dev) if flush_bytes is None else flush_bytes)
    timer = timer or Timer(dev)
    result = Sweep([], len(shapes), dtype, str(dev), device_name(dev),
                   output=str(output) if output else None, budget_s=budget_s)
    sink = None
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        sink = open(output, "a")
        meta = metadata(dev, dtype, command)
        meta.update(repeats=repeats, warmup=warmup, flush_bytes=flush.nbytes, planned=len(shapes),
                    budget_s=budget_s)
        sink.write(json.dumps(meta) + "\n")
    deadline = None
    if budget_s is not None:
        rate = probe_tflops(dtype, dev) * 1e12  # FLOP/s, updated from each measured shape
        deadline = time.perf_counter() + budget_s
    from tqdm.auto import tqdm
    bar = tqdm(shapes, desc=f"mamf {dtype}", disable=not progress, unit="shape")
    try:
        for i, (m, n, k) in enumerate(bar):
            shape_budget = None
            if deadline is not None:
                left, one = deadline - time.perf_counter(), 2 * m * n * k / rate
                if (warmup + 1) * one > left:
                    result.skipped.append((m, n, k))
                    continue
                shape_budget = max(left / (len(shapes) - i) - warmup * one, one)
            r = time_matmul(m, n, k, dtype, dev, repeats, warmup, flush, timer, shape_budget)
            result.results.append(r)
            if deadline is not None:
                rate = r.flops / statistics.median(r.times_s)
            if sink:
                sink.write(json.dumps({"kind": "shape", **r.to_dict()}) + "\n")
                sink.flush()
            best = result.best("max")
            bar.set_postfix_str(f"best {best.max_tflops:.3g} TFLOPS @ {best.shape}")
    except KeyboardInterrupt:
        result.interrupted = True
    finally:
        bar.close()
        if sink:
            sink.close()
    return result


def read_results(path: str | os.PathLike) -> tuple[dict, list[dict]]:
    """A results file back: (metadata of its first run, shape records of all runs in it)."""
    meta, rows = None, []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        if rec.get("kind") == "meta":
            meta = meta or rec
        else:
            rows.append(rec)
    if meta is None:
        raise ValueError(f"{path} has no metadata line; was it written by trainbook mamf?")
    return meta, rows


def peak_tflops(dtype: str = "bf16", device: str = "auto", sizes: Sequence[int] | None = None,
                repeats: int = 5, progress: bool = False, small: bool = True,
                budget_s: float | None = None) -> Sweep:
    """A quick MAMF: square shapes around the sizes this device likes (a few seconds on a CPU,
    within `budget_s`, 2 s by default there, whether or not the CPU has native bf16)."""
    dev = resolve_device(device)
    if sizes is None:
        sizes = [1024, 2048] if dev.type == "cpu" else [4096, 8192, 12288, 16384]
    if budget_s is None and dev.type == "cpu":
        budget_s = 2.0
    shapes = [(s, s, s) for s in sizes]
    flush = default_flush_bytes(dev, small=small)
    return sweep(shapes, dtype, str(dev), repeats, warmup=1, flush_bytes=flush, progress=progress,
                 budget_s=budget_s)
