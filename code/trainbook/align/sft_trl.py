"""The from-scratch SFT loop against trl's `SFTTrainer`: the same data, the same steps, the same
losses.

`compare_trl` fine-tunes two copies of one model on the same task items: `sft.sft` on the
reference model, and `trl.SFTTrainer` on its transformers export (`bench.hf.to_hf`). trl gets
the items as a conversational prompt-completion dataset (`dataset`), tokenizes them with the
chat tokenizer saved for transformers (its chat template renders `ChatTokenizer.chat_ids`), and
builds its completion mask; the rows are laid out in the order `sft.draws` draws them and read
sequentially, so both see the same batches. The settings are made equal where the defaults
differ (`trl_config`): the learning rate, constant schedule, no warmup (transformers' warmup
starts from 0 at the first step, the book's from lr/warmup), fp32 (trl turns bf16 on by
default), torch's non-fused AdamW, clipping at `cfg.max_grad_norm` (transformers' default 1.0,
which the comparison passes to both), no weight decay (transformers exempts biases and norm
weights from it, the book's loop does not). The loss of each trl step is recorded from its
`compute_loss` (the logged loss is rounded to 4 digits).

`compare_packed_batch` does the same for one batch of trl's packing (`packing=True`: best-fit
decreasing rows, padding-free, positions restarting per example, from which transformers builds
the block-diagonal mask) against `sft_packing.packed_loss` on the rows `sft_packing.pack` makes.

`TRL_SFT_DEFAULTS`, `TRAINER_DEFAULTS` and `DATASETS_MAP_BATCH` are the library defaults the
chapter relies on or changes; tests/test_sft.py asserts each against the installed libraries.

Chapter: book/alignment/sft
"""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..bench.hf import to_hf
from .lora_check import quiet
from .policy import pad
from .reward_trl import require_trl
from .sft import SFTConfig, draws, examples, masked_lm_loss, sft
from .sft_data import TRAINING_TEMPLATE
from .sft_packing import pack, packed_loss
from .task import ChatTokenizer, Problem

# trl 1.16 SFTConfig's own defaults (trl/trainer/sft_config.py, base_config.py)
TRL_SFT_DEFAULTS = {
    "learning_rate": 2e-5,
    "max_length": 1024,  # longer examples are truncated
    "packing": False,
    "packing_strategy": "bfd",  # best-fit decreasing; padding-free when packing
    "padding_free": False,
    "completion_only_loss": None,  # None: on for prompt-completion data, off for plain text
    "assistant_only_loss": False,  # needs {% generation %} markers in the chat template
    "loss_type": "nll",
    "shuffle_dataset": False,
    "gradient_checkpointing": True,  # transformers' default is False
    "logging_steps": 10,
}
TRL_BF16_WHEN_UNSET = True  # bf16 defaults to True unless fp16 is set
# transformers.TrainingArguments defaults an SFT run inherits
TRAINER_DEFAULTS = {
    "num_train_epochs": 3.0,
    "per_device_train_batch_size": 8,
    "lr_scheduler_type": "linear",  # decays to 0 at the last step
    "warmup_steps": 0,
    "weight_decay": 0.0,
    "adam_beta1": 0.9,
    "adam_beta2": 0.999,
    "adam_epsilon": 1e-8,
    "max_grad_norm": 1.0,
    "optim": "adamw_torch_fused",  # torch >= 2.8
    "train_sampling_strategy": "random",
}
# the comparison's settings: sft.SFTConfig's, with transformers' clipping and without warmup
COMPARE = SFTConfig(steps=30, warmup_steps=0, max_grad_norm=TRAINER_DEFAULTS["max_grad_norm"])
DATASETS_MAP_BATCH = 1000  # datasets' map batch size: trl packs within each 1000 examples
FORMS = ("prompt-completion", "messages")


def dataset(items: Sequence[Problem], form: str = "prompt-completion") -> Any:
    """A conversational `datasets.Dataset` of the items: prompt and completion as chat messages
    (trl's completion_only_loss applies), or whole conversations under "messages" (for trl's
    assistant_only_loss)."""
    from datasets import Dataset

    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    if not items:
        raise ValueError("no items")
    user = [{"role": "user", "content": p.prompt} for p in items]
    answer = [{"role": "assistant", "content": p.answer} for p in items]
    if form == "messages":
        return Dataset.from_dict({"messages": [[u, a] for u, a in zip(user, answer)]})
    return Dataset.from_dict({"prompt": [[u] for u in user], "completion": [[a] for a in answer]})


def trl_config(cfg: SFTConfig, folder: str, **overrides: Any) -> Any:
    """trl's SFTConfig with the from-scratch loop's settings (see the module docstring)."""
    trl = require_trl()
    if cfg.warmup_steps:
        raise ValueError("compare with warmup_steps=0: transformers' warmup gives the first step "
                         "a learning rate of 0, the book's loop lr/warmup_steps")
    if cfg.weight_decay:
        raise ValueError("compare with weight_decay=0: transformers exempts biases and norm "
                         "weights from weight decay, the book's loop does not")
    args = dict(output_dir=folder, report_to=[], use_cpu=True, bf16=False,
                gradient_checkpointing=False, learning_rate=cfg.lr,
                lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                max_grad_norm=cfg.max_grad_norm, optim="adamw_torch",
                per_device_train_batch_size=cfg.batch_size, max_steps=cfg.steps,
                train_sampling_strategy="sequential", save_strategy="no", logging_steps=1,
                disable_tqdm=True, seed=cfg.seed, dataloader_drop_last=False)
    args.update(overrides)
    return trl.SFTConfig(**args)


