"""Compute and economics: FLOPs, memory, cost, scaling laws (Part 1 of the book).

Chapter: book/compute/flops.
"""

from __future__ import annotations
