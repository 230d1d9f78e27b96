"""Memory of full fine-tuning, LoRA and QLoRA on one GPU, from Part 1's memory estimator, and the
same three measured on the reference model.

Full fine-tuning is `compute.memory.estimate` as it stands: 16-bit weights and gradients, an fp32
master copy and AdamW's two fp32 moments (2 + 2 + 12 bytes per parameter). LoRA keeps the
whole base frozen in the compute dtype (2 bytes per parameter in bf16, no gradient, no optimizer
state) and trains the adapters in fp32 (peft's default on a 16-bit base) with AdamW: 4 + 4 + 8
bytes per adapter parameter, `state_bytes_per_param("fp32", "adamw")`. QLoRA stores every
linear layer of the blocks in NF4 with double quantisation (`nf4.bits_per_param`: 4.127 bits),
whichever of them carry adapters, and the rest (embeddings, norms, the output head) in the
compute dtype, and dequantises one weight at a time for its matmul (a transient of the largest
weight in the compute dtype).

Activations are the estimator's for the same model, batch, sequence and recompute setting: the
frozen layers still pass gradients back to the adapters below them, so backward needs what it
needs in full fine-tuning. Each adapter adds its r-wide intermediate (fp32), and with dropout a
dropped copy of its input and the mask. The peak follows the estimator's phases: the largest of
the backward pass (weights, optimizer state, activations, logits, QLoRA's transient) and the
optimizer step (weights, gradients, optimizer state). With every linear layer targeted this is
a production stack's count; the reference model, whose unfused RMSNorm keeps its normalised
output only for its weight's gradient, saves less when that weight is frozen, so there the
estimate is an upper bound (the chapter measures by how much).

`measure` runs one steady-state step of the reference model in fp32 under `MemTracker`
(`bench.memory_measure.tracked_peak`) for each method, to hold the estimate (with the
"reference" activation model) to a measurement.

Chapter: book/alignment/lora
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from .. import configs
from ..bench.memory_measure import random_batch, tracked_peak
from ..compute import memory as M
from ..compute.roofline import bytes_per_element
from ..configs import ModelConfig
from ..model import Transformer
from . import lora as L
from . import nf4

METHODS = ("full", "lora", "qlora")
ADAPTER_DTYPE = "fp32"  # peft's autocast_adapter_dtype on a 16-bit base (lora.PEFT_AUTOCAST_...)
MASK_BYTES = 1  # a dropout mask is a bool per element
# The setting of the chapter's table: the QLoRA paper's recipe applies LoRA to every linear
# layer of the blocks; gradient checkpointing (full recompute) is how QLoRA runs are made.
DEFAULTS = dict(r=16, targets=L.ALL_LINEAR, micro_batch=1, seq_len=2048, recompute="full")


@dataclass
class TargetShapes:
    """What LoRA's memory depends on: adapter parameters, the targeted weights, their inputs."""

    params: int  # the base model's parameters
    trainable: int  # adapter parameters (r (in + out) per targeted layer)
    linear_params: int  # weights of every linear layer but the head (what QLoRA quantises)
    largest_linear: int  # the largest of them (QLoRA dequantises one at a time)
    in_features: list[int]  # per targeted layer of one block
    per_layer: int  # targeted layers per block


def target_shapes(cfg: ModelConfig, targets: L.Targets = L.ALL_LINEAR,
                  r: int = 16) -> TargetShapes:
    """Build the model on the meta device (nothing allocated), put LoRA on it and measure."""
    L.check_hyper(r, 1.0, 0.0)
    with torch.device("meta"):
        model = Transformer(cfg)
    params = L.counts(model)[1]
    modules = dict(model.named_modules())
    sizes = [modules[n].weight.numel() for n in L.target_names(model, L.ALL_LINEAR)]
    L.apply_lora(model, targets, r)
    layers = L.lora_layers(model)
    trainable = L.counts(model)[0]
    first = [m for n, m in layers.items() if n.startswith("blocks.0.")]
    return TargetShapes(params, trainable, sum(sizes), max(sizes),
                        [m.in_features for m in first], len(first))


@dataclass
class FineTuneMemory:
    """Bytes of one fine-tuning setup on one GPU, by category."""

    model: str
    method: str
    params: int
    trainable: int
    weights: float  # everything held as weights: the base (frozen or not) and the adapters
    grads: float
    optimizer: float  # optimizer state, with full fine-tuning's fp32 master copy
    activations: float
    logits: float
    transient: float  # QLoRA's dequantised weight
    peak: float

    def row(self, unit: float = M.GiB) -> dict:
        d = asdict(self)
        return {k: (v / unit if isinstance(v, float) else v) for k, v in d.items()}


def _check(method: str, dtype: str, dropout: float) -> None:
    M.check_choice(method, METHODS, "method")
    if dtype not in M.PRECISIONS:
        raise ValueError(f"dtype {dtype!r} is unknown; use one of {', '.join(M.PRECISIONS)}")
    if method != "full" and dtype == "fp16":
        raise ValueError("use bf16 or fp32 for the frozen base (fp16 needs loss scaling)")
    L.check_hyper(1, 1.0, dropout)


