"""The experiment every parallelism chapter runs, and its yardstick.

A `Setup` fixes the model, the global batches and the optimizer. A `Technique` says how one
parallel method builds its model and steps it, through a few hooks; `run` is the one loop that
drives any technique (forward and backward, first-step gradients, optimizer step, the loss
averaged over ranks, the step time, the collectives of the first step, and optionally the peak
memory of one more step) and returns a typed `Result`. The base `Technique` is the reference:
one process, the whole global batch. A parallel run is correct when its losses and gradients
match the reference's within fp32 tolerance. `sweep` runs named variants in one process group
and returns their results by name.

Chapter: book/parallelism/data-parallel.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from .. import configs
from ..data import ByteTokenizer, build_dataset
from ..launch import rank_device
from ..model import Transformer

if TYPE_CHECKING:
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class Setup:
    """A tiny, fast experiment: model shape, global batch, steps and optimizer."""

    flavour: str = "llama"
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    d_ff: int = 128
    seq_len: int = 32
    global_batch: int = 8  # sequences per step, summed over data-parallel ranks
    steps: int = 3
    lr: float = 1e-2
    optimizer: str = "sgd"  # "sgd" (parameters comparable exactly) or "adamw"
    seed: int = 0

    def __post_init__(self):
        if self.optimizer not in ("sgd", "adamw"):
            raise ValueError(f"optimizer must be sgd or adamw, got {self.optimizer!r}")
        if self.global_batch < 1 or self.steps < 1:
            raise ValueError("global_batch and steps must be >= 1")

    def model_config(self) -> configs.ModelConfig:
        kv = self.n_kv_heads if self.flavour == "llama" else None
        return configs.ModelConfig("harness", self.flavour, 256, self.n_layers, self.d_model,
                                   self.n_heads, kv, self.d_ff, max_seq_len=self.seq_len)


def build_model(setup: Setup) -> Transformer:
    """The same initial weights on every rank and in the reference (seeded construction)."""
    torch.manual_seed(setup.seed)
    return Transformer(setup.model_config())


def make_optimizer(setup: Setup, params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    if setup.optimizer == "sgd":
        return torch.optim.SGD(params, lr=setup.lr)
    return torch.optim.AdamW(params, lr=setup.lr, weight_decay=0.0)


def global_batches(setup: Setup) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, targets) of shape (global_batch, seq_len) per step: real text, byte tokens."""
    blocks = build_dataset(ByteTokenizer(), setup.seq_len).train
    g = torch.Generator().manual_seed(setup.seed)
    rows = torch.randperm(len(blocks), generator=g)[: setup.steps * setup.global_batch]
    out = []
    for s in range(setup.steps):
        block = blocks[rows[s * setup.global_batch:(s + 1) * setup.global_batch]]
        out.append((block[:, :-1], block[:, 1:]))
    return out


def shard(batch: tuple[torch.Tensor, torch.Tensor], rank: int,
          world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank r's contiguous slice of a global batch."""
    x, y = batch
    if len(x) % world:
        raise ValueError(f"global batch {len(x)} is not divisible by {world} data-parallel ranks")
    b = len(x) // world
    return x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]