def trainer(hf_model: nn.Module, tok: ChatTokenizer, data: Any, args: Any) -> Any:
    """A `trl.SFTTrainer` that records the loss of every training step (`.losses`)."""
    trl = require_trl()
    from transformers import AutoTokenizer

    class Recording(trl.SFTTrainer):
        losses: list[float] = []

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if model.training:
                self.losses.append((loss[0] if return_outputs else loss).item())
            return loss

    from transformers.trainer_callback import PrinterCallback

    tok.save_pretrained(args.output_dir)
    out = Recording(model=hf_model, args=args, train_dataset=data,
                    processing_class=AutoTokenizer.from_pretrained(args.output_dir))
    out.remove_callback(PrinterCallback)  # with disable_tqdm, the log lines go to stdout
    out.losses = []
    return out


def trl_examples(model: nn.Module, tok: ChatTokenizer, items: Sequence[Problem],
                 form: str = "prompt-completion") -> list[tuple[list[int], list[int]]]:
    """(input_ids, loss mask) of each item as trl prepares them for `model` (the mask read from
    its labels): a prompt-completion dataset with trl's default completion-only loss, or a
    messages dataset with assistant_only_loss=True under `sft_data.TRAINING_TEMPLATE`."""
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    with quiet(), tempfile.TemporaryDirectory() as tmp:
        extra = {}
        if form == "messages":
            path = Path(tmp) / "training.jinja"
            path.write_text(TRAINING_TEMPLATE)
            extra = dict(assistant_only_loss=True, chat_template_path=str(path))
        args = trl_config(SFTConfig(steps=1, batch_size=1, warmup_steps=0), tmp, **extra)
        run = trainer(to_hf(copy.deepcopy(model).float()), tok, dataset(items, form), args)
        return _prepared(run.train_dataset)


def _prepared(data) -> list[tuple[list[int], list[int]]]:
    return [(list(r["input_ids"]), [int(x != -100) for x in r["labels"]]) for r in data]


@dataclass
class Curves:
    """Per-step losses of the two runs, and whether trl's examples are the book's tokens."""

    ours: list[float]
    trl: list[float]
    same_examples: bool
    grad_norms: list[float]  # trl's logged global gradient norm of each step, before clipping

    def rel_diff(self) -> list[float]:
        return [abs(a - b) / abs(a) for a, b in zip(self.ours, self.trl)]


def compare_trl(model: nn.Module, tok: ChatTokenizer, items: Sequence[Problem],
                cfg: SFTConfig = COMPARE) -> Curves:
    """Fine-tune copies of `model` with `sft.sft` and with trl's SFTTrainer on the same batches
    (model is not changed); returns both loss curves."""
    if not items:
        raise ValueError("no items to fine-tune on")
    with quiet(), tempfile.TemporaryDirectory() as tmp:
        args = trl_config(cfg, tmp)  # refuses what cannot match, before any work
        order = [items[i] for batch in draws(len(items), cfg) for i in batch]
        hf = to_hf(copy.deepcopy(model).float())
        run = trainer(hf, tok, dataset(order), args)
        same = _prepared(run.train_dataset.select(range(min(len(order), 64)))) == \
            examples(tok, order[:64])
        run.train()
    ours = sft(copy.deepcopy(model).float(), tok, items, cfg)
    norms = [float(h["grad_norm"]) for h in run.state.log_history if "grad_norm" in h]
    return Curves(ours, list(run.losses), same, norms)


@dataclass
class PackedBatch:
    """One batch of trl's packing against the book's packed rows."""

    same_rows: bool  # trl's rows hold the same examples, in the same order, as `pack`'s
    trl_loss: float
    ours_loss: float  # `packed_loss` with boundaries
    padded_loss: float  # the same examples, padded, one per row
    naive_loss: float  # `packed_loss` without boundaries


def compare_packed_batch(model: nn.Module, tok: ChatTokenizer, items: Sequence[Problem],
                         capacity: int = 64) -> PackedBatch:
    """Pack the items with trl (`packing=True`, max_length=capacity, one batch of all its rows)
    and with `sft_packing.pack`, and compute each loss on the same weights."""
    if not items or len(items) > DATASETS_MAP_BATCH:
        raise ValueError(f"give 1 to {DATASETS_MAP_BATCH} items (trl packs each "
                         f"{DATASETS_MAP_BATCH} separately), got {len(items)}")
    data = examples(tok, items)
    rows = pack(data, capacity)
    with quiet(), tempfile.TemporaryDirectory() as tmp:
        hf = to_hf(copy.deepcopy(model).float())
        args = trl_config(SFTConfig(steps=1, batch_size=len(rows.rows), warmup_steps=0), tmp,
                          packing=True, max_length=capacity)
        run = trainer(hf, tok, dataset(items), args)
        trl_rows = [list(r["input_ids"]) for r in run.train_dataset]
        same = trl_rows == [[t for i in row for t in data[i][0]] for row in rows.rows]
        batch = run.data_collator([run.train_dataset[i] for i in range(len(run.train_dataset))])
        hf.eval()
        with torch.no_grad():
            trl_loss = run.compute_loss(hf, dict(batch)).item()
    ours = copy.deepcopy(model).float().eval()
    with torch.no_grad():
        ids, mask = pad([d[0] for d in data], [d[1] for d in data])
        return PackedBatch(same, trl_loss, packed_loss(ours, rows, True).item(),
                           masked_lm_loss(ours, ids, mask).item(),
                           packed_loss(ours, rows, False).item())
