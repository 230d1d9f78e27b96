"""Part 8, Frontier: one package for the part, a few modules per chapter, each building on the
trainer's hooks (`trainbook.train.hooks`) and on the earlier parts' from-scratch pieces.

For training mixture-of-experts models: `moe_router` (the three routers people use: Mixtral's
softmax over the top-k logits, Switch's top-k of the softmax, DeepSeek-V3's sigmoid; the
load-balancing loss in the conventions people write it; load statistics), `moe_layer` (the MoE
layer with those seams, swapped into the reference model by a trainer hook, with capacity,
auxiliary losses through the backward pass, bias balancing, shared experts and upcycling),
`moe_runs` (one proxy run over the trainer and what is read off its history), `moe_studies`
(the chapter's experiments: collapse and its fixes, capacity, dense against MoE at equal active
FLOPs, expert granularity, upcycling; stored with their provenance) and `moe_accounting` (total
and active parameters and FLOPs of Mixtral 8x7B and DeepSeek-V3 from their config.json,
against what their authors print), taught in book/frontier/moe.

For multimodal training: `vision` (a ViT from scratch, matched to transformers' ViT and CLIP
vision models), `vision_cost` (image tokens of real encoders and what they cost the language
model), `multimodal_data` (the generated scenes, captions and questions), `llava` (encoder,
projector and language model, trained in stages) and `multimodal_runs` (the chapter's stored
LLaVA run), taught in book/frontier/multimodal.

For synthetic data loops: `synthetic` (rejection sampling with a verifier, deduplication,
self-instruct, teacher labels; the stored rounds), `synthetic_sources` (what each source of
data buys at equal fine-tuning steps, stored) and `collapse` (the Gaussian refit's closed forms
and simulation; the reference model trained on its own samples), taught in
book/frontier/synthetic-data.

Chapter: book/frontier/moe, book/frontier/multimodal, book/frontier/synthetic-data.
"""

from __future__ import annotations
