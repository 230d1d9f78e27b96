"""Memory bandwidth of the machine at hand, for the roofline: time a large copy.

A copy of B bytes reads B and writes B, so it moves 2B. On a GPU the copy runs from HBM to HBM;
on a CPU, use a buffer much larger than the last-level cache or the number is a cache bandwidth.

Chapter: book/compute/throughput.
"""

from __future__ import annotations

import torch

from ..launch import resolve_device
from .timing import Timer


def copy_bandwidth_gbps(nbytes: int = 256 * 2**20, device: str = "auto", repeats: int = 5) -> float:
    """Best GB/s (decimal) of dst.copy_(src) over `repeats`, counting read plus write: the
    fastest repeat is the roof, as the max TFLOPS is for matmuls (the rest is interference)."""
    if nbytes < 2**20 or repeats < 1:
        raise ValueError(f"need nbytes >= 1 MiB and repeats >= 1, got {nbytes} and {repeats}")
    dev = resolve_device(device)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    timer = Timer(dev)
    dst.copy_(src)  # warm-up: page in both buffers
    timer.sync()
    times = [timer(lambda: dst.copy_(src)) for _ in range(repeats)]
    return 2 * src.numel() * 4 / min(times) / 1e9
