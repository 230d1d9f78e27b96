"""Accelerator specs: the one table of peak FLOPS, memory and bandwidth in the book.

Every peak in trainbook (MFU, time and cost estimates, rooflines, the planner) comes from
`SPECS` or, for a CPU or an unknown GPU, from a matmul measured on the machine at hand
(`trainbook.bench.peak.detect`). This module is data only: it measures nothing. Peaks are *dense*
tensor-core numbers; vendor sheets often print 2:4-sparse numbers, twice as large.

Units: TFLOPS = 10^12 FLOP/s, memory in GiB (HBM stacks are binary-sized: the "80 GB" of an
H100 is 80 GiB; the table gives the nominal capacity, of which CUDA reports slightly less as
usable), bandwidth in decimal GB/s. Interconnect is the per-GPU bidirectional total.

Chapter: book/appendix/hardware.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")


@dataclass(frozen=True)
class Accelerator:
    """One accelerator's spec sheet (or a measurement, when `measured` is True)."""

    name: str
    vendor: str
    tflops: dict[str, float | None]  # dense peak per dtype; None where the chip lacks it
    memory_gib: float
    hbm_gbps: float  # memory bandwidth, decimal GB/s
    interconnect: str
    interconnect_gbps: float  # per GPU, bidirectional, decimal GB/s
    source: str
    measured: bool = False
    notes: str = field(default="")

    def peak_flops(self, dtype: str) -> float:
        """Dense peak in FLOP/s for `dtype`, with a clear error when the chip lacks it."""
        dtype = normalize_dtype(dtype)
        value = self.tflops.get(dtype)
        if value is None:
            have = ", ".join(d for d in DTYPES if self.tflops.get(d) is not None)
            raise ValueError(f"{self.name} has no {dtype} peak; it has: {have}")
        return value * 1e12


    def ridge_point(self, dtype: str) -> float:
        """FLOPs per byte of HBM traffic above which a kernel can be compute-bound (roofline)."""
        if not self.hbm_gbps:
            raise ValueError(f"{self.name} has no memory bandwidth in the table")
        return self.peak_flops(dtype) / (self.hbm_gbps * 1e9)


def _gpu(name, vendor, fp32, tf32, bf16, fp16, fp8, mem, hbm, link, link_gbps, source, notes=""):
    tflops = dict(fp32=fp32, tf32=tf32, bf16=bf16, fp16=fp16, fp8=fp8)
    return Accelerator(name, vendor, tflops, mem, hbm, link, link_gbps, source, notes=notes)


