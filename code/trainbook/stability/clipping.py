"""Gradient clipping from scratch: the global norm, alone and sharded, against PyTorch's.

`clip_grad_norm` is `torch.nn.utils.clip_grad_norm_` written out: the total norm is the p-norm of
the per-tensor p-norms (for p = 2, the square root of the sum of squares over every element of
every gradient), and every gradient is multiplied by min(1, max_norm / (norm + 1e-6)); it returns
the norm before clipping. `clip_grad_value` clamps each element instead, which changes the
gradient's direction.

Sharded (FSDP2, tensor parallel), each rank holds part of each gradient as a DTensor.
`sharded_grad_norm` sums |g|^p over the local shards and all-reduces it (the max, for the inf
norm), counting a replicated gradient once; with `reduce=False` it is the classic bug, each rank
clipping by the norm of what it holds. `sharded_rank` runs both on two ranks (FSDP2 and DTensor
TP) against the single-process model, `clip_grad_norm_` on the DTensors and the trainer's
`train.parallelize.clip_grad_norm_`.

Chapter: book/stability/clipping.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from ..configs import ModelConfig
from ..model import Transformer

CLIP_EPS = 1e-6  # clip_grad_norm_: coefficient = max_norm / (total_norm + 1e-6), at most 1
TORCH_DEFAULTS = {"norm_type": 2.0, "error_if_nonfinite": False, "foreach": None}


def _norm_type(norm_type: float) -> float:
    p = float(norm_type)
    if not (p > 0 or p == math.inf):
        raise ValueError(f"norm_type must be > 0 or inf (2.0: the Euclidean norm), got {norm_type}")
    return p


def _grads(params: Iterable[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    return [p.grad for p in params if p.grad is not None]


def grad_norm(grads: list[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The total norm as clip_grad_norm_ computes it: the p-norm of each gradient, then the
    p-norm of those norms (= the p-norm of all elements as one vector). Empty: 0."""
    p = _norm_type(norm_type)
    if not grads:
        return torch.tensor(0.0)
    norms = [torch.linalg.vector_norm(g, p) for g in grads]
    return torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), p)


def flat_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """sqrt(sum of g^2 over every element), summed in one go: the textbook formula, which equals
    `grad_norm` up to the rounding of a different summation order."""
    if not grads:
        return torch.tensor(0.0)
    return torch.cat([g.reshape(-1) for g in grads]).pow(2).sum().sqrt()


