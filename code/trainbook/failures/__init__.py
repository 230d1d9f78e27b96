"""Part 6, Failures and recovery: one module per chapter (two where a chapter needs them),
building on the trainer's checkpoints and guard (`trainbook.train.checkpoint`,
`trainbook.train.guard`).

Chapter: book/failures/checkpointing; book/failures/exact-resume; book/failures/fault-tolerance;
book/failures/hangs; book/failures/health; book/failures/slurm.
"""

from __future__ import annotations
