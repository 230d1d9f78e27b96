"""Tensor parallelism's communication: a counted process group and the conjugate operators.

`Comm` is the TP group with a tally of every collective by (op, phase, where). The operators
mark the edges of a TP region (Shoeybi et al. 2019, Section 3): `f` is the identity forward and
an all-reduce backward, `g` the reverse; under sequence parallelism (Korthikanti et al. 2022,
Section 4.2) an all-gather of the sequence shards and a reduce-scatter back take their places.
`shard_parameter` and `mark_replicated` say how each parameter is held, for the layers built on
them.

Chapter: book/parallelism/tensor-parallel.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from .. import compat
from ..bench.collectives import bus_factor


@dataclass
class Comm:
    """The TP group (`group`; None: all ranks) and a tally of collectives by (op, phase, where).

    Bytes are those of the full tensor a collective works on (the all-reduce buffer, the
    all-gather's output, the reduce-scatter's input); `wire_bytes` gives what each rank sends.
    """

    tp: int
    rank: int
    sp: bool = False
    counts: dict = field(default_factory=lambda: defaultdict(lambda: [0, 0]))
    group: object = None  # a ProcessGroup (the "tp" dimension of a mesh); None: the default

    def record(self, op: str, phase: str, where: str, t: torch.Tensor) -> None:
        c = self.counts[(op, phase, where)]
        c[0] += 1
        c[1] += t.numel() * t.element_size()

    def all_reduce(self, x: torch.Tensor, phase: str, where: str,
                   op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
        x = x.contiguous().clone()  # gloo: contiguous; clone: never modify a saved tensor
        self.record("all_reduce", phase, where, x)
        dist.all_reduce(x, op=op, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int, phase: str, where: str) -> torch.Tensor:
        """Concatenate every rank's x along dim (each rank holds one contiguous chunk)."""
        x = x.movedim(dim, 0).contiguous()
        out = x.new_empty((self.tp * x.shape[0], *x.shape[1:]))
        self.record("all_gather", phase, where, out)
        compat.all_gather_single(out, x, group=self.group)
        return out.movedim(0, dim).contiguous()  # one copy, shared by every layer that reads it

    def reduce_scatter(self, x: torch.Tensor, dim: int, phase: str,
                       where: str) -> torch.Tensor:
        """Sum x over ranks and keep this rank's chunk along dim."""
        x = x.movedim(dim, 0).contiguous()
        self.record("reduce_scatter", phase, where, x)
        out = x.new_empty((x.shape[0] // self.tp, *x.shape[1:]))
        compat.reduce_scatter_single(out, x, group=self.group)
        return out.movedim(0, dim).contiguous()

    def table(self) -> list[dict]:
        return [{"op": op, "phase": ph, "where": w, "calls": c, "bytes": b}
                for (op, ph, w), (c, b) in sorted(self.counts.items())]


def wire_bytes(op: str, nbytes: float, n: int) -> float:
    """Bytes each rank sends in a ring collective over n ranks on a tensor of nbytes:
    `bench.collectives.bus_factor` x nbytes (2(n-1)/n for all-reduce, (n-1)/n otherwise)."""
    return bus_factor(op, n) * nbytes


# ---------------------------------------------------------------------------------------------
# The conjugate operators: f / g (TP), and their sequence-parallel versions
# ---------------------------------------------------------------------------------------------

class CopyToTP(torch.autograd.Function):
    """f: identity forward; all-reduce backward (each rank holds part of the input gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, where: str) -> torch.Tensor:
        ctx.comm, ctx.where = comm, where
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ctx.comm.all_reduce(grad, "backward", ctx.where), None, None


class ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward (sum the partial outputs); identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, where: str) -> torch.Tensor:
        return comm.all_reduce(x, "forward", where)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


class GatherSequence(torch.autograd.Function):
    """SP entry: all-gather the sequence shards forward; reduce-scatter the gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, where: str) -> torch.Tensor:
        ctx.comm, ctx.where = comm, where
        return comm.all_gather(x, 1, "forward", where)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ctx.comm.reduce_scatter(grad, 1, "backward", ctx.where), None, None


class ScatterSequence(torch.autograd.Function):
    """SP exit: reduce-scatter partial sums to sequence shards forward; all-gather backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, where: str) -> torch.Tensor:
        ctx.comm, ctx.where = comm, where
        return comm.reduce_scatter(x, 1, "forward", where)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ctx.comm.all_gather(grad, 1, "backward", ctx.where), None, None


def enter_tp(x: torch.Tensor, comm: Comm, where: str = "block") -> torch.Tensor:
    """Into a TP region: f (TP), or all-gather the sequence (TP + SP)."""
    return (GatherSequence if comm.sp else CopyToTP).apply(x, comm, where)


def exit_tp(x: torch.Tensor, comm: Comm, where: str = "block") -> torch.Tensor:
    """Out of a TP region: g (TP), or reduce-scatter to sequence shards (TP + SP)."""
    return (ScatterSequence if comm.sp else ReduceFromTP).apply(x, comm, where)


def shard_parameter(t: torch.Tensor, dim: int, comm: Comm) -> nn.Parameter:
    p = nn.Parameter(t.detach().chunk(comm.tp, dim)[comm.rank].clone())
    p.tp_dim = dim  # how full_tensors reassembles it
    return p


def mark_replicated(p: nn.Parameter, comm: Comm) -> nn.Parameter:
    """A parameter every rank holds whole. Under SP it sees only a sequence shard, so its
    gradient is partial and must be all-reduced (`sync_sequence_parallel_grads`)."""
    p.sp_partial = comm.sp
    return p
