"""Measure the peak tensor memory of one real training step of the reference model.

`torch.distributed._tools.mem_tracker.MemTracker` sees every tensor created through the
dispatcher and files it under parameters, buffers, gradients, activations, temporaries (made in
backward) or optimizer state; it works on CPU, where process RSS says nothing useful about
tensors. The step is the reference trainer's: forward with the logits kept by the caller,
backward, gradient clipping, AdamW, `zero_grad(set_to_none=True)`. One step runs before the
tracked one, so the optimizer state exists: the tracked step is a steady-state step.

`measure_step` runs in this process; `measure_fsdp_rank` runs on every rank under
`trainbook.launch.run` with the model wrapped by FSDP2 `fully_shard` (each block, then
the root), and returns that rank's peak.

Chapter: book/compute/memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..configs import ModelConfig
from ..model import Transformer

if TYPE_CHECKING:
    from torch.distributed._tools.mem_tracker import MemTracker

CATEGORIES = {"Parameter": "weights", "Buffer": "buffers", "Gradient": "grads",
              "Activation": "activations", "Temp": "temporaries", "Optstate": "optimizer"}


def reference_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   x: torch.Tensor, y: torch.Tensor) -> None:
    """One step as the reference trainer takes it: the logits live to the end."""
    logits, loss = model(x, y)  # logits stay alive until the step ends, as in train.train
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    del logits


def tracked_peak(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
                 y: torch.Tensor, step: Callable[..., object] | None = None,
                 tracker_cls: type[MemTracker] | None = None) -> dict:
    """Run a warm-up step, then one tracked step; the peak snapshot by category, in bytes.

    `step(model, optimizer, x, y)` is one training step (default: the reference trainer's);
    a parallel technique passes its own (a pipeline schedule, a tensor-parallel loss, ...).
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    step = step or reference_step
    step(model, optimizer, x, y)
    tracker = (tracker_cls or MemTracker)()
    tracker.track_external(model, optimizer)
    with tracker:
        step(model, optimizer, x, y)
    snap = tracker.get_tracker_snapshot("peak")
    out = by_category(snap)
    return {"peak": out.pop("total"), **out}


def by_category(snapshot: dict) -> dict:
    """A MemTracker snapshot of one device as bytes by category ("weights", "grads", ...)
    plus "total"."""
    dev = next(iter(snapshot))
    out = {"total": int(snapshot[dev]["Total"])}
    for key, value in snapshot[dev].items():
        name = getattr(key, "value", str(key))
        if name in CATEGORIES:
            out[CATEGORIES[name]] = int(value)
    return out


def random_batch(cfg: ModelConfig, micro_batch: int, seq_len: int,
                 seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded random token ids and their shifted targets (bad sizes rejected first)."""
    if seq_len > cfg.max_seq_len:
        raise ValueError(f"seq_len {seq_len} exceeds the model's max_seq_len {cfg.max_seq_len}")
    if micro_batch < 1 or seq_len < 1:
        raise ValueError(f"micro_batch and seq_len must be >= 1, got {micro_batch}, {seq_len}")
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len), generator=g)
    y = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len), generator=g)
    return x, y


def measure_step(cfg: ModelConfig, micro_batch: int, seq_len: int, recompute: str = "none",
                 dtype: str = "fp32", seed: int = 0) -> dict:
    """Peak tensor bytes of one training step on CPU, by category (and 'peak').

    dtype "bf16" casts the whole model (and so the AdamW state) to bf16: its activations are
    those of bf16 training, its model states are not those of mixed precision (no fp32 master).
    """
    if recompute not in ("none", "full"):
        raise ValueError(f"recompute {recompute!r}: measurement supports 'none' and 'full'")
    if dtype not in ("fp32", "bf16"):
        raise ValueError(f"dtype {dtype!r}: measurement supports 'fp32' and 'bf16'")
    torch.manual_seed(seed)
    model = Transformer(cfg)
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    if recompute == "full":
        from torch.distributed._composable import checkpoint
        for block in model.blocks:
            checkpoint(block)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    return tracked_peak(model, optimizer, *random_batch(cfg, micro_batch, seq_len, seed))


def measure_fsdp_rank(cfg: ModelConfig, micro_batch: int, seq_len: int, seed: int = 0) -> dict:
    """One rank's peak tensor bytes under FSDP2 over all ranks (call through `launch.run`; each
    rank gets its own micro-batch of `micro_batch` sequences). Sharded parameters count as
    weights. (Other layouts: `parallel.mesh.ComposedRun(measure_memory=True)`.)"""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ..launch import rank_device

    if not dist.is_initialized():
        raise ValueError("measure_fsdp_rank runs inside a process group: use "
                         "trainbook.launch.run(measure_fsdp_rank, nprocs, args=...)")
    device = rank_device()
    # an explicit device: the default mesh follows the accelerator, not the process group
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    torch.manual_seed(seed)
    model = Transformer(cfg).to(device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    x, y = random_batch(cfg, micro_batch, seq_len, seed + dist.get_rank())
    out = tracked_peak(model, optimizer, x.to(device), y.to(device))
    out["rank"] = dist.get_rank()
    return out
