"""Benchmarks of the machine at hand: matmul throughput (`bench.matmul`, the maximum achievable
matmul FLOPS finder), memory bandwidth for rooflines (`bench.memory`) and collectives
(`bench.collectives`, run under torchrun). MFU and HFU are in `trainbook.compute.flops`.

Chapter: book/compute/throughput.
"""

from __future__ import annotations
