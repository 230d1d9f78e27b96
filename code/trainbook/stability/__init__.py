"""Part 4, Stability: one module per chapter (two where a chapter needs them), building on the
trainer's hooks and monitors (`trainbook.train.hooks`, `trainbook.train.monitor`).

For gradient explosion and clipping: `clipping` (the global norm from scratch against
clip_grad_norm_, alone and sharded under FSDP2 and tensor parallelism, value against norm
clipping) and `clipping_runs` (per-block gradient norms as a hook, what clipping does and does
not fix, measured). For loss spikes: `instability` (attention-logit growth and output-logit
divergence at a high learning rate, the fixes' learning-rate sweeps, LR sensitivity) and
`spikes` (a planted bad-data stretch, the spike detector's false alarms and detections, PaLM's
restart-and-skip as a driver over the trainer). For numerical debugging: `debugging` (per-module
statistics against fp16/bf16 limits, anomaly mode, what each tool costs) and `debugging_bugs`
(planted bugs found and fixed; the `nan-hunt` command plants them). `taxonomy`: training
failures by signature, cause, experiment and fix, and the decision procedure.

Chapter: book/stability/clipping; book/stability/loss-spikes; book/stability/debugging;
book/stability/taxonomy.
"""

from __future__ import annotations
