"""One name for each torch.distributed API that torch renamed within the versions trainbook
supports, so the same code runs on the floor version and on the pinned one.

torch 2.13 renamed `all_gather_into_tensor` to `all_gather_single`, `reduce_scatter_tensor` to
`reduce_scatter_single` and `all_gather_tensor_autograd` to `all_gather_single_autograd`, and
deprecated the old names with a FutureWarning (which a notebook would print). Each function here
calls the new name where it exists and the old one before.

Chapter: book/parallelism/collectives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as fc


def all_gather_single(output: torch.Tensor, input: torch.Tensor,
                      group: dist.ProcessGroup | None = None, async_op: bool = False) -> object:
    """`dist.all_gather_single` (torch >= 2.13), else `dist.all_gather_into_tensor`."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor,
                          op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                          group: dist.ProcessGroup | None = None,
                          async_op: bool = False) -> object:
    """`dist.reduce_scatter_single` (torch >= 2.13), else `dist.reduce_scatter_tensor`."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, op=op, group=group, async_op=async_op)


def all_gather_autograd(x: torch.Tensor, gather_dim: int,
                        group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Autograd-aware all-gather along `gather_dim` (its backward is a reduce-scatter), waited
    on: `all_gather_single_autograd` (torch >= 2.13), else `all_gather_tensor_autograd`."""
    fn = getattr(fc, "all_gather_single_autograd", None) or fc.all_gather_tensor_autograd
    return fc.wait_tensor(fn(x, gather_dim=gather_dim, group=group))
