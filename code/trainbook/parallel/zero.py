"""ZeRO from scratch: shard the optimizer state (stage 1), the gradients (2) and the parameters (3).

Data parallelism replicates all model states on every rank: with AdamW in fp32, 4 bytes of
weights, 4 of gradients and 8 of optimizer state per parameter, 16 bytes in all. ZeRO
(Rajbhandari et al. 2020) keeps the same computation and removes the redundancy: each of the n
ranks owns 1/n of the states and the collectives move the rest in when it is needed.

The layout is FSDP's. The parameters of each *unit* (a transformer block, and the root: what is
left, here embedding, final norm and head) are copied into one flat fp32 buffer, padded to a
multiple of n, and the module's parameters become views into it. Rank r owns the contiguous slice
[r k, (r + 1) k), k = padded / n, of every unit, and builds its optimizer on those slices only.

- Stage 1: backward fills full gradients as usual; before the update each unit's gradient is
  reduce-scattered, so rank r receives the average of its slice, updates it, and the updated
  slices are all-gathered back into the full buffers.
- Stage 2: the same collectives, but each unit's gradient is reduce-scattered the moment backward
  has produced it, and the full gradient is freed: only 1/n of the gradients outlives the unit.
- Stage 3: the full buffers exist only while a unit computes. A forward pre-hook all-gathers the
  unit, a forward hook frees it, a hook on the unit's output gradient all-gathers it again for
  backward, and after the reduce-scatter it is freed again. Freeing resizes the buffer's storage
  to zero, so every view of it (the parameters, and the transposed weights autograd saved)
  releases its memory and comes back, refilled, with the next all-gather.

Communication per step, in units of the model's size (Psi elements): stages 1 and 2 send a
reduce-scatter and an all-gather, 2 Psi, exactly what data parallelism's all-reduce costs; stage 3
all-gathers twice (forward and backward), 3 Psi. The counters record each collective's full
(unsharded) size; a ring sends (n - 1) / n of it from every rank (`wire_bytes`).

Chapter: book/parallelism/zero-fsdp.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from .. import compat
from ..bench.collectives import bus_factor
from . import harness

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from ..compute.memory import MemoryBreakdown

STAGES = {"zero1": 1, "zero2": 2, "zero3": 3}
KINDS = ("ddp", "zero1", "zero2", "zero3", "zero_redundancy_optimizer", "fsdp2")


class FlatUnit:
    """One unit's parameters in a flat buffer padded to a multiple of the world size."""

    def __init__(self, named: list[tuple[str, nn.Parameter]], rank: int, world: int, stage: int,
                 counters: dict, group: dist.ProcessGroup | None = None):
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        self.world, self.stage, self.counters, self.group = world, stage, counters, group
        self.numel = sum(p.numel() for p in self.params)
        self.padded = -(-self.numel // world) * world
        self.k = self.padded // world
        self.full = torch.zeros(self.padded, dtype=self.params[0].dtype,
                                device=self.params[0].device)
        self.offsets, offset = {}, 0
        for p in self.params:  # parameters become views of the flat buffer
            self.full[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
            p.data = self.full[offset:offset + p.numel()].view_as(p)
            self.offsets[p], offset = offset, offset + p.numel()
        self.grad_flat: torch.Tensor | None = None  # filled during backward (stages 2-3)
        mine = self.full[rank * self.k:(rank + 1) * self.k]
        # stages 1-2: the shard is a view (the update lands in the full buffer); stage 3: a copy
        self.shard = nn.Parameter(mine if stage < 3 else mine.clone())
        self.pending = 0  # gradients of this unit not yet produced in this backward
        if stage == 3:
            self.free()

    @property
    def gathered(self) -> bool:
        return self.full.untyped_storage().size() > 0

    def free(self) -> None:
        """Release the full parameters; the views keep their shapes and point at no memory."""
        self.full.untyped_storage().resize_(0)

    def gather(self) -> None:
        """All-gather every rank's slice into the full buffer (stage 3 re-allocates it first)."""
        if self.stage == 3:
            if self.gathered:
                return
            self.full.untyped_storage().resize_(self.padded * self.full.element_size())
        # the input must not alias the output
        compat.all_gather_single(self.full, self.shard.detach().clone(), group=self.group)
        self.counters["all_gather"] += self.padded * self.full.element_size()
        self.counters["calls"] += 1

    def take_gradient(self, p: nn.Parameter) -> None:
        """Move p's gradient into the unit's flat gradient buffer (what DDP's buckets and FSDP
        do), so the reduce-scatter needs no second copy of the unit's gradients."""
        if self.grad_flat is None:
            self.grad_flat = torch.zeros_like(self.full)
        offset = self.offsets[p]
        self.grad_flat[offset:offset + p.numel()].copy_(p.grad.reshape(-1))
        p.grad = None

    def reduce_gradients(self) -> None:
        """Reduce-scatter the unit's gradient: this rank keeps the average of its slice only."""
        for p in self.params:
            if p.grad is not None:
                self.take_gradient(p)
        if self.grad_flat is None:
            return  # already reduced
        flat, self.grad_flat = self.grad_flat, None
        mine = flat.new_empty(self.k)
        compat.reduce_scatter_single(mine, flat, op=dist.ReduceOp.SUM, group=self.group)
        self.counters["reduce_scatter"] += flat.numel() * flat.element_size()
        self.counters["calls"] += 1
        del flat  # the full gradient is not needed any more
        mine /= self.world  # sum -> mean: each rank's loss is a mean over its micro-batch
        self.shard.grad = mine if self.shard.grad is None else self.shard.grad + mine


class ZeRO(nn.Module):
    """Wrap `module` for ZeRO stage 1, 2 or 3 over the ranks of `group` (default: all ranks).

    `units` are the submodules sharded (and, at stage 3, gathered) as one flat buffer each; the
    parameters outside them form the root unit. Use it like a model plus optimizer:
    `loss = zero(x, y)[1]; loss.backward(); zero.step(); zero.zero_grad()`. Every rank must
    start from the same weights (here: the same seeded construction).
    """

    def __init__(self, module: nn.Module, stage: int,
                 make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                 units: list[nn.Module] | None = None, group: dist.ProcessGroup | None = None):
        super().__init__()
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage!r}")
        if not dist.is_initialized():
            raise ValueError("ZeRO needs a process group: run under torchrun or "
                             "trainbook.launch.run")
        self.module, self.stage = module, stage
        units = units if units is not None else getattr(module, "blocks", [])
        self.units_modules = [m for m in units if any(True for _ in m.parameters())]
        self.group = group
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        self.counters = {"all_gather": 0, "reduce_scatter": 0, "calls": 0}
        name_of = {p: n for n, p in module.named_parameters()}
        inside = {p for m in self.units_modules for p in m.parameters()}
        groups = [[(name_of[p], p) for p in m.parameters()] for m in self.units_modules]
        rest = [(n, p) for n, p in module.named_parameters() if p not in inside]
        self.units = [FlatUnit(g, rank, world, stage, self.counters, group)
                      for g in groups + [rest] if g]
        self.root = self.units[-1] if rest else None  # embedding, final norm, head
        self.shards = nn.ParameterList(u.shard for u in self.units)  # what this rank owns
        self.optimizer = make_optimizer(list(self.shards))
        if stage >= 2:  # reduce each unit as soon as backward has produced all its gradients
            for u in self.units:
                for p in u.params:
                    p.register_post_accumulate_grad_hook(partial(self._grad_ready, u))
        if stage == 3:
            for m, u in zip(self.units_modules, self.units):
                m.register_forward_pre_hook(partial(self._before_forward, u))
                m.register_forward_hook(partial(self._after_forward, u))
            if self.root is not None:
                module.register_forward_pre_hook(partial(self._before_forward, self.root))
                module.register_forward_hook(partial(self._after_forward, self.root))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    # stage 3: parameters exist only around the unit's forward and backward
    def _before_forward(self, unit: FlatUnit, module, args) -> None:
        unit.gather()

    def _after_forward(self, unit: FlatUnit, module, args, output) -> None:
        unit.free()
        out = output[0] if isinstance(output, tuple) else output  # the model returns (logits, loss)
        if torch.is_grad_enabled() and out.requires_grad:
            out.register_hook(lambda grad: unit.gather())  # runs before the unit's backward

    # stages 2 and 3: reduce a unit's gradients once all of them exist
    def _grad_ready(self, unit: FlatUnit, p: nn.Parameter) -> None:
        if unit.pending == 0:
            unit.pending = len(unit.params)
        unit.pending -= 1
        unit.take_gradient(p)
        if unit.pending == 0:
            unit.reduce_gradients()
            if self.stage == 3:
                unit.free()

    def reduce_gradients(self) -> None:
        """Stage 1 reduces here, all at once; stages 2-3 already did during backward."""
        stuck = [u.names[0] for u in self.units if u.pending]
        if stuck:
            raise ValueError(f"backward left units starting at {stuck} without all their "
                             "gradients; every parameter must take part in the loss")
        for u in self.units:
            u.reduce_gradients()

    def step(self) -> None:
        """Update this rank's slices; stages 1-2 all-gather them back into the full buffers."""
        self.reduce_gradients()
        self.optimizer.step()
        if self.stage < 3:
            for u in self.units:
                u.gather()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def full_tensors(self, what: str = "param") -> dict[str, torch.Tensor]:
        """Full parameters ('param') or averaged gradients ('grad') by name, gathered from every
        rank's shard for checking (not counted as training traffic)."""
        if what not in ("param", "grad"):
            raise ValueError(f"what must be 'param' or 'grad', got {what!r}")
        out = {}
        for u in self.units:
            src = u.shard.detach() if what == "param" else u.shard.grad
            if src is None:
                raise ValueError("no gradients yet: call backward (and reduce_gradients) first")
            full = src.new_empty(u.padded)
            compat.all_gather_single(full, src.contiguous(), group=self.group)
            offset = 0
            for n, p in zip(u.names, u.params):
                out[n] = full[offset:offset + p.numel()].view(p.shape).clone()
                offset += p.numel()
        return out


def wire_bytes(collective_bytes: float, world: int) -> float:
    """Bytes each rank sends in a ring reduce-scatter or all-gather of a tensor of this size:
    `bench.collectives.bus_factor` ((world - 1) / world) x the size."""
    return bus_factor("all_gather", world) * collective_bytes


def paper_bytes(result: harness.Result) -> dict[str, float]:
    """Bytes per step by collective in the ZeRO paper's convention (Section 7): full tensor
    sizes, an all-reduce counted twice (it is a reduce-scatter and an all-gather). Every step
    of these runs is alike, so the first step's counts (`harness.CommCounter`) are per step."""
    out: dict[str, float] = {}
    for phase in result.bytes.values():
        for op, b in phase.items():
            out[op] = out.get(op, 0) + (2 * b if op == "all_reduce" else b)
    return out


def calls_per_step(result: harness.Result, op: str) -> int:
    """How many `op` collectives one step issues (both phases of the first step)."""
    return sum(phase.get(op, 0) for phase in result.calls.values())


# ---------------------------------------------------------------------------------------------
# One technique for every implementation: from scratch and PyTorch's
# ---------------------------------------------------------------------------------------------

@dataclass(kw_only=True)
class ZeroRun(harness.Technique):
    """Each rank trains on its shard of every global batch with `kind` (see KINDS): the
    from-scratch stages, DDP, `ZeroRedundancyOptimizer` or FSDP2 (`reshard_after_forward`,
    bf16 `mixed_precision` with fp32 reduction). Stats: the scratch stages' own counters per
    step, and the elements this rank's ZeroRedundancyOptimizer owns."""

    kind: str = "zero1"
    reshard_after_forward: bool | int = True
    mixed_precision: bool = False
    mesh_dim: str = "dp"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind {self.kind!r} is unknown; use one of {', '.join(KINDS)}")
        if self.mixed_precision and self.kind != "fsdp2":
            raise ValueError("mixed_precision applies to kind 'fsdp2' only")
        if self.reshard_after_forward is not True and self.kind != "fsdp2":
            raise ValueError("reshard_after_forward applies to kind 'fsdp2' only")

    def build(self, setup: harness.Setup, mesh: DeviceMesh | None) -> None:
        if mesh is None:
            raise ValueError("ZeroRun runs inside a process group: use "
                             "trainbook.launch.run(harness.sweep, nprocs, ...)")
        group = mesh["dp"].get_group()
        self.rank, self.world, self.steps = dist.get_rank(group), dist.get_world_size(group), \
            setup.steps
        self.inner = model = harness.build_model(setup)
        make_opt = partial(harness.make_optimizer, setup)
        self.zero, self.shard_numel = None, None
        if self.kind in STAGES:
            self.zero = ZeRO(model, STAGES[self.kind], make_opt, group=group)
            self.model, self.optimizer = self.zero, self.zero.optimizer
        elif self.kind in ("ddp", "zero_redundancy_optimizer"):
            self.model = nn.parallel.DistributedDataParallel(
                model, gradient_as_bucket_view=True, process_group=group)
            if self.kind == "ddp":
                self.optimizer = make_opt(model.parameters())
            else:
                from torch.distributed.optim import ZeroRedundancyOptimizer
                cls = torch.optim.SGD if setup.optimizer == "sgd" else torch.optim.AdamW
                extra = {} if setup.optimizer == "sgd" else {"weight_decay": 0.0}
                self.optimizer = ZeroRedundancyOptimizer(
                    model.parameters(), optimizer_class=cls, process_group=group, lr=setup.lr,
                    **extra)
                self.shard_numel = sum(p.numel() for g in self.optimizer.optim.param_groups
                                       for p in g["params"])
        else:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
                if self.mixed_precision else MixedPrecisionPolicy()
            for block in model.blocks:
                fully_shard(block, mesh=mesh, reshard_after_forward=self.reshard_after_forward,
                            mp_policy=mp)
            fully_shard(model, mesh=mesh, mp_policy=mp)
            self.model, self.optimizer = model, make_opt(model.parameters())

    def local_batch(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return harness.shard((x, y), self.rank, self.world)

    def forward_backward(self, x: torch.Tensor,
                         y: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        logits, loss = self.model(x, y)
        loss.backward()
        if self.zero is not None:
            self.zero.reduce_gradients()
        return logits, loss.detach()

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.inner.named_parameters()

    def gradients(self) -> dict[str, torch.Tensor]:
        if self.zero is None:
            return super().gradients()
        return {n: harness.full_tensor(t) for n, t in self.zero.full_tensors("grad").items()}

    def parameters(self) -> dict[str, torch.Tensor]:
        if self.zero is None:
            return super().parameters()
        return {n: harness.full_tensor(t) for n, t in self.zero.full_tensors("param").items()}

    def optimizer_step(self) -> None:
        if self.zero is not None:
            self.zero.step()  # update this rank's slices, all-gather them (stages 1-2)
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        with warnings.catch_warnings():  # MemTracker's own gradient hook runs after ZeRO's,
            # which has already moved the gradient into the flat buffer: it sees None and warns
            warnings.filterwarnings("ignore", message="Expected a tensor or a traceable")
            super().train_step(x, y)

    def stats(self) -> dict:
        out = {"shard_numel": self.shard_numel}
        if self.zero is not None:
            out["counters"] = {k: v / self.steps for k, v in self.zero.counters.items()}
        return out


def collective_workspace(numel: int) -> dict[str, float]:
    """Extra memory each collective allocates beyond its input and output, in units of the full
    tensor (numel fp32 elements), measured with MemTracker on this backend (all ranks)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    world = dist.get_world_size()
    if numel < 1 or numel % world:
        raise ValueError(f"numel must be a positive multiple of the world size {world}, "
                         f"got {numel}")
    out = {}
    for name in ("all_reduce", "reduce_scatter", "all_gather"):
        full, part = torch.ones(numel), torch.ones(numel // world)
        tracker = MemTracker()
        tracker.track_external(full, part)
        with tracker:
            if name == "all_reduce":
                dist.all_reduce(full)
            elif name == "reduce_scatter":
                compat.reduce_scatter_single(part, full)
            else:
                compat.all_gather_single(full, part)
        snap = tracker.get_tracker_snapshot("peak")
        peak = snap[next(iter(snap))]["Total"]
        out[name] = (peak - 4 * (numel + numel // world)) / (4 * numel)
    return out


def _workspace_of(numel: int, _setup: harness.Setup) -> dict[str, float]:
    return collective_workspace(numel)


def workspace_probe(numel: int) -> partial:
    """`collective_workspace(numel)` as a sweep variant: a picklable callable of the setup."""
    return partial(_workspace_of, numel)


def estimate_rank(setup: harness.Setup, kind: str, world: int = 2) -> MemoryBreakdown:
    """The memory estimator's breakdown for `kind` on `world` ranks (fp32, the setup's optimizer,
    one micro-batch of global_batch / world sequences)."""
    from ..compute.memory import MemoryInputs, estimate

    if kind not in KINDS:
        raise ValueError(f"kind {kind!r} is unknown; use one of {', '.join(KINDS)}")
    zero = {"ddp": 0, "zero_redundancy_optimizer": 1, "fsdp2": 3, **STAGES}[kind]
    if setup.global_batch % world:
        raise ValueError(f"global batch {setup.global_batch} is not divisible by {world} ranks")
    return estimate(MemoryInputs(model=setup.model_config(), dtype="fp32",
                                 optimizer=setup.optimizer, dp=world, zero=zero,
                                 micro_batch=setup.global_batch // world, seq_len=setup.seq_len,
                                 activations="reference"))