@dataclass
class Trace:
    """Losses per step, gradients after the first backward, parameters after the last step."""

    losses: list[float]
    first_grads: dict[str, torch.Tensor]
    final_params: dict[str, torch.Tensor]


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A plain CPU fp32 copy of t, gathered first if it is a DTensor (sharded or partial)."""
    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    return t.detach().float().cpu().clone()


@dataclass(kw_only=True)
class Technique:
    """How one method trains the harness's model: hooks that `run` calls in a fixed order.

    The base class is the reference (one process, the whole global batch, plain autograd);
    a technique overrides what it changes. `setup` replaces the sweep's setup for this variant;
    `measure_memory` adds a warm-up and a tracked step of a fresh build after training
    (`Result.memory`).
    """

    setup: Setup | None = None
    measure_memory: bool = False
    mesh_dim: str | None = None  # the name of a 1-D mesh over all ranks; None: one process

    def mesh_shape(self, world: int) -> dict[str, int]:
        """Named mesh dimensions over the `world` ranks (empty: this process alone, no
        collectives, even inside a process group); each technique takes its groups here."""
        return {} if self.mesh_dim is None else {self.mesh_dim: world}

    def build(self, setup: Setup, mesh: DeviceMesh | None) -> None:
        """Make `self.model` (what a step calls) and `self.optimizer`; mesh is None alone."""
        self.model = build_model(setup)
        self.optimizer = make_optimizer(setup, self.model.parameters())

    def local_batch(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of a global batch (default: all of it)."""
        return x, y

    def forward_backward(self, x: torch.Tensor,
                         y: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Forward and backward on this rank's batch: (logits or None, the rank's loss detached).
        The logits are returned so that a step keeps them alive until the optimizer has run,
        as a training loop does (it matters for the memory peak)."""
        logits, loss = self.model(x, y)
        loss.backward()
        return logits, loss.detach()

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(reference name, parameter) pairs, possibly sharded (DTensor)."""
        return self.model.named_parameters()

    def gradients(self) -> dict[str, torch.Tensor]:
        """Full gradients under the reference's names (read after the first backward)."""
        return {n: full_tensor(p.grad) for n, p in self.named_parameters()}

    def parameters(self) -> dict[str, torch.Tensor]:
        """Full parameters under the reference's names (read after the last step)."""
        return {n: full_tensor(p) for n, p in self.named_parameters()}

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def global_loss(self, loss: torch.Tensor) -> float:
        """The global batch's loss: the mean over the mesh's ranks (they hold equal shares)."""
        loss = full_tensor(loss)
        if self.mesh is not None:
            group = self.mesh.get_group() if self.mesh.ndim == 1 else None  # None: the mesh's
            dist.all_reduce(loss, group=group)  # ranks are all ranks
            loss /= self.mesh.size()
        return loss.item()

    def stats(self) -> dict[str, Any]:
        """What the technique counted over the run (bytes, calls, buckets, ...), by name."""
        return {}

    def memory_tracker_cls(self) -> type[MemTracker] | None:
        """The MemTracker class for `measure_memory` (None: PyTorch's own)."""
        return None

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """One whole step, for the memory tracker: the logits live until the optimizer ran."""
        logits, _ = self.forward_backward(x, y)
        self.optimizer_step()
        del logits


@dataclass
class Result:
    """What one run of a technique gives a chapter, read by name.

    `calls` and `bytes` count the collectives of the first step (`CommCounter`), per phase
    ("forward_backward", "optimizer"), as {op: value}; `memory` holds the peak tensor bytes by
    category of one steady-state step (`bench.memory_measure.tracked_peak`), when asked.
    """

    name: str
    trace: Trace
    step_seconds: float  # median over the steps after the first
    calls: dict[str, dict[str, int]]
    bytes: dict[str, dict[str, int]]
    stats: dict[str, Any] = field(default_factory=dict)
    memory: dict[str, int] | None = None

    def __getitem__(self, key: str):
        """`result["bytes"]` reads a stat by name."""
        return self.stats[key]


def _mesh(technique: Technique):
    if not dist.is_initialized():
        return None
    from torch.distributed.device_mesh import init_device_mesh

    shape = technique.mesh_shape(dist.get_world_size())
    if not shape:
        return None
    # an explicit device: the default mesh follows the accelerator, not the process group
    return init_device_mesh(rank_device().type, tuple(shape.values()),
                            mesh_dim_names=tuple(shape))


