"""The from-scratch reward model against trl's `RewardTrainer`, on the same weights and batch.

`to_hf_reward` exports a `reward.RewardModel` to transformers' sequence-classification model of
its architecture (`LlamaForSequenceClassification` for the book's model): the trunk's weights
through `bench.hf.to_hf`, the score head copied, `num_labels=1`, and `pad_token_id` set, which
the model needs to find each row's last non-pad token (without it, a batch larger than one is
refused). `compare_trl` then builds a `trl.RewardTrainer` on that model, the chat tokenizer
exported with `ChatTokenizer.save_pretrained` and a conversational preference dataset (prompt,
chosen, rejected as chat messages), lets trl tokenize and collate the pairs, and checks:

- trl's batch is ours token for token (`reward.pair_batch`: chosen rows then rejected rows,
  right-padded with the pad token);
- the rewards, trl's `compute_loss` and `reward.bt_loss`, with and without the margin and the
  centering term, agree to float tolerance;
- the gradients of one backward pass agree (the score head and the embedding).

`TRL_REWARD_DEFAULTS` and `TRAINING_ARGS_DEFAULTS` are the settings of a trl reward run that
the chapter's comparison relies on or differs from; tests/test_reward.py asserts each against
the installed trl and transformers.

Chapter: book/alignment/reward-models
"""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..bench.hf import hf_config, require_transformers, to_hf
from .lora_check import quiet
from .preferences import Pair
from .reward import RewardModel, bt_loss, pair_batch, pair_rewards
from .task import ChatTokenizer

if TYPE_CHECKING:
    from datasets import Dataset
    from trl import RewardTrainer

# trl 1.16 RewardConfig's own defaults (trl/trainer/reward_config.py, base_config.py)
TRL_REWARD_DEFAULTS = {
    "learning_rate": 1e-4,  # ours: RMConfig.lr
    "center_rewards_coefficient": None,  # off; trl's docstring recommends 0.01
    "max_length": 1024,  # pairs longer than this are dropped, not truncated
    "disable_dropout": True,
    "gradient_checkpointing": True,
    "logging_steps": 10,
}
TRL_BF16_WHEN_UNSET = True  # RewardConfig: bf16 defaults to True unless fp16 is set
# transformers.TrainingArguments defaults a trl reward run inherits
TRAINING_ARGS_DEFAULTS = {
    "lr_scheduler_type": "linear",  # decays to 0; ours is constant after warmup
    "warmup_steps": 0,
    "weight_decay": 0.0,
    "adam_beta1": 0.9,
    "adam_beta2": 0.999,
    "adam_epsilon": 1e-8,
    "per_device_train_batch_size": 8,
    "num_train_epochs": 3.0,
}


def require_trl() -> ModuleType:
    """The trl module, or a one-line reason it cannot be used."""
    try:
        import trl
    except ImportError:
        raise ValueError('trl is not installed; pip install trl') from None
    return trl


@torch.no_grad()
def to_hf_reward(rm: RewardModel) -> nn.Module:
    """transformers' sequence-classification model (num_labels=1, pad_token_id set) with `rm`'s
    trunk and score head: the same reward for every sequence."""
    if not isinstance(rm, RewardModel):
        raise ValueError(f"to_hf_reward exports a RewardModel, got {type(rm).__name__}")
    tf = require_transformers()
    lm = copy.deepcopy(rm.body)  # to_hf maps a whole LM: give it a (discarded) vocabulary head
    lm.head = nn.Linear(rm.cfg.d_model, rm.cfg.vocab_size, bias=False)
    if rm.cfg.tied:
        lm.head.weight = lm.embed.weight
    causal = to_hf(lm)
    config = hf_config(rm.cfg)
    config.num_labels = 1
    config.pad_token_id = rm.pad_id
    ref = next(rm.parameters())
    hf = tf.AutoModelForSequenceClassification.from_config(config).to(ref.device, ref.dtype)
    prefix = hf.base_model_prefix
    getattr(hf, prefix).load_state_dict(getattr(causal, prefix).state_dict())
    hf.score.weight.copy_(rm.score.weight)
    return hf.train()


