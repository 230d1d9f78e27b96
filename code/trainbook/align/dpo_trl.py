"""The from-scratch DPO, IPO and SimPO losses against trl's, on the same weights and batch.

`compare_dpo` exports the policy and the reference (`bench.hf.to_hf`: the same weights and
logits in `LlamaForCausalLM`), builds a `trl.DPOTrainer` on them with the chat tokenizer
(`ChatTokenizer.save_pretrained`) and the pairs as a conversational dataset
(`reward_trl.preference_dataset`), lets trl tokenize and collate them, calls its
`compute_loss` on that batch, and compares: the token ids and completion mask with
`dpo.pair_batch`, the loss with `dpo.preference_loss`, the implicit rewards trl logs
(`rewards/chosen`, `rewards/rejected`) and the gradient of the embedding after one backward
pass. trl's DPO loss types "sigmoid" (the paper's) and "ipo" are compared; SimPO lives in trl's
experimental `CPOTrainer` (`loss_type="simpo"`, `cpo_alpha=0` to drop CPO's NLL term), whose
own `concatenated_forward` and `cpo_loss` `compare_simpo` calls on the same pairs.

Chapter: book/alignment/dpo
"""

from __future__ import annotations

import contextlib
import copy
import logging
import tempfile
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..bench.hf import to_hf
from .dpo import DPOConfig, pair_batch, pair_logprobs, preference_loss
from .lora_check import quiet
from .preferences import Pair
from .reward_trl import preference_dataset, require_trl
from .task import ChatTokenizer


@dataclass
class Comparison:
    """Ours against a trl loss on one batch: both losses, the largest difference of the
    embedding's gradient, and the largest entry of ours (the scale the difference is relative
    to)."""

    ours_loss: float
    trl_loss: float
    grad_diff: float
    grad_max: float

    @property
    def loss_diff(self) -> float:
        return abs(self.ours_loss - self.trl_loss)

    @property
    def grad_rel(self) -> float:
        """The gradient difference relative to the gradient's largest entry."""
        return self.grad_diff / max(self.grad_max, 1e-30)


@dataclass
class LossComparison(Comparison):
    """A `Comparison` of a preference loss, with whether the token ids (and completion masks)
    are identical and the largest difference of the implicit rewards."""

    same_ids: bool = False
    reward_diff: float = float("nan")


