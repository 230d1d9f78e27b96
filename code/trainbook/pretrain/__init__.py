"""Part 2, Pretraining: one module per chapter, building on the trainer (`trainbook.train`).

So far: `sweeps` (training sweeps for the scaling-law chapter of Part 1).

Chapter: book/compute/scaling-laws.
"""

from __future__ import annotations