SPECS: dict[str, Accelerator] = {
    a.name: a
    for a in [
        _gpu("v100-sxm2-32gb", "NVIDIA", 15.7, None, None, 125.0, None, 32, 900, "NVLink 2", 300,
             "NVIDIA Tesla V100 datasheet (SXM2); fp16 is the tensor-core peak"),
        _gpu("t4", "NVIDIA", 8.1, None, None, 65.0, None, 16, 320, "PCIe Gen3", 32,
             "NVIDIA T4 datasheet; fp16 is the tensor-core peak (no bf16: emulated only)"),
        _gpu("l4", "NVIDIA", 30.3, 60.0, 121.0, 121.0, 242.0, 24, 300, "PCIe Gen4", 64,
             "NVIDIA L4 datasheet, dense (the sheet prints sparse, 2x)"),
        _gpu("a100-40gb", "NVIDIA", 19.5, 156.0, 312.0, 312.0, None, 40, 1555, "NVLink 3", 600,
             "NVIDIA A100 datasheet (SXM4 40 GB), dense (sparse numbers are 2x)"),
        _gpu("a100-80gb", "NVIDIA", 19.5, 156.0, 312.0, 312.0, None, 80, 2039, "NVLink 3", 600,
             "NVIDIA A100 datasheet (SXM4 80 GB), dense (sparse numbers are 2x)"),
        _gpu("h100-sxm", "NVIDIA", 66.9, 494.7, 989.4, 989.4, 1978.9, 80, 3350, "NVLink 4", 900,
             "NVIDIA H100 Tensor Core GPU Architecture whitepaper, Table 3 (H100 SXM5), dense"),
        _gpu("h100-pcie", "NVIDIA", 51.2, 378.0, 756.0, 756.0, 1513.0, 80, 2000, "PCIe Gen5", 128,
             "NVIDIA H100 Tensor Core GPU Architecture whitepaper, Table 3 (H100 PCIe), dense",
             notes="an NVLink bridge joins pairs at 600 GB/s"),
        _gpu("h200", "NVIDIA", 66.9, 494.7, 989.4, 989.4, 1978.9, 141, 4800, "NVLink 4", 900,
             "NVIDIA H200 datasheet (SXM), dense (sparse numbers are 2x)",
             notes="same GH100 compute as the H100 SXM; 141 GB HBM3e"),
        _gpu("b200", "NVIDIA", 75.0, 1100.0, 2250.0, 2250.0, 4500.0, 180, 7700, "NVLink 5", 1800,
             "NVIDIA HGX B200 datasheet, per-GPU column, dense (the sheet prints sparse, 2x)"),
        _gpu("mi300x", "AMD", 163.4, 653.7, 1307.4, 1307.4, 2614.9, 192, 5300,
             "Infinity Fabric", 896,
             "AMD Instinct MI300X datasheet, dense matrix peaks (sparse numbers are 2x)",
             notes="fp32 is the matrix-core peak; 7 links x 128 GB/s"),
    ]
}

_NAME_PATTERNS = [  # (regex on torch.cuda.get_device_name(), spec key); first match wins
    (r"\bH200\b", "h200"),
    (r"\bH100 PCIe\b", "h100-pcie"),
    (r"\bH100\b", "h100-sxm"),
    (r"\bB200\b", "b200"),
    (r"\bA100.*80GB", "a100-80gb"),
    (r"\bA100\b", "a100-40gb"),
    (r"\bV100\b", "v100-sxm2-32gb"),
    (r"\bMI300X\b", "mi300x"),
    (r"\bT4\b", "t4"),
    (r"\bL4\b", "l4"),  # not L40 or L40S
]

_DTYPE_ALIASES = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32",
    "tf32": "tf32",
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16",
    "fp8": "fp8", "float8": "fp8", "e4m3": "fp8",
}


def normalize_dtype(dtype: str | torch.dtype) -> str:
    """'bfloat16', torch.bfloat16 or 'bf16' -> 'bf16'."""
    key = str(dtype).removeprefix("torch.").lower()
    if key not in _DTYPE_ALIASES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return _DTYPE_ALIASES[key]


def get(name: str) -> Accelerator:
    """Look up a spec by name ('h100-sxm', 'a100-80gb', ...)."""
    key = name.lower()
    if key not in SPECS:
        raise ValueError(f"unknown accelerator {name!r}; known: {', '.join(SPECS)}")
    return SPECS[key]


def match_device_name(device_name: str) -> Accelerator | None:
    """The spec whose name matches a CUDA/ROCm device name, or None for an unknown chip."""
    for pattern, key in _NAME_PATTERNS:
        if re.search(pattern, device_name, re.IGNORECASE):
            return SPECS[key]
    return None


def table() -> list[dict]:
    """The spec table as rows (for the CLI, the appendix and the planner)."""
    rows = []
    for a in SPECS.values():
        row = {"name": a.name, "vendor": a.vendor}
        row.update({f"{d} TFLOPS": a.tflops[d] for d in DTYPES})
        row.update({"memory GiB": a.memory_gib, "HBM GB/s": a.hbm_gbps,
                    "interconnect": a.interconnect, "link GB/s": a.interconnect_gbps,
                    "source": a.source})
        rows.append(row)
    return rows
