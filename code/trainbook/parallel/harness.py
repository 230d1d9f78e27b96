"""The yardstick for every parallelism chapter: the same model, batches and optimizer, run in one
process on the whole global batch. A parallel run is correct when its losses and gradients match
this reference within fp32 tolerance.

Chapter: book/parallelism/data-parallel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import configs
from ..data import ByteTokenizer, build_dataset
from ..model import Transformer


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


def make_optimizer(setup: Setup, params) -> torch.optim.Optimizer:
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


def shard(batch: tuple[torch.Tensor, torch.Tensor], rank: int, world: int):
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


def reference(setup: Setup) -> Trace:
    """Single-process training on the whole global batch: what every parallel run must match."""
    model = build_model(setup)
    opt = make_optimizer(setup, model.parameters())
    losses, first = [], {}
    for step, (x, y) in enumerate(global_batches(setup)):
        _, loss = model(x, y)
        loss.backward()
        if step == 0:
            first = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return Trace(losses, first, {n: p.detach().clone() for n, p in model.named_parameters()})


def max_differences(trace: Trace, ref: Trace) -> dict[str, float]:
    """Largest |difference| of losses, first-step gradients and final parameters."""
    def worst(a: dict, b: dict) -> float:
        if a.keys() != b.keys():
            raise ValueError(f"parameter names differ: {sorted(a.keys() ^ b.keys())[:4]}")
        return max((a[k] - b[k]).abs().max().item() for k in a)

    return {"loss": max(abs(a - b) for a, b in zip(trace.losses, ref.losses, strict=True)),
            "grad": worst(trace.first_grads, ref.first_grads),
            "param": worst(trace.final_params, ref.final_params)}