def clip_coef(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """min(1, max_norm / (total_norm + 1e-6)): a tensor, so no host synchronisation on a GPU."""
    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0 (1.0 is the usual LLM setting), got {max_norm}")
    return torch.clamp(max_norm / (total_norm + CLIP_EPS), max=1.0)


@torch.no_grad()
def clip_grad_norm(params: Iterable[torch.Tensor] | torch.Tensor, max_norm: float,
                   norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale every gradient by clip_coef(total norm, max_norm) in place; returns the total norm
    before clipping, as torch.nn.utils.clip_grad_norm_. A non-finite norm scales the gradients
    by NaN (everything becomes NaN) unless error_if_nonfinite raises first."""
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    grads = _grads(params)
    total = grad_norm(grads, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite "
                           f"({total.item()}), so it cannot be clipped")
    coef = clip_coef(total, max_norm)
    for g in grads:
        g.mul_(coef.to(g.device))
    return total


@torch.no_grad()
def clip_grad_value(params: Iterable[torch.Tensor] | torch.Tensor, clip_value: float) -> None:
    """Clamp every gradient element to [-clip_value, clip_value] in place
    (torch.nn.utils.clip_grad_value_): large elements shrink, small ones do not, so the
    direction of the gradient changes."""
    if not clip_value > 0:
        raise ValueError(f"clip_value must be > 0, got {clip_value}")
    for g in _grads(params):
        g.clamp_(-clip_value, clip_value)


def cosine(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Cosine of the angle between two lists of tensors, each read as one vector."""
    if len(a) != len(b) or not a:
        raise ValueError(f"need two equally long, non-empty lists of tensors, got {len(a)}, "
                         f"{len(b)}")
    x = torch.cat([t.reshape(-1).double() for t in a])
    y = torch.cat([t.reshape(-1).double() for t in b])
    return float(x @ y / (x.norm() * y.norm()).clamp(min=1e-300))


def _local(g: torch.Tensor) -> tuple[torch.Tensor, str]:
    """The values this rank holds of a gradient and what they are: "shard" (FSDP, TP
    weights), "replicate" (every rank holds all of it: a plain tensor, or a replicated DTensor)
    or "partial" (a DTensor whose ranks hold partial sums, reduced when first used: the
    gradients of norm weights under sequence parallelism). 1-D meshes only."""
    from torch.distributed.tensor import DTensor

    if not isinstance(g, DTensor):
        return g, "replicate"
    if g.device_mesh.ndim != 1:
        raise ValueError("sharded_grad_norm handles DTensors on a 1-D mesh; for 2-D meshes "
                         "(FSDP x TP) use torch.nn.utils.clip_grad_norm_")
    kind = "partial" if any(pl.is_partial() for pl in g.placements) else \
        "shard" if any(pl.is_shard() for pl in g.placements) else "replicate"
    return g.to_local(), kind


def _group(grads: list[torch.Tensor]) -> dist.ProcessGroup | None:
    from torch.distributed.tensor import DTensor

    mesh = next((g.device_mesh for g in grads if isinstance(g, DTensor)), None)
    return mesh.get_group() if mesh is not None else None


@torch.no_grad()
def sharded_grad_norm(grads: list[torch.Tensor], norm_type: float = 2.0,
                      reduce: bool = True) -> torch.Tensor:
    """The global norm when each rank holds shards: sum |g|^p over the local shards, all-reduce
    the sum over the mesh (each replicated gradient counted once, on rank 0), then the p-th root;
    for the inf norm, all-reduce the local maxima. reduce=False returns what this rank alone
    sees: the bug that makes every rank clip by a different coefficient."""
    p = _norm_type(norm_type)
    if not grads:
        return torch.tensor(0.0)
    group = _group(grads)
    first = dist.get_rank(group) == 0 if dist.is_initialized() else True
    shard_part = replica_part = torch.zeros((), dtype=torch.float32)
    for g in grads:
        values, kind = _local(g)
        if kind == "partial" and reduce:  # sum the partial values first (a collective)
            values, kind = g.full_tensor(), "replicate"
        part = values.detach().float().abs()
        part = part.max() if p == math.inf else part.pow(p).sum()
        if p == math.inf:
            shard_part = torch.maximum(shard_part, part.cpu())
        elif kind == "shard":
            shard_part = shard_part + part.cpu()
        else:
            replica_part = replica_part + part.cpu()
    device = grads[0].device
    if p == math.inf:
        total = shard_part.to(device)
        if reduce and dist.is_initialized():
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        return total
    if not reduce or not dist.is_initialized():
        return (shard_part + replica_part).to(device) ** (1 / p)
    total = (shard_part + (replica_part if first else 0.0)).to(device)
    dist.all_reduce(total, group=group)
    return total ** (1 / p)


@torch.no_grad()
def sharded_clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float,
                           norm_type: float = 2.0, reduce: bool = True) -> torch.Tensor:
    """Clip sharded gradients by their global norm (`sharded_grad_norm`), scaling each rank's
    local values in place; returns the norm used (per rank with reduce=False)."""
    grads = _grads(params)
    total = sharded_grad_norm(grads, norm_type, reduce)
    coef = clip_coef(total, max_norm)
    for g in grads:
        _local(g)[0].mul_(coef.to(g.device))
    return total


def kinds(model: nn.Module) -> dict[str, str]:
    """Each parameter's gradient kind on this rank: shard, replicate or partial."""
    return {n: _local(p.grad)[1] for n, p in model.named_parameters() if p.grad is not None}


def _full(g: torch.Tensor) -> torch.Tensor:
    return g.full_tensor() if hasattr(g, "full_tensor") else g


def _reference(model: Transformer, x: torch.Tensor, y: torch.Tensor,
               max_norm: float) -> tuple[dict, dict[str, torch.Tensor]]:
    """Norms and clipped gradients of one process holding the whole model and batch."""
    ref = copy.deepcopy(model)
    ref(x, y)[1].backward()
    grads = _grads(ref.parameters())
    norms = {"2": grad_norm(grads, 2.0).item(), "inf": grad_norm(grads, math.inf).item()}
    clip_grad_norm(ref.parameters(), max_norm)
    return norms, {n: p.grad.clone() for n, p in ref.named_parameters()}


def _compare(model: nn.Module, params: list[nn.Parameter], saved: list[torch.Tensor],
             clipped: dict[str, torch.Tensor], clip) -> float:
    """Clip with `clip(params)`, then the largest difference of the gathered gradients from the
    single-process clipped ones; the local gradients are restored afterwards."""
    clip(params)
    diff = max((_full(p.grad) - clipped[n]).abs().max().item()
               for n, p in model.named_parameters())
    for p, s in zip(params, saved):
        _local(p.grad)[0].copy_(s)
    return diff


def _measure(model: nn.Module, max_norm: float, clipped: dict[str, torch.Tensor]) -> dict:
    """Every way of computing the norm and of clipping, on this rank's sharded gradients."""
    from ..train import parallelize as par

    params = list(model.parameters())
    grads = _grads(params)
    saved = [_local(g)[0].clone() for g in grads]
    out: dict = {}
    for name, p in (("2", 2.0), ("inf", math.inf)):
        out[f"scratch_{name}"] = sharded_grad_norm(grads, p).item()
        out[f"local_{name}"] = sharded_grad_norm(grads, p, reduce=False).item()
        out[f"native_{name}"] = _full(torch.nn.utils.get_total_norm(grads, p)).item()
    out["coef_local"] = clip_coef(torch.tensor(out["local_2"]), max_norm).item()
    out["diff_scratch"] = _compare(model, params, saved, clipped,
                                   lambda ps: sharded_clip_grad_norm(ps, max_norm))
    out["diff_native"] = _compare(model, params, saved, clipped,
                                  lambda ps: torch.nn.utils.clip_grad_norm_(ps, max_norm))
    out["diff_trainer"] = _compare(model, params, saved, clipped,
                                   lambda ps: par.clip_grad_norm_(ps, max_norm))
    out["diff_local"] = _compare(model, params, saved, clipped,
                                 lambda ps: sharded_clip_grad_norm(ps, max_norm, reduce=False))
    return out


def _replica_gap(model: nn.Module, max_norm: float, reduce: bool, lr: float = 0.1) -> float:
    """One SGD step after clipping (reduced or per-rank norm): the largest difference between
    the ranks' copies of the replicated parameters (norm weights under TP). 0: still replicas."""
    from torch.distributed.tensor import DTensor

    before = {n: _local(p.detach())[0].clone() for n, p in model.named_parameters()}
    grads = {n: _local(p.grad)[0].clone() for n, p in model.named_parameters()}
    sharded_clip_grad_norm(model.parameters(), max_norm, reduce=reduce)
    torch.optim.SGD(model.parameters(), lr=lr).step()  # DTensor-aware: reduces partial grads
    gap = torch.zeros(())
    for p in model.parameters():
        if not isinstance(p, DTensor) or all(pl.is_replicate() for pl in p.placements):
            mine = _local(p.detach())[0].clone()
            other = mine.clone()
            dist.broadcast(other, src=0)
            gap = torch.maximum(gap, (mine - other).abs().max())
    with torch.no_grad():
        for n, p in model.named_parameters():
            _local(p)[0].copy_(before[n])
            _local(p.grad)[0].copy_(grads[n])
    dist.all_reduce(gap, op=dist.ReduceOp.MAX)
    return gap.item()


def sharded_rank(mcfg: ModelConfig, batch: tuple[torch.Tensor, torch.Tensor],
                 max_norm: float, seed: int = 0) -> dict:
    """Run on every rank of a process group (trainbook.launch.run): the same model under FSDP2
    (each rank half the batch) and under DTensor tensor parallelism with sequence parallelism
    (the whole batch), every norm and clip of `_measure` against one process with the whole
    model, and how far the TP ranks' replicated weights drift after a step clipped per rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    from ..train.parallelize import tp_plan

    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = batch
    if len(x) % world:
        raise ValueError(f"a batch of {len(x)} sequences does not split over {world} ranks")
    torch.manual_seed(seed)
    model = Transformer(mcfg)
    norms, clipped = _reference(model, x, y, max_norm)
    mesh = init_device_mesh("cpu", (world,))

    fsdp = copy.deepcopy(model)
    for block in fsdp.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    fsdp(x.chunk(world)[rank], y.chunk(world)[rank])[1].backward()  # mean of equal halves
    out = {"rank": rank, "reference": norms, "fsdp": _measure(fsdp, max_norm, clipped)}

    tp = copy.deepcopy(model)
    parallelize_module(tp, mesh, tp_plan(tp, sp=True, loss_parallel=False))
    tp(x, y)[1].backward()
    out["tp_kinds"] = kinds(tp)
    out["tp"] = _measure(tp, max_norm, clipped)
    out["tp"]["replica_gap_reduced"] = _replica_gap(tp, max_norm, reduce=True)
    out["tp"]["replica_gap_local"] = _replica_gap(tp, max_norm, reduce=False)
    plain = copy.deepcopy(model)  # TP without SP: norm weights are plain replicated tensors
    parallelize_module(plain, mesh, tp_plan(plain, sp=False, loss_parallel=False))
    plain(x, y)[1].backward()
    out["tp_no_sp"] = {"kinds": kinds(plain),
                       "replica_gap_reduced": _replica_gap(plain, max_norm, reduce=True),
                       "replica_gap_local": _replica_gap(plain, max_norm, reduce=False)}
    return out
