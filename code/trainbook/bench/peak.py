"""The peak of the device at hand: the spec table's row for a known GPU, a measurement otherwise.

A CPU has no spec sheet, and neither has a GPU missing from `trainbook.hardware.SPECS`: their peak
is the best square matmul measured here, within a time budget, sized by a sub-second probe of the
dtype's speed (a CPU that emulates bf16 is about 150 times slower than one with AMX).

Chapter: book/compute/throughput (MFU against a measured peak); book/appendix/hardware.
"""

from __future__ import annotations

import torch

from ..hardware import DTYPES, Accelerator, match_device_name, normalize_dtype
from .matmul import probe_tflops, time_matmul


def measure_matmul_tflops(dtype: str = "fp32", device: str | torch.device = "cpu",
                          budget_s: float = 0.5, sizes: tuple[int, ...] | None = None) -> float:
    """Best TFLOPS of square matmuls within `budget_s` seconds (trainbook.bench.matmul times them).

    The size is chosen by a probe of this dtype's speed: the largest of `sizes` whose single
    matmul takes at most a tenth of the budget. A CPU that emulates bf16 (about 150x slower than
    fp32) gets a small matmul and one with native bf16 a large one, in the same wall time.
    """
    if budget_s <= 0:
        raise ValueError(f"budget_s must be > 0 seconds, got {budget_s}")
    device = torch.device(device)
    if sizes is None:
        sizes = (256, 512, 1024, 2048) if device.type == "cpu" else (1024, 2048, 4096, 8192)
    if min(sizes) < 16:
        raise ValueError(f"matmul size {min(sizes)} is too small to measure anything; use >= 16")
    dtype = normalize_dtype(dtype)
    rate = probe_tflops(dtype, device, seconds=min(0.05, budget_s / 5)) * 1e12
    fits = [s for s in sorted(sizes) if 2 * s**3 / rate <= budget_s / 10]
    size = fits[-1] if fits else min(sizes)
    r = time_matmul(size, size, size, dtype, device, repeats=10**6, warmup=1,
                    budget_s=budget_s * 0.8)
    return max(r.max_tflops, rate / 1e12)


_cpu_cache: dict[str, Accelerator] = {}


def cpu_spec(dtypes: tuple[str, ...] = ("fp32", "bf16"), budget_s: float = 0.5) -> Accelerator:
    """A CPU has no spec sheet: its 'peak' is the best matmul measured here (cached per process),
    `budget_s` seconds per dtype, sized by a probe so an emulated bf16 path costs no more time."""
    key = f"{dtypes}"
    if key not in _cpu_cache:
        tflops = {d: None for d in DTYPES}
        for d in dtypes:
            tflops[normalize_dtype(d)] = measure_matmul_tflops(d, "cpu", budget_s)
        _cpu_cache[key] = Accelerator(
            name="cpu", vendor="measured", tflops=tflops, memory_gib=0.0, hbm_gbps=0.0,
            interconnect="none", interconnect_gbps=0.0, measured=True,
            source=f"measured here: best square matmul in {budget_s:g} s per dtype, "
                   f"{torch.get_num_threads()} threads",
        )
    return _cpu_cache[key]


def detect(device: str | torch.device | None = None, dtype: str = "fp32") -> Accelerator:
    """The spec of the device at hand: a table row for a known GPU; for a CPU, a measurement
    of `dtype` (the dtype you will compute MFU against)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        spec = match_device_name(name)
        if spec is None:  # not in the table: measure it, and say so
            dtype = normalize_dtype(dtype)
            tflops = {d: None for d in DTYPES}
            tflops[dtype] = measure_matmul_tflops(dtype, device, budget_s=2.0)
            props = torch.cuda.get_device_properties(device)
            return Accelerator(name, "measured", tflops, props.total_memory / 2**30, 0.0,
                               "unknown", 0.0,
                               source=f"measured here: best square {dtype} matmul in 2 s "
                                      f"({name} is not in the spec table)", measured=True)
        return spec
    if device.type != "cpu":
        raise ValueError(f"device type {device.type!r} is not supported; use 'cpu' or 'cuda'")
    return cpu_spec((normalize_dtype(dtype),))