def preference_dataset(pairs: Sequence[Pair], with_margin: bool = False) -> Dataset:
    """A `datasets.Dataset` of conversational preference pairs, trl's format: prompt, chosen
    and rejected as lists of chat messages (and margin when asked)."""
    from datasets import Dataset

    if not pairs:
        raise ValueError("no preference pairs")
    rows = []
    for p in pairs:
        row = {"prompt": [{"role": "user", "content": p.prompt}],
               "chosen": [{"role": "assistant", "content": p.chosen}],
               "rejected": [{"role": "assistant", "content": p.rejected}]}
        if with_margin:
            row["margin"] = p.margin
        rows.append(row)
    return Dataset.from_list(rows)


@dataclass
class RewardComparison:
    """Ours against trl on one batch: whether the token ids are identical, the largest reward
    difference, both losses, and the largest gradient differences (score head, embedding)."""

    same_ids: bool
    reward_diff: float
    ours_loss: float
    trl_loss: float
    score_grad_diff: float
    embed_grad_diff: float

    @property
    def loss_diff(self) -> float:
        return abs(self.ours_loss - self.trl_loss)


def trl_trainer(hf_model: nn.Module, tok: ChatTokenizer, pairs: Sequence[Pair], folder: str,
                center_coef: float | None = None, with_margin: bool = False) -> RewardTrainer:
    """A `trl.RewardTrainer` on the model and pairs (fp32 on the CPU, no reporting)."""
    trl = require_trl()
    from transformers import AutoTokenizer

    tok.save_pretrained(folder)
    args = trl.RewardConfig(output_dir=folder, report_to=[], use_cpu=True, bf16=False,
                            gradient_checkpointing=False, center_rewards_coefficient=center_coef,
                            per_device_train_batch_size=len(pairs), save_strategy="no")
    return trl.RewardTrainer(model=hf_model, args=args,
                             train_dataset=preference_dataset(pairs, with_margin),
                             processing_class=AutoTokenizer.from_pretrained(folder))


def compare_trl(rm: RewardModel, tok: ChatTokenizer, pairs: Sequence[Pair],
                center_coef: float | None = None, with_margin: bool = False) -> RewardComparison:
    """Export `rm`, let trl tokenize, collate and compute the loss of the pairs, and compare
    every piece with ours on the same weights (rm itself is not changed)."""
    if not pairs:
        raise ValueError("no preference pairs to compare on")
    if center_coef is not None and not center_coef >= 0:
        raise ValueError(f"center_coef must be None or >= 0, got {center_coef}")
    ours = copy.deepcopy(rm).train()
    with quiet(), tempfile.TemporaryDirectory() as tmp:
        hf = to_hf_reward(ours)
        trainer = trl_trainer(hf, tok, pairs, tmp, center_coef, with_margin)
        data = trainer.train_dataset
        batch = trainer.data_collator([data[i] for i in range(len(data))])
        trl_loss, out = trainer.compute_loss(trainer.model, dict(batch), return_outputs=True)
    ids, margin = pair_batch(tok, pairs)
    same = batch["input_ids"].shape == ids.shape and bool((batch["input_ids"] == ids).all())
    r_c, r_r = pair_rewards(ours, ids)
    loss = bt_loss(r_c, r_r, margin if with_margin else None, center_coef or 0.0)
    reward_diff = (torch.cat([r_c, r_r]) - out.logits.squeeze(-1)).abs().max().item()
    loss.backward()
    trl_loss.backward()
    score_diff = (ours.score.weight.grad - hf.score.weight.grad).abs().max().item()
    embed = getattr(hf, hf.base_model_prefix).get_input_embeddings().weight.grad
    embed_diff = (ours.body.embed.weight.grad - embed).abs().max().item()
    return RewardComparison(same, reward_diff, loss.item(), trl_loss.item(), score_diff,
                            embed_diff)
