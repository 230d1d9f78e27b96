"""What AdamW's step allocates beyond its state, measured: for-loop, foreach and fused.

The memory estimator's optimizer phase holds weights, gradients and optimizer state, nothing
else. The step itself makes intermediates, and how many depends on the implementation torch.optim
picks: the for-loop one (the default on a CPU) makes one parameter's worth at a time, the foreach
one (the default when every tensor is on a GPU) a list as large as all parameters, the fused one
none. `step_transient` measures one steady-state `optimizer.step()` under PyTorch's `MemTracker`
(the state exists already: a first step made it) and returns its peak above the bytes held when
it started, next to `compute.overheads.optimizer_transient_bytes`' prediction.

Chapter: book/compute/memory.
"""

from __future__ import annotations

import torch

from ..compute.overheads import OPTIMIZER_IMPLEMENTATIONS, optimizer_transient_bytes
from ..configs import ModelConfig
from ..model import Transformer
from .memory_measure import by_category

_FLAGS = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def fused_supported(device: str | torch.device = "cpu") -> bool:
    """Whether torch.optim has fused kernels for this device type (CPU from torch 2.4)."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return torch.device(device).type in _get_fused_kernels_supported_devices()


def make_adamw(params: list[torch.nn.Parameter], implementation: str,
               lr: float = 1e-3) -> torch.optim.AdamW:
    """AdamW forced to one implementation: "for-loop", "foreach" or "fused"."""
    if implementation not in OPTIMIZER_IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {', '.join(OPTIMIZER_IMPLEMENTATIONS)}, "
                         f"got {implementation!r}")
    if implementation == "fused" and params and not fused_supported(params[0].device):
        raise ValueError(f"torch {torch.__version__} has no fused AdamW for "
                         f"{params[0].device.type}; use 'foreach' or 'for-loop'")
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.1, **_FLAGS[implementation])


def param_bytes(cfg: ModelConfig, shards: int = 1, bytes_per_element: int = 4) -> list[int]:
    """Bytes of each parameter of the reference model (built on the meta device: no memory, any
    size), split over `shards` ranks as FSDP splits each tensor (dim 0, the last shard padded):
    what one rank's optimizer steps over. 4 bytes: the fp32 master weights of mixed precision."""
    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"cfg must be a ModelConfig (e.g. configs.get('llama-3-8b')), "
                         f"got {type(cfg).__name__}")
    for name, v in (("shards", shards), ("bytes_per_element", bytes_per_element)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a whole number >= 1, got {v!r}")
    with torch.device("meta"):
        model = Transformer(cfg)
    return [-(-p.shape[0] // shards) * (p.numel() // p.shape[0]) * bytes_per_element
            for p in model.parameters()]


def step_transient(cfg: ModelConfig, implementation: str, seed: int = 0) -> dict:
    """Peak bytes above the starting point during one steady-state AdamW step over the reference
    model's parameters (fp32, on the CPU, random gradients), with the prediction and the
    parameter bytes it is a fraction of."""
    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"cfg must be a ModelConfig (e.g. configs.get('tiny-llama')), "
                         f"got {type(cfg).__name__}")
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(seed)
    model = Transformer(cfg)
    params = list(model.parameters())
    optimizer = make_adamw(params, implementation)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()  # the first step makes the state; the tracked one is a steady-state step
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        start = by_category(tracker.get_tracker_snapshot("current"))["total"]
        optimizer.step()
    peak = by_category(tracker.get_tracker_snapshot("peak"))["total"]
    sizes = [p.numel() * p.element_size() for p in params]
    return {"implementation": implementation, "transient": peak - start,
            "predicted": optimizer_transient_bytes(sizes, implementation),
            "param_bytes": sum(sizes), "largest_param_bytes": max(sizes),
            "fraction": (peak - start) / sum(sizes)}


def compare(cfg: ModelConfig, implementations: tuple[str, ...] = OPTIMIZER_IMPLEMENTATIONS,
            seed: int = 0) -> list[dict]:
    """`step_transient` for each implementation this torch supports on the CPU (fused is left
    out where it has no CPU kernel)."""
    unknown = [i for i in implementations if i not in OPTIMIZER_IMPLEMENTATIONS]
    if unknown or not implementations:
        raise ValueError(f"implementations must be some of {', '.join(OPTIMIZER_IMPLEMENTATIONS)}"
                         f", got {implementations!r}")
    return [step_transient(cfg, i, seed) for i in implementations
            if i != "fused" or fused_supported("cpu")]
