"""Timing a kernel honestly: on the device's own clock, with the caches flushed between runs.

A GPU runs asynchronously (a host clock times the launch, not the kernel), and a repeated matmul
or copy finds its operands in cache (it times the cache, not the memory a training step reads
from). `Timer` brackets the work with CUDA events on a GPU and `perf_counter` on a CPU;
`CacheFlusher` writes a buffer larger than the last-level cache before each timed run.

Chapter: book/compute/throughput.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

# Larger than the L2 of any current GPU (H100: 50 MiB); an MI300X also has a 256 MiB Infinity
# Cache behind its L2: give it --flush-mib 512.
GPU_FLUSH_BYTES = 256 * 2**20
CPU_FLUSH_CAP = 256 * 2**20  # a CPU's last-level cache can be huge (or misreported by a VM): cap it
SMALL_FLUSH_BYTES = 32 * 2**20  # --quick and the notebooks' small size: cheap, and past any L2


class Timer:
    """Seconds taken by `fn()` on `device`: CUDA events on a GPU, perf_counter on a CPU.

    On a GPU the host only enqueues work, so a host clock would time the launch; events recorded
    on the stream bracket the kernel itself, and `synchronize` waits for it.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.gpu = self.device.type == "cuda"
        if self.gpu:
            self.start = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)

    def sync(self) -> None:
        if self.gpu:
            torch.cuda.synchronize(self.device)

    def __call__(self, fn) -> float:
        if self.gpu:
            self.start.record()
            fn()
            self.end.record()
            self.end.synchronize()
            return self.start.elapsed_time(self.end) / 1e3  # ms -> s
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def last_level_cache_bytes() -> int | None:
    """The largest CPU cache Linux reports (sysfs), or None where it cannot be read."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        try:
            sizes.append(int(text.rstrip("KMG")) * mult)
        except ValueError:
            continue
    return max(sizes) if sizes else None


def default_flush_bytes(device: torch.device, small: bool = False) -> int:
    """256 MiB on a GPU (past any L2); on a CPU twice the last-level cache, capped at 256 MiB;
    32 MiB in small mode (past the per-core L2 where small operands would otherwise stay)."""
    if small:
        return SMALL_FLUSH_BYTES
    if torch.device(device).type == "cuda":
        return GPU_FLUSH_BYTES
    llc = last_level_cache_bytes() or 32 * 2**20
    return min(2 * llc, CPU_FLUSH_CAP)


class CacheFlusher:
    """Writes a buffer of `nbytes` on the device: whatever the caches held is evicted."""

    def __init__(self, device: torch.device, nbytes: int):
        if nbytes < 0:
            raise ValueError(f"flush size must be >= 0 bytes, got {nbytes}")
        self.nbytes = nbytes
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=device) if nbytes else None

    def __call__(self) -> None:
        if self.buffer is not None:
            self.buffer.zero_()
