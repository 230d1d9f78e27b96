"""Is low precision fast on this CPU? The class of the machine, and a sub-second measurement.

CPUs differ by two orders of magnitude in bf16 and fp16 matmul speed. Intel CPUs with AMX or
AVX512-BF16 (and Arm CPUs with the BF16/SME extensions) multiply bf16 natively, through oneDNN,
often faster than fp32. Many others (AMD Zen 2, most laptops, many cloud VMs) have no such
instructions: PyTorch then converts element by element in a generic fallback, about 150 times
slower than fp32. Code that sizes low-precision work for the fast kind times out on the slow one,
so the book measures which kind it runs on (`probe`) before choosing shapes, and CI forces the
slow path once (`TRAINBOOK_SLOW_LOWP=1`: oneDNN off, so bf16/fp16 matmuls take the fallback).

Chapter: book/compute/throughput (and how-to-use, "Sizes and machines").
"""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import SLOW_LOWP_ENV
from ..launch import threads
from .matmul import probe_tflops

# x86 flags and Arm features (/proc/cpuinfo) that give native bf16 matrix arithmetic
_NATIVE_BF16 = {"amx_bf16": "AMX", "avx512_bf16": "AVX512-BF16", "bf16": "Arm BF16",
                "sme": "Arm SME"}
# Below this fraction of the fp32 rate a dtype counts as emulated: the emulated path measures
# about 1/150, native paths 1/2 to 4x; a busy machine moves a probe by 2x, not 30x.
EMULATED_BELOW = 0.25


def slow_path_forced(env: dict | None = None) -> bool:
    """True when TRAINBOOK_SLOW_LOWP asks for the slow low-precision CPU path."""
    env = os.environ if env is None else env
    return env.get(SLOW_LOWP_ENV, "").strip() not in ("", "0")


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (x86 'flags', Arm 'Features'); empty elsewhere."""
    path = Path("/proc/cpuinfo")
    if not path.exists():
        return set()
    for line in path.read_text().splitlines():
        key = line.split(":", 1)[0].strip()
        if key in ("flags", "Features"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_class(flags: set[str] | None = None, env: dict | None = None) -> str:
    """'AMX', 'AVX512-BF16', 'Arm BF16' ... when bf16 is native here, else 'no native bf16';
    '(forced slow path)' is added when TRAINBOOK_SLOW_LOWP hides the native path."""
    flags = cpu_flags() if flags is None else flags
    native = [name for flag, name in _NATIVE_BF16.items() if flag in flags]
    label = "+".join(native) if native else "no native bf16"
    if slow_path_forced(env):
        label += " (forced slow path: oneDNN off)"
    return label


@dataclass(frozen=True)
class LowPrecision:
    """Matmul rates measured here in a fraction of a second, and what they imply."""

    device: str
    cpu_class: str
    tflops: dict[str, float]  # probe rate per dtype

    def ratio(self, dtype: str) -> float:
        """Rate of `dtype` over the fp32 rate (about 1/150 when emulated)."""
        return self.tflops[dtype] / self.tflops["fp32"]

    def emulated(self, dtype: str) -> bool:
        return self.ratio(dtype) < EMULATED_BELOW

    @property
    def fastest(self) -> str:
        """The dtype with the highest measured rate: what throughput cells should measure in."""
        return max(self.tflops, key=self.tflops.get)

    def describe(self) -> str:
        parts = [f"{d} {'emulated' if self.emulated(d) else 'native'} "
                 f"({self.ratio(d):.3g}x fp32)" for d in self.tflops if d != "fp32"]
        return f"{self.cpu_class}: " + ", ".join(parts)


def probe(device: str = "cpu", dtypes: Sequence[str] = ("fp32", "bf16"),
          seconds: float = 0.05) -> LowPrecision:
    """Measure each dtype's matmul rate for `seconds` (about 0.1 s in all, on either kind).

    On a CPU the probe runs on one thread: the ratio is a property of the instruction set, and
    one thread cannot thrash the way several OpenMP threads do on an oversubscribed machine
    (measured here: 2 threads on 2 busy cores drop fp32 from 350 to 7 GFLOPS, bf16 barely moves).
    """
    if "fp32" not in dtypes:
        raise ValueError(f"dtypes must include fp32 (the yardstick), got {tuple(dtypes)}")
    dev = torch.device(device)
    label = cpu_class() if dev.type == "cpu" else torch.cuda.get_device_name(dev)
    with threads(1):
        rates = {d: probe_tflops(d, dev, seconds=seconds) for d in dtypes}
    return LowPrecision(str(dev), label, rates)


def machine_line() -> str:
    """One line for logs: which kind of CPU ran this, and how fast bf16 is on it."""
    lp = probe()
    return (f"{platform.machine()} CPU, {lp.describe()}; fp32 {lp.tflops['fp32'] * 1e3:.3g} "
            f"GFLOPS, bf16 {lp.tflops['bf16'] * 1e3:.3g} GFLOPS (256^3 matmul probe, one thread), "
            f"torch.backends.cpu capability {torch.backends.cpu.get_cpu_capability()}")
