"""Activation checkpointing policies on the reference model, measured: what each saves, what it
costs, and whether it changes the gradients.

Five policies, applied from outside the model as `parallelize.apply_recompute` does:

- "none": every block saves what autograd asks for;
- "full": `torch.distributed._composable.checkpoint` on every block: each keeps its input only
  and reruns its forward in backward;
- "every-k": the same on blocks 0, k, 2k, ... only: a dial between the two;
- "selective": op-level selective checkpointing with the runtime's own policy
  (`parallelize.selective_policy`: keep matmul and SDPA outputs, recompute the rest);
- "offload": `torch.autograd.graph.save_on_cpu`: keep everything, but in host memory.

`measure_policy` builds a fresh model, applies the policy and measures one training step: the
peak tensor memory (`MemTracker`, through `bench.memory_measure.tracked_peak`), the FLOPs of
forward, backward and optimizer step (`FlopCounterMode`; what recomputation re-executes is the
difference to "none"), and the gradients, which recomputation must not change. Everything runs
on the CPU, where "offload" moves nothing (the saved tensors already live in host memory), so
`offload_bytes` counts what it would move from a GPU and `offload_threshold` asks whether PCIe
could move it while a layer computes.

Chapter: book/compute/memory.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..bench.memory_measure import random_batch, reference_step, tracked_peak
from ..compute.activations import production_layer_bytes
from ..compute.flops import ATTENTION_CORE, forward_flops
from ..configs import ModelConfig
from ..hardware import PCIE5_X16_GBPS
from ..hardware import get as get_gpu
from ..model import Transformer
from .parallelize import selective_policy

POLICIES = ("none", "full", "every-k", "selective", "offload")
GRAD_ATOL, GRAD_RTOL = 1e-6, 1e-5  # fp32: recomputation replays the same kernels on this CPU



# On CPU, SDPA runs this kernel, which FlopCounterMode has no formula for: count it as its GPU
# siblings are counted (the full T x T square, forward and backward; GQA as it is).
_SDPA_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_SDPA_CPU_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def check_policy(policy: str, k: int = 2) -> None:
    """Raise a one-line ValueError for an unknown policy or a bad k, before any work is done."""
    if policy not in POLICIES:
        raise ValueError(f"recompute policy {policy!r} is unknown; use one of "
                         f"{', '.join(POLICIES)}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a whole number >= 1 (checkpoint blocks 0, k, 2k, ...), "
                         f"got {k!r}")


def checkpointed_blocks(n_layers: int, policy: str, k: int = 2) -> list[int]:
    """The indices of the blocks a policy wraps in a checkpoint (selective: all of them)."""
    check_policy(policy, k)
    if policy in ("full", "selective"):
        return list(range(n_layers))
    return list(range(0, n_layers, k)) if policy == "every-k" else []


def apply_policy(model: Transformer, policy: str, k: int = 2) -> None:
    """Wrap the model's blocks as `policy` says (in place; parameter names do not change).
    "offload" changes nothing in the model: it is a context around the step (`offload_step`)."""
    from torch.distributed._composable import checkpoint

    blocks = list(model.layers())
    for i in checkpointed_blocks(len(blocks), policy, k):
        if policy == "selective":
            checkpoint(blocks[i], context_fn=selective_policy())
        else:
            checkpoint(blocks[i])


def offload_step(model: Transformer, optimizer: torch.optim.Optimizer, x: torch.Tensor,
                 y: torch.Tensor) -> None:
    """The reference training step with every tensor saved for backward kept in host memory.
    On a GPU `save_on_cpu(pin_memory=True)` copies each one to pinned host memory in forward
    and back in backward; for a CPU tensor `.to("cpu")` is the tensor itself, so nothing moves."""
    pin = x.device.type != "cpu" and torch.cuda.is_available()
    with torch.autograd.graph.save_on_cpu(pin_memory=pin):
        reference_step(model, optimizer, x, y)


def flop_counter() -> torch.utils.flop_counter.FlopCounterMode:
    """A silent FlopCounterMode that also counts the CPU attention kernel (see _SDPA_CPU)."""
    from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop, sdpa_flop

    def raw(formula: Callable[..., int]) -> Callable[..., int]:  # already shape-wrapped
        def count(*args: object, **kwargs: object) -> int:
            return formula(*args, **kwargs)
        count._get_raw = True  # type: ignore[attr-defined]
        return count

    return FlopCounterMode(display=False, custom_mapping={_SDPA_CPU: raw(sdpa_flop),
                                                          _SDPA_CPU_BWD: raw(sdpa_backward_flop)})


def _counting(step: Callable[..., object], into: dict) -> Callable[..., object]:
    """`step`, whose first call (the warm-up step of a fresh model) also counts its FLOPs and
    keeps each gradient as soon as it is complete, before clipping and the optimizer use it.
    AdamW and clipping are elementwise: FlopCounterMode counts none of their work."""

    def first(model: Transformer, optimizer: torch.optim.Optimizer, x: torch.Tensor,
              y: torch.Tensor) -> None:
        if "flops" in into:
            return step(model, optimizer, x, y)
        names = {p: n for n, p in model.named_parameters()}
        grads = into["grads"] = {}

        def capture(p: torch.Tensor) -> None:
            grads[names[p]] = p.grad.detach().clone()

        handles = [p.register_post_accumulate_grad_hook(capture) for p in names]
        with flop_counter() as counter:
            step(model, optimizer, x, y)
        for h in handles:
            h.remove()
        into["flops"] = counter.get_total_flops()

    return first


def measure_policy(cfg: ModelConfig, policy: str, micro_batch: int, seq_len: int, k: int = 2,
                   seed: int = 0) -> dict:
    """One policy on a fresh fp32 model on CPU: the FLOPs and gradients of its first step (the
    same weights and batch for every policy, so they can be compared), then the peak and the
    activation bytes at the peak of a steady-state step (MemTracker)."""
    check_policy(policy, k)
    x, y = random_batch(cfg, micro_batch, seq_len, seed)
    torch.manual_seed(seed)
    model = Transformer(cfg)
    apply_policy(model, policy, k)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    out: dict = {"policy": policy}
    mem = tracked_peak(model, optimizer, x, y,
                       step=_counting(offload_step if policy == "offload" else reference_step, out))
    out.update(peak=mem["peak"], activations=mem.get("activations", 0))
    return out


def compare_policies(cfg: ModelConfig, micro_batch: int, seq_len: int,
                     policies: tuple[str, ...] = POLICIES, k: int = 2, seed: int = 0
                     ) -> list[dict]:
    """Measure each policy against "none" (measured first, whether listed or not): one row each
    with bytes, FLOPs, the share saved and spent, and the largest gradient difference. Raises
    if any gradient differs from "none" beyond fp32 tolerance (GRAD_ATOL, GRAD_RTOL)."""
    for p in policies:
        check_policy(p, k)
    base = measure_policy(cfg, "none", micro_batch, seq_len, k, seed)
    rows = []
    for p in policies:
        m = base if p == "none" else measure_policy(cfg, p, micro_batch, seq_len, k, seed)
        diff = max((m["grads"][n] - g).abs().max().item() for n, g in base["grads"].items())
        for n, g in base["grads"].items():
            if not torch.allclose(m["grads"][n], g, atol=GRAD_ATOL, rtol=GRAD_RTOL):
                raise AssertionError(f"{p}: gradient of {n} differs from 'none' by "
                                     f"{(m['grads'][n] - g).abs().max().item():.3g}")
        rows.append({"policy": p if p != "every-k" else f"every-{k}", "peak": m["peak"],
                     "activations": m["activations"],
                     "saved_pct": 100 * (1 - m["peak"] / base["peak"]),
                     "flops": m["flops"],
                     "extra_flops": m["flops"] - base["flops"],
                     "extra_flops_pct": 100 * (m["flops"] / base["flops"] - 1),
                     "predicted_extra": predicted_extra_flops(cfg, micro_batch, seq_len, p, k),
                     "max_grad_diff": diff})
    return rows


def predicted_extra_flops(cfg: ModelConfig, micro_batch: int, seq_len: int, policy: str,
                          k: int = 2) -> int:
    """The forward FLOPs a policy re-executes in backward, from `compute.flops.forward_flops`
    (dense models). A checkpointed block reruns its forward, less its last matmul (the down
    projection): non-reentrant checkpointing stops recomputing once it has rebuilt every tensor
    backward needs, and that matmul's output feeds only the residual add, which saves nothing.
    "selective" reruns the attention core only where its SDPA kernel is not on the keep list,
    as on this CPU (`_scaled_dot_product_flash_attention_for_cpu`); on a GPU the kept
    flash/efficient kernels make that zero. The head is never recomputed."""
    check_policy(policy, k)
    if cfg.is_moe:
        raise ValueError(f"{cfg.name} is a mixture of experts; predicted_extra_flops counts "
                         f"dense models only: pass a dense config")
    f = forward_flops(cfg, seq_len)  # the full T x T square, as the CPU kernel is counted
    if policy in ("none", "offload"):
        return 0
    if policy == "selective":
        return micro_batch * sum(f[c] for c in ATTENTION_CORE)
    mats = 3 if cfg.flavour == "llama" else 2  # SwiGLU gate/up/down, GELU fc/proj
    block = (f["total"] - f["logits"]) // cfg.n_layers
    last = f["mlp"] // cfg.n_layers // mats
    return micro_batch * len(checkpointed_blocks(cfg.n_layers, policy, k)) * (block - last)


def offload_bytes(cfg: ModelConfig, micro_batch: int, seq_len: int, seed: int = 0) -> dict:
    """Bytes `save_on_cpu` would copy to the host in one forward pass on a GPU: every tensor
    autograd saves, each time it is saved (a tensor saved by three matmuls moves three times),
    weights included (save_on_cpu does not tell them apart). Counted with the same hook."""
    x, y = random_batch(cfg, micro_batch, seq_len, seed)
    torch.manual_seed(seed)
    model = Transformer(cfg)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    weights |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    out = {"total": 0, "weights": 0, "activations": 0, "tensors": 0}

    def pack(t: torch.Tensor) -> torch.Tensor:
        kind = "weights" if t.untyped_storage().data_ptr() in weights else "activations"
        out[kind] += t.nbytes
        out["total"] += t.nbytes
        out["tensors"] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, y)[1].backward()
    return out


def offload_threshold(model: str = "llama-3-8b", gpu: str = "h100-sxm", seq_len: int = 8192,
                      micro_batch: int = 1, dtype: str = "bf16", mfu: float = 1.0) -> dict:
    """The host-link bandwidth (decimal GB/s) above which offloading one layer's activations
    hides behind that layer's forward: production-stack bytes per layer (`compute.activations`)
    / (causal forward matmul FLOPs per layer / (peak FLOP/s x mfu)). Forward is the binding
    direction: backward takes twice as long to bring the same bytes back."""
    from ..configs import get as get_config

    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1] (a fraction of the peak), got {mfu!r}")
    if micro_batch < 1 or seq_len < 1:
        raise ValueError(f"micro_batch and seq_len must be >= 1, got {micro_batch}, {seq_len}")
    cfg, hw = get_config(model), get_gpu(gpu)
    layer_bytes = production_layer_bytes(cfg, micro_batch, seq_len, dtype)
    fwd = forward_flops(cfg, seq_len, causal=True)
    layer_flops = micro_batch * (fwd["total"] - fwd["logits"]) / cfg.n_layers
    layer_s = layer_flops / (hw.peak_flops(dtype) * mfu)
    need = layer_bytes / layer_s / 1e9
    return {"model": model, "gpu": gpu, "layer_bytes": layer_bytes, "layer_ms": 1e3 * layer_s,
            "threshold_gbps": need, "pcie_gbps": PCIE5_X16_GBPS,
            "hideable_share": min(1.0, PCIE5_X16_GBPS / need),
            "hbm_write_ms": 1e3 * layer_bytes / (hw.hbm_gbps * 1e9)}

