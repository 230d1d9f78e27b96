"""The from-scratch GRPO loss against trl's `GRPOTrainer`, on the same weights and the same batch.

`compare_grpo` saves the policy's transformers export (`bench.hf.to_hf`) to a folder and builds
a `trl.GRPOTrainer` from it (trl creates its reference model from the same path when beta > 0;
the reference's weights are then replaced by the export of ours), with the chat tokenizer, the
task's prompts as a conversational dataset and the verifier as the reward function. trl
generates and scores one batch itself (`_generate_and_score_completions`: each prompt G times,
rewards, group advantages, the reference's log-probabilities); its `compute_loss` gives the
loss. The same completions then go through ours: `dpo.rewards` for the rewards,
`grpo.group_advantages`, and `grpo.grpo_loss` with the loss type's aggregation. Optionally the
batch is made off-policy (`old` model: its log-probabilities become trl's
`old_per_token_logps` and ours), so that the ratio differs from 1 and the clip acts.

trl multiplies the KL term by the ratio by default (`use_bias_correction_kl`,
`grpo.TRL_GRPO_KL_RATIO`); ours is DeepSeekMath's form, so the comparison turns it off (the
values agree on-policy either way; `kl_ratio=True` shows the difference off-policy).

Chapter: book/alignment/grpo
"""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..bench.hf import to_hf
from .dpo import rewards
from .dpo_trl import Comparison, _tokenizer, quiet_trl
from .grpo import group_advantages, grpo_loss
from .policy import Rollouts, token_logprobs
from .reward_trl import require_trl
from .task import PAD, ChatTokenizer, Problem, verify

TRL_LOSSES = {"grpo": "grpo", "bnpo": "dapo", "dapo": "dapo", "dr_grpo": "dr_grpo"}


@dataclass
class GRPOComparison(Comparison):
    """A `Comparison` on one generated batch, with whether the rewards are identical, the
    largest difference of the advantages, and the number of completions."""

    same_rewards: bool = False
    advantage_diff: float = float("nan")
    completions: int = 0


def trl_reward(prompts: list, completions: list, completion_ids: list[list[int]], answer: list[str],
               **kwargs: object) -> list[float]:
    """The task's rule-based reward as a trl reward function (`dpo.rewards` on what trl passes:
    the decoded assistant message, the completion's ids, the dataset's `answer` column). The trl
    CLI takes it by import path: `--reward_funcs trainbook.align.grpo_trl.trl_reward`."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    items = [Problem("", a) for a in answer]
    ids = [[t for t in c if t != PAD] for c in completion_ids]
    return rewards(items, Rollouts([[]] * len(ids), ids, texts), verify)


def _reward_fn(seen: list):
    """`trl_reward`, keeping what it returns in `seen`."""
    def correct(*args, **kwargs):
        out = trl_reward(*args, **kwargs)
        seen.extend(out)
        return out
    return correct


def compare_grpo(model: nn.Module, ref: nn.Module, tok: ChatTokenizer, items: Sequence[Problem],
                 loss: str = "grpo", beta: float = 0.0, group: int = 4,
                 max_new_tokens: int = 6, eps_low: float = 0.2, eps_high: float = 0.2,
                 scale: str = "group", old: nn.Module | None = None,
                 kl_ratio: bool = False, seed: int = 0) -> GRPOComparison:
    """trl's GRPO loss (`loss` one of TRL_LOSSES) against ours on one batch trl generates from
    the items' prompts (each `group` times); neither model is changed."""
    if loss not in TRL_LOSSES:
        raise ValueError(f"loss must be one of {', '.join(TRL_LOSSES)}, got {loss!r}")
    if not items:
        raise ValueError("no items to generate from")
    trl = require_trl()
    from datasets import Dataset

    torch.manual_seed(seed)
    ours = copy.deepcopy(model).train()
    with quiet_trl(), tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "policy")
        to_hf(ours).save_pretrained(path)
        args = trl.GRPOConfig(output_dir=tmp, report_to=[], use_cpu=True, bf16=False,
                              gradient_checkpointing=False, save_strategy="no",
                              per_device_train_batch_size=len(items) * group,
                              num_generations=group, max_completion_length=max_new_tokens,
                              loss_type=loss, beta=beta, epsilon=eps_low, epsilon_high=eps_high,
                              scale_rewards=scale, use_bias_correction_kl=kl_ratio,
                              temperature=1.0, seed=seed)
        data = Dataset.from_list([{"prompt": [{"role": "user", "content": p.prompt}],
                                   "answer": p.answer} for p in items])
        seen: list[float] = []
        trainer = trl.GRPOTrainer(model=path, reward_funcs=_reward_fn(seen), args=args,
                                  train_dataset=data, processing_class=_tokenizer(tok, tmp))
        if beta:
            trainer.ref_model.load_state_dict(to_hf(copy.deepcopy(ref)).state_dict())
        rows = [data[i] for i in range(len(items)) for _ in range(group)]
        batch = trainer._generate_and_score_completions(rows)
        prompt_ids, completion_ids = batch["prompt_ids"], batch["completion_ids"]
        ids = torch.cat([prompt_ids, completion_ids], 1)
        T = completion_ids.shape[1]
        if old is not None:
            with torch.no_grad():
                batch["old_per_token_logps"] = token_logprobs(old, ids)[:, -T:]
        trl_loss = trainer.compute_loss(trainer.model, batch)
        hf = trainer.model
    if not bool(batch["prompt_mask"].all()):
        raise ValueError("the prompts differ in length (trl pads them on the left); use items "
                         "of one width")
    mask = batch["completion_mask"]
    completions = [c[:int(n)].tolist() for c, n in zip(completion_ids, mask.sum(1))]
    texts = [tok.decode(c) for c in completions]
    rep = [p for p in items for _ in range(group)]
    r = rewards(rep, Rollouts([[]] * len(rep), completions, texts))
    adv = group_advantages(torch.tensor(r), group, scale)
    logp = token_logprobs(ours, ids)[:, -T:]
    old_lp = batch.get("old_per_token_logps", logp.detach())
    ref_lp = None
    if beta:
        with torch.no_grad():
            ref_lp = token_logprobs(ref, ids)[:, -T:]
    kind = "dapo" if loss == "bnpo" else loss
    mine = grpo_loss(logp, old_lp, ref_lp, adv, mask, kind, beta, eps_low, eps_high,
                     max_new_tokens)
    mine.backward()
    trl_loss.backward()
    grad = (ours.embed.weight.grad - hf.get_input_embeddings().weight.grad).abs().max().item()
    adv_diff = (adv - batch["advantages"]).abs().max().item()
    return GRPOComparison(mine.item(), trl_loss.item(), grad,
                          ours.embed.weight.grad.abs().max().item(), same_rewards=r == seen,
                          advantage_diff=adv_diff, completions=len(rep))
