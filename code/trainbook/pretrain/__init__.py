"""Part 2, Pretraining: one module per chapter, building on the trainer (`trainbook.train`).

So far: `lifecycle` (the stages, compute per stage, success criteria, the data stage of the
book's tiny end-to-end run); `sweeps` (training sweeps for the scaling-law chapter of Part 1);
for data and tokenization: `quality` (Gopher and C4 filters), `dedup` (exact and MinHash LSH), `bpe`
(byte-level BPE from scratch), `packing` (padding waste, document masks), `mixture` (source
weights, epochs, blending); for learning-rate schedules: `schedules` (warmup, the stability
grid, WSD cooldowns branched from one run); for optimizers: `optimizers` (SGD, Adam, AdamW,
Adafactor and Muon from scratch against torch.optim, state bytes, the lr sweep); for
autoregressive modelling: `autoregressive` (the causal check, n-gram levels of the loss curve,
loss by position, induction heads, teacher forcing against free running); for the loss: `loss`
(cross-entropy from scratch, its gradient, z-loss, bits per byte, gradient accumulation); for
initialisation and hyperparameters: `init_scale` (scale by depth, the chapter's short runs),
`mup` (coordinate check, learning-rate transfer), `noise_scale` (the gradient noise scale);
for masked and denoising objectives: `objectives` (BERT masking, T5 span corruption and its
lengths, prefix LM, UL2's denoisers, the four objectives compared on common ground).

Chapter: book/compute/scaling-laws; book/start/lifecycle.
"""

from __future__ import annotations
