"""The roofline model: is a kernel limited by compute or by memory bandwidth?

A kernel that does F FLOPs while moving B bytes to and from memory has arithmetic intensity
I = F / B (FLOP/byte). On a device with peak P (FLOP/s) and bandwidth W (byte/s) it cannot run
faster than min(P, I * W): below the ridge point P / W it is memory-bound, above it compute-bound
(Williams, Waterman and Patterson 2009). Peaks and bandwidths come from `trainbook.hardware`.

Chapter: book/compute/throughput.
"""

from __future__ import annotations

from ..hardware import Accelerator, normalize_dtype

BYTES_PER_ELEMENT = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


def bytes_per_element(dtype: str) -> int:
    return BYTES_PER_ELEMENT[normalize_dtype(dtype)]


def _check_dims(**dims) -> None:
    for name, v in dims.items():
        if v < 1:
            raise ValueError(f"matmul dimension {name} must be >= 1, got {v}")


def matmul_flops(m: int, n: int, k: int) -> int:
    """(m, k) @ (k, n): m * n dot products of length k, a multiply and an add each."""
    _check_dims(m=m, n=n, k=k)
    return 2 * m * n * k


def matmul_bytes(m: int, n: int, k: int, dtype: str) -> int:
    """The least memory traffic: read A and B once, write C once (perfect on-chip reuse)."""
    _check_dims(m=m, n=n, k=k)
    return bytes_per_element(dtype) * (m * k + k * n + m * n)


def matmul_intensity(m: int, n: int, k: int, dtype: str) -> float:
    """FLOP/byte of a matmul; for a square n x n x n it is 2n^3 / (3 n^2 b) = 2n / (3b)."""
    return matmul_flops(m, n, k) / matmul_bytes(m, n, k, dtype)


def elementwise_intensity(flops_per_element: float, tensors: int, dtype: str) -> float:
    """FLOP/byte of an elementwise op touching `tensors` tensors (inputs plus outputs) once.
    An add c = a + b: 1 FLOP over 3 tensors."""
    if tensors < 1 or flops_per_element < 0:
        raise ValueError("need tensors >= 1 and flops_per_element >= 0")
    return flops_per_element / (tensors * bytes_per_element(dtype))


def attainable_flops(intensity: float, peak_flops: float, bandwidth: float) -> float:
    """The roof: min(peak, intensity * bandwidth), in FLOP/s (bandwidth in byte/s)."""
    if intensity <= 0 or peak_flops <= 0 or bandwidth <= 0:
        raise ValueError("intensity, peak and bandwidth must all be > 0")
    return min(peak_flops, intensity * bandwidth)


def bound(intensity: float, spec: Accelerator, dtype: str) -> str:
    """'compute' at or above the spec's ridge point in `dtype`, else 'memory'."""
    return "compute" if intensity >= spec.ridge_point(dtype) else "memory"


def matmul_bound(m: int, n: int, k: int, dtype: str, spec: Accelerator) -> str:
    """Whether an (m, n, k) matmul in `dtype` can be compute-bound on `spec`."""
    return bound(matmul_intensity(m, n, k, dtype), spec, dtype)


def min_square_for_compute_bound(spec: Accelerator, dtype: str) -> int:
    """The smallest n for which an n x n x n matmul reaches the ridge: n = 3 b ridge / 2."""
    import math
    return math.ceil(1.5 * bytes_per_element(dtype) * spec.ridge_point(dtype))