class CommCounter(TorchDispatchMode):
    """Calls and bytes of every collective that passes through the dispatcher, whoever calls it:
    c10d ops (`dist.all_reduce`, DDP's reducer, FSDP2, pipelining's send/recv) and functional
    collectives (DTensor's redistributions, `_functional_collectives`).

    Bytes are those of the full tensor a collective works on: the all-reduce buffer, the
    all-gather's output, the reduce-scatter's input, the all-to-all's input, a point-to-point
    message. `bench.collectives.bus_factor` turns them into what each rank sends.
    """

    C10D = {"allreduce_": "all_reduce", "_reduce_scatter_base_": "reduce_scatter",
            "reduce_scatter_tensor_coalesced_": "reduce_scatter",
            "_allgather_base_": "all_gather", "allgather_": "all_gather",
            "allgather_into_tensor_coalesced_": "all_gather", "broadcast_": "broadcast",
            "alltoall_base_": "all_to_all", "send": "send", "recv_": "recv"}
    FUNCTIONAL = {"all_reduce": "all_reduce", "all_reduce_": "all_reduce",
                  "all_gather_into_tensor": "all_gather",
                  "reduce_scatter_tensor": "reduce_scatter", "all_to_all_single": "all_to_all",
                  "broadcast": "broadcast", "broadcast_": "broadcast"}

    def __init__(self):
        super().__init__()
        self.calls: dict[str, int] = {}
        self.bytes: dict[str, int] = {}

    @staticmethod
    def _nbytes(t) -> int:
        t = t[0] if isinstance(t, list | tuple) else t
        t = t[0] if isinstance(t, list | tuple) else t
        return t.numel() * t.element_size()

    def _full_bytes(self, namespace: str, name: str, op: str, args) -> int:
        if namespace == "c10d":
            if name == "allgather_":  # (list of outputs per input, inputs, ...)
                return self._nbytes(args[1]) * len(args[0][0])
            full = args[1] if op in ("reduce_scatter", "all_to_all") else args[0]
            return self._nbytes(full)
        if op == "all_gather":  # (input, group_size, group_name)
            return self._nbytes(args[0]) * args[1]
        return self._nbytes(args[0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if any(issubclass(t, DTensor) for t in types):
            # modes run before tensor subclasses: let DTensor desugar the op into the
            # collectives on local tensors first (CommDebugMode's trick), then count those
            return NotImplemented
        namespace, name = func.namespace, func.overloadpacket.__name__
        table = self.C10D if namespace == "c10d" else \
            self.FUNCTIONAL if namespace == "_c10d_functional" else {}
        op = table.get(name)
        if op:
            self.calls[op] = self.calls.get(op, 0) + 1
            self.bytes[op] = self.bytes.get(op, 0) + self._full_bytes(namespace, name, op, args)
        return func(*args, **(kwargs or {}))


def run(setup: Setup, technique: Technique | None = None, name: str = "") -> Result:
    """Train `setup.steps` steps with `technique` (default: the reference); one `Result`.

    The order is the same for every technique: local batch, forward and backward, (first step:
    full gradients), optimizer step, loss averaged over ranks. The first step's collectives are
    counted per phase; its time is left out of the median, since it allocates.
    """
    technique = technique or Technique()
    technique.mesh = mesh = _mesh(technique)
    device = rank_device() if mesh is not None else torch.device("cpu")
    technique.build(setup, mesh)
    losses, first, times, seen = [], {}, [], {}
    for step, batch in enumerate(global_batches(setup)):
        x, y = (t.to(device) for t in technique.local_batch(*batch))
        t0 = time.perf_counter()
        if step == 0:
            with CommCounter() as fb:
                _, loss = technique.forward_backward(x, y)
            first = technique.gradients()
            with CommCounter() as opt:
                technique.optimizer_step()
            seen = {"forward_backward": fb, "optimizer": opt}
        else:
            _, loss = technique.forward_backward(x, y)
            technique.optimizer_step()
        times.append(time.perf_counter() - t0)
        losses.append(technique.global_loss(loss))
    later = sorted(times[1:] or times)
    result = Result(name or type(technique).__name__, Trace(losses, first, technique.parameters()),
                    later[len(later) // 2], {k: c.calls for k, c in seen.items()},
                    {k: c.bytes for k, c in seen.items()}, technique.stats())
    if technique.measure_memory:
        from ..bench.memory_measure import tracked_peak

        # a fresh build: a wrapper's buffers made in earlier steps (DDP's buckets, rebuilt after
        # its first iteration) would be invisible to a tracker started later
        technique.build(setup, mesh)
        x, y = (t.to(device) for t in technique.local_batch(*global_batches(setup)[0]))
        result.memory = tracked_peak(technique.model, technique.optimizer, x, y,
                                     step=lambda _m, _o, xb, yb: technique.train_step(xb, yb),
                                     tracker_cls=technique.memory_tracker_cls())
    return result


def reference(setup: Setup) -> Trace:
    """Single-process training on the whole global batch: what every parallel run must match."""
    return run(setup).trace


Variant = Technique | Callable[[Setup], Any]


def sweep(setup: Setup, variants: dict[str, Variant]) -> dict[str, Any]:
    """Every variant in one process group (one launch instead of many: starting processes costs
    more than these tiny runs), results by the variant's name. A `Technique` runs through `run`
    (on its own `setup` if it has one); any other callable is a measurement, called with the
    setup, that shares the group."""
    if not isinstance(variants, dict) or not variants:
        raise ValueError("variants must be a non-empty dict {name: Technique or callable}")
    out = {}
    for name, variant in variants.items():
        if isinstance(variant, Technique):
            out[name] = run(variant.setup or setup, variant, name)
        elif callable(variant):
            out[name] = variant(setup)
        else:
            raise ValueError(f"variant {name!r} is a {type(variant).__name__}; give a Technique "
                             "or a callable taking the setup")
    return out


def max_differences(trace: Trace, ref: Trace) -> dict[str, float]:
    """Largest |difference| of losses, first-step gradients and final parameters."""
    def worst(a: dict, b: dict) -> float:
        if a.keys() != b.keys():
            raise ValueError(f"parameter names differ: {sorted(a.keys() ^ b.keys())[:4]}")
        return max((a[k] - b[k]).abs().max().item() for k in a)

    return {"loss": max(abs(a - b) for a, b in zip(trace.losses, ref.losses, strict=True)),
            "grad": worst(trace.first_grads, ref.first_grads),
            "param": worst(trace.final_params, ref.final_params)}
