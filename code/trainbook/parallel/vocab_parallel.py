"""Vocabulary parallelism: the embedding and the cross-entropy split by vocabulary over TP ranks.

The embedding keeps V / tp rows per rank and sums the partial lookups; the loss never gathers
the (tokens, V) logits: the max, the sum of exponentials and the target logit are each
all-reduced, one number per token (Megatron-LM's vocabulary-parallel cross-entropy).
`emulate_vocab_parallel_cross_entropy` does the same arithmetic in one process.

Chapter: book/parallelism/tensor-parallel.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .tp_comm import Comm, exit_tp, shard_parameter


class VocabParallelEmbedding(nn.Module):
    """Each rank holds V / tp rows; ids outside its range look up zeros; the partial
    embeddings are summed (all-reduce), or reduce-scattered to sequence shards under SP."""

    def __init__(self, embed: nn.Embedding, comm: Comm):
        super().__init__()
        self.comm = comm
        self.weight = shard_parameter(embed.weight, 0, comm)
        self.start = comm.rank * self.weight.shape[0]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        local = idx - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return exit_tp(out * inside.unsqueeze(-1), self.comm, "embed")


def _local_max(logits):
    return logits.max(dim=-1).values


def _local_sum_exp(logits, gmax):
    return (logits - gmax.unsqueeze(-1)).exp().sum(dim=-1)


def _local_target_logit(logits, targets, start):
    local = targets - start
    inside = (local >= 0) & (local < logits.shape[-1])
    picked = logits.gather(-1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    return picked * inside, local, inside


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of logits split by vocabulary, (N, V/tp) per rank, without gathering
    them: loss = log sum_v exp(z_v - m) + m - z_target, where the max m, the sum and z_target
    are each all-reduced. Backward is local: softmax minus one-hot, on this rank's columns."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, comm: Comm,
                start: int) -> torch.Tensor:
        logits = logits.float()
        gmax = comm.all_reduce(_local_max(logits), "forward", "loss", op=dist.ReduceOp.MAX)
        total = comm.all_reduce(_local_sum_exp(logits, gmax), "forward", "loss")
        picked, local, inside = _local_target_logit(logits, targets, start)
        target = comm.all_reduce(picked, "forward", "loss")
        softmax = (logits - gmax.unsqueeze(-1)).exp() / total.unsqueeze(-1)
        ctx.save_for_backward(softmax, local.clamp(0, logits.shape[-1] - 1), inside)
        return (total.log() + gmax - target).mean()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, local, inside = ctx.saved_tensors
        g = softmax.clone()
        g[torch.arange(len(g)), local] -= inside.to(g.dtype)
        return g * (grad / len(g)), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, comm: Comm,
                                 start: int) -> torch.Tensor:
    return VocabParallelCrossEntropy.apply(logits, targets, comm, start)


def emulate_vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                                         tp: int) -> torch.Tensor:
    """The same arithmetic in one process: split (N, V) logits into tp vocabulary shards, run each
    rank's local step, and combine as the all-reduces would. Equals F.cross_entropy."""
    if logits.dim() != 2 or logits.shape[-1] % tp:
        raise ValueError(f"need (N, V) logits with V divisible by tp {tp}, "
                         f"got {tuple(logits.shape)}")
    shards = logits.float().chunk(tp, dim=-1)
    starts = [i * shards[0].shape[-1] for i in range(tp)]
    gmax = torch.stack([_local_max(s) for s in shards]).max(0).values
    total = torch.stack([_local_sum_exp(s, gmax) for s in shards]).sum(0)
    target = torch.stack([_local_target_logit(s, targets, a)[0]
                          for s, a in zip(shards, starts)]).sum(0)
    return (total.log() + gmax - target).mean()


def cross_entropy_rank(logits: torch.Tensor, targets: torch.Tensor,
                       group: dist.ProcessGroup | None = None) -> tuple[float, torch.Tensor]:
    """Run on every rank of `group` (default: all) with the same full (N, V) logits: this rank
    keeps its V / tp columns, computes the vocabulary-parallel loss and its gradient. Returns
    (loss, gradient shard), to check against F.cross_entropy (tests and notebook)."""
    if not dist.is_initialized():
        raise ValueError("cross_entropy_rank runs inside a process group (launch.run)")
    comm = Comm(dist.get_world_size(group), dist.get_rank(group), group=group)
    if logits.dim() != 2 or logits.shape[-1] % comm.tp:
        raise ValueError(f"need (N, V) logits with V divisible by tp {comm.tp}, "
                         f"got {tuple(logits.shape)}")
    local = logits.chunk(comm.tp, dim=-1)[comm.rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, targets, comm, comm.rank * local.shape[-1])
    loss.backward()
    return loss.item(), local.grad
