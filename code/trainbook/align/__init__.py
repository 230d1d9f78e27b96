"""Part 7: evaluation, fine-tuning and alignment.

`task` (a chat tokenizer and a verifiable arithmetic task), `policy` (sampling and
log-probabilities), `base` (a small pretrained reference model) and `sft` (supervised fine-tuning
on assistant tokens) are the foundation the chapters share; each method has a module of its own.

Chapter: book/alignment/evaluation
"""