def fine_tune_memory(model: str | ModelConfig, method: str, r: int = DEFAULTS["r"],
                     targets: L.Targets = DEFAULTS["targets"],
                     micro_batch: int = DEFAULTS["micro_batch"],
                     seq_len: int | None = DEFAULTS["seq_len"],
                     recompute: str = DEFAULTS["recompute"], dtype: str = "bf16",
                     activations: str = "production", dropout: float = 0.0,
                     double: bool = True, blocksize: int = nf4.BLOCKSIZE,
                     shapes: TargetShapes | None = None) -> FineTuneMemory:
    """Memory of full fine-tuning, LoRA or QLoRA of `model` (see the module docstring)."""
    _check(method, dtype, dropout)
    cfg = configs.resolve(model)
    x = M.MemoryInputs(model=cfg, dtype=dtype, optimizer="adamw", micro_batch=micro_batch,
                       seq_len=seq_len, recompute=recompute, activations=activations)
    full = M.estimate(x)
    if method == "full":
        P = configs.param_counts(cfg)["total"]
        return FineTuneMemory(cfg.name, method, P, P, full.weights, full.grads, full.optimizer,
                              full.activations, full.logits, 0.0, full.peak)
    s = shapes or target_shapes(cfg, targets, r)
    e = bytes_per_element(dtype)
    base = float(e * s.params)
    transient = 0.0
    if method == "qlora":
        bits = nf4.bits_per_param(blocksize, double)
        base = e * (s.params - s.linear_params) + bits / 8 * s.linear_params
        transient = float(e * s.largest_linear)
    a = M.state_bytes_per_param(ADAPTER_DTYPE, "adamw")
    tokens = micro_batch * x.tokens_seq
    per_layer = tokens * s.per_layer * r * bytes_per_element(ADAPTER_DTYPE)
    if dropout > 0:  # a dropped copy of each adapter's input, and its mask
        per_layer += tokens * sum(s.in_features) * (e + MASK_BYTES)
    layers = cfg.n_layers if recompute == "none" else 1  # otherwise rebuilt one at a time
    acts = full.activations + layers * per_layer
    weights = base + a["weights"] * s.trainable
    grads, opt = a["grads"] * s.trainable, a["optimizer"] * s.trainable
    # the estimator's phases: the backward pass (no adapter gradients yet at its start, as for
    # full fine-tuning) and the optimizer step (all gradients, activations freed)
    peak = max(weights + opt + acts + full.logits + transient, weights + grads + opt)
    return FineTuneMemory(cfg.name, method, s.params, s.trainable, weights, grads, opt, acts,
                          full.logits, transient, peak)


def memory_table(models: Sequence[str | ModelConfig] = ("llama-3-8b", "llama-3-70b"),
                 gpu: str = "h100-sxm", shapes: TargetShapes | None = None,
                 **kw: Any) -> list[dict]:
    """One row (GiB) per model and method, with the estimator's verdict on one `gpu`
    (`shapes`: the one model's target_shapes, if already computed)."""
    if shapes is not None and len(models) != 1:
        raise ValueError("shapes describe one model: pass one model with them")
    rows = []
    for name in models:
        cfg = configs.resolve(name)
        these = shapes or target_shapes(cfg, kw.get("targets", DEFAULTS["targets"]),
                                        kw.get("r", DEFAULTS["r"]))
        for method in METHODS:
            m = fine_tune_memory(cfg, method, shapes=these, **kw)
            b = M.MemoryBreakdown(m.weights, m.grads, m.optimizer, m.activations, m.logits,
                                  m.transient, m.peak, m.peak, m.params, "all")
            fit = M.fits(b, gpu)
            rows.append({**m.row(), "fits": fit["verdict"], "gpu": fit["gpu"],
                         "capacity_gib": fit["capacity_gib"]})
    return rows


def measure(cfg: ModelConfig, method: str, r: int = 16, targets: L.Targets = L.ALL_LINEAR,
            micro_batch: int = 2, seq_len: int = 64, seed: int = 0) -> dict:
    """Peak tensor bytes of one steady-state training step of the reference model in fp32 on
    CPU, by MemTracker category: full fine-tuning, LoRA or QLoRA (AdamW on what trains)."""
    _check(method, "fp32", 0.0)
    x, y = random_batch(cfg, micro_batch, seq_len, seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Transformer(cfg)
        if method == "lora":
            L.apply_lora(model, targets, r)
        elif method == "qlora":
            L.qlora(model, targets, r)
        trainable = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(trainable, lr=1e-3, foreach=False)
        return tracked_peak(model, opt, x, y, tracker_cls=frozen_aware_tracker())


def frozen_aware_tracker() -> type:
    """torch's MemTracker, made to accept frozen parameters: it registers a gradient hook on
    every parameter, which fails on one that does not require a gradient (torch 2.13). This
    one hooks only the trainable parameters; everything else is MemTracker's own."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    class FrozenAwareMemTracker(MemTracker):
        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            total = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
            if not install_grad_hooks:
                return total

            def on_grad(grad):
                self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

            for p in module.parameters():
                if p.requires_grad and self._param_to_grad_hook_handles.get(p) is None:
                    self._param_to_grad_hook_handles[p] = (
                        p.register_hook(on_grad),
                        p.register_post_accumulate_grad_hook(lambda q: on_grad(q.grad)))
            return total

    return FrozenAwareMemTracker