@contextlib.contextmanager
def quiet_trl() -> contextlib.AbstractContextManager:
    """`lora_check.quiet` (transformers' logs, transformers' and datasets' bars, deprecation
    warnings) plus trl's own warnings."""
    log = logging.getLogger("trl")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with quiet(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        log.setLevel(level)


def _common_args(folder: str, batch: int) -> dict:
    return dict(output_dir=folder, report_to=[], use_cpu=True, bf16=False,
                gradient_checkpointing=False, per_device_train_batch_size=batch,
                save_strategy="no")


def _tokenizer(tok: ChatTokenizer, folder: str):
    from transformers import AutoTokenizer

    tok.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


def _embed_grad(model: nn.Module) -> torch.Tensor:
    return model.get_input_embeddings().weight.grad if hasattr(model, "get_input_embeddings") \
        else model.embed.weight.grad


def compare_dpo(model: nn.Module, ref: nn.Module, tok: ChatTokenizer, pairs: Sequence[Pair],
                loss: str = "sigmoid", beta: float = 0.1) -> LossComparison:
    """trl's DPOTrainer loss (`loss_type` "sigmoid" or "ipo") against ours on the same pairs
    and weights; neither model is changed."""
    if loss not in ("sigmoid", "ipo"):
        raise ValueError(f"loss must be 'sigmoid' or 'ipo' (DPOTrainer's; SimPO: compare_simpo),"
                         f" got {loss!r}")
    if not pairs:
        raise ValueError("no preference pairs to compare on")
    cfg = DPOConfig(loss=loss, beta=beta)
    trl = require_trl()
    ours, ours_ref = copy.deepcopy(model).train(), copy.deepcopy(ref).eval()
    with quiet_trl(), tempfile.TemporaryDirectory() as tmp:
        hf, hf_ref = to_hf(ours), to_hf(ours_ref).eval()
        args = trl.DPOConfig(beta=beta, loss_type=[loss], **_common_args(tmp, len(pairs)))
        trainer = trl.DPOTrainer(model=hf, ref_model=hf_ref, args=args,
                                 train_dataset=preference_dataset(pairs),
                                 processing_class=_tokenizer(tok, tmp))
        data = trainer.train_dataset
        batch = trainer.data_collator([data[i] for i in range(len(data))])
        trl_loss = trainer.compute_loss(trainer.model, dict(batch))
        logged = trainer._metrics["train"]
    ids, mask = pair_batch(tok, pairs)
    same = batch["input_ids"].shape == ids.shape and bool((batch["input_ids"] == ids).all()) \
        and bool((batch["completion_mask"] == mask).all())
    pi = pair_logprobs(ours, ids, mask)
    with torch.no_grad():
        rf = pair_logprobs(ours_ref, ids, mask)
    mine = preference_loss(cfg, pi, rf)
    rc = beta * (pi["chosen"] - rf["chosen"]).mean().item()
    rr = beta * (pi["rejected"] - rf["rejected"]).mean().item()
    reward_diff = max(abs(rc - logged["rewards/chosen"][-1]),
                      abs(rr - logged["rewards/rejected"][-1]))
    mine.backward()
    trl_loss.backward()
    grad = (_embed_grad(ours) - _embed_grad(hf)).abs().max().item()
    return LossComparison(mine.item(), trl_loss.item(), grad, _embed_grad(ours).abs().max().item(),
                          same_ids=same, reward_diff=reward_diff)


def compare_simpo(model: nn.Module, tok: ChatTokenizer, pairs: Sequence[Pair],
                  beta: float = 2.0, gamma: float = 0.5) -> LossComparison:
    """trl's CPOTrainer with loss_type "simpo" and cpo_alpha 0 against ours on the same pairs
    (SimPO has no reference model): its `concatenated_forward` and `cpo_loss` on trl's batch."""
    if not pairs:
        raise ValueError("no preference pairs to compare on")
    cfg = DPOConfig(loss="simpo", beta=beta, gamma=gamma)
    trl = require_trl()
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    del trl
    ours = copy.deepcopy(model).train()
    with quiet_trl(), tempfile.TemporaryDirectory() as tmp:
        hf = to_hf(ours)
        args = CPOConfig(beta=beta, loss_type="simpo", simpo_gamma=gamma, cpo_alpha=0.0,
                         remove_unused_columns=False, **_common_args(tmp, len(pairs)))
        trainer = CPOTrainer(model=hf, args=args, train_dataset=preference_dataset(pairs),
                             processing_class=_tokenizer(tok, tmp))
        data = trainer.train_dataset
        batch = trainer.data_collator([data[i] for i in range(len(data))])
        out = trainer.concatenated_forward(trainer.model, batch)
        losses, chosen_r, rejected_r = trainer.cpo_loss(out[0], out[1])
        trl_loss = losses.mean()
    ids, mask = pair_batch(tok, pairs)
    trl_rows = [*batch["chosen_input_ids"], *batch["rejected_input_ids"]]
    same = len(trl_rows) == ids.shape[0] and \
        all(a[a != tok.pad_id].tolist() == b[b != tok.pad_id].tolist()
            for a, b in zip(trl_rows, ids))
    pi = pair_logprobs(ours, ids, mask)
    mine = preference_loss(cfg, pi, None)
    rc, rr = beta * pi["chosen"] / pi["n_chosen"], beta * pi["rejected"] / pi["n_rejected"]
    reward_diff = max((rc - chosen_r).abs().max().item(), (rr - rejected_r).abs().max().item())
    mine.backward()
    trl_loss.backward()
    grad = (_embed_grad(ours) - _embed_grad(hf)).abs().max().item()
    return LossComparison(mine.item(), trl_loss.item(), grad, _embed_grad(ours).abs().max().item(),
                          same_ids=same, reward_diff=reward_diff)
