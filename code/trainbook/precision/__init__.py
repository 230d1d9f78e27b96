"""Part 3, Precision: one module per chapter (two or three where a chapter needs them), building
on the number formats (`trainbook.formats`) and the trainer's low-precision runtime
(`trainbook.train.emulate`).

For number formats: `formats` (bit patterns, the format table against torch.finfo and
ml_dtypes, what each cast does on overflow, TF32) and `blocks` (block scaling against one scale
per tensor, E4M3 against E5M2 on the model's tensors, the hardware that runs each format, weight
memory per format). For mixed precision: `mixed` (what autocast keeps in fp32, bytes per
parameter, fp16 underflow of the model's gradients), `loss_scaling` (dynamic loss scaling from
scratch against GradScaler), `lowp_weights` (bf16 weights without master copies: nearest,
Kahan-compensated and stochastically rounded updates) and `lowp_training` (the precision
variants trained on the same run). For numerics: `numerics` (accumulation and summation),
`stable` (softmax, log-sum-exp, attention logits, norms) and `reproducibility` (order,
batch and thread invariance, determinism). For FP8: `fp8` (scaling recipes on real tensors,
outliers, delayed scaling's failure, the check against torch._scaled_mm) and `fp8_training`
(the recipes trained against bf16, the head in FP8, memory and speed-up models).

Chapter: book/precision/formats; book/precision/mixed-precision; book/precision/numerics;
book/precision/fp8.
"""

from __future__ import annotations
