"""Memory that is not tensors: what a GPU process holds beside the estimator's tensor bytes.

`compute.memory.estimate` counts tensors (weights, gradients, optimizer state, activations,
logits, sharding buffers) and `fits` compares them with what the device reports. A training
process also holds memory that no model tensor owns, and a planner must leave room for it:

- the CUDA context: the driver's per-process state and the loaded kernel images of PyTorch,
  cuBLAS, cuDNN and NCCL. NVIDIA documents no size; `CUDA_CONTEXT_TYPICAL_MIB` is a typical
  range, not a specification (lazy module loading, `CUDA_MODULE_LOADING=LAZY`, the default on
  Linux since CUDA 12.2, keeps it at the low end). Measure it: `torch.cuda.mem_get_info()`'s used
  bytes minus `torch.cuda.memory_reserved()`.
- NCCL's staging buffers: per channel and receiving peer, one buffer per protocol (Simple, LL,
  LL128), sized as in NCCL's source (`nccl_buffer_bytes`), for each communicator.
- cuBLAS workspaces: PyTorch gives each (cuBLAS handle, stream) pair one workspace, sized by
  `CUBLAS_WORKSPACE_CONFIG` (`cublas_workspace_bytes`); it comes from the caching allocator.
- the caching allocator's fragmentation (reserved minus allocated): not predictable from shapes;
  `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` reduces it.
- the optimizer step's intermediates: tensors, but ones the estimator's phases leave out
  (`optimizer_transient_bytes`; measured by `bench.optimizer_memory`).

`budget` lays them out for one device next to the planner's two allowances: the estimator's
error margin (`compute.memory.ESTIMATE_MARGIN`, a fraction of the tensor peak) and the headroom
(`parallel.step_cost.Cluster.headroom`, a fraction of capacity).

Chapter: book/compute/memory.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from numbers import Integral

from .. import hardware
from .memory import ESTIMATE_MARGIN, MemoryBreakdown

MiB, GiB = 2**20, 2**30

# CUDA context per process: a typical range on recent data-centre GPUs and drivers, as users
# measure it (NVIDIA publishes no figure; it depends on the GPU, driver, CUDA version and on lazy
# module loading). A placeholder for a measurement, never a specification.
CUDA_CONTEXT_TYPICAL_MIB = (300, 600)

# NCCL staging buffers, one per protocol, per channel and receiving peer ("Local for recv, remote
# for send", struct ncclConnInfo in NCCL's src/include/device.h):
# Simple: NCCL docs, "NCCL_BUFFSIZE": "The default is 4194304 (4 MiB)." (src/init.cc:
# DEFAULT_BUFFSIZE (1 << 22)).
NCCL_BUFFSIZE = 1 << 22
# LL: NCCL_LL_LINES_PER_THREAD (8) x NCCL_LL_MAX_NTHREADS (512) x NCCL_STEPS (8) x
# sizeof(union ncclLLFifoLine) (16 bytes) = 512 KiB (src/init.cc: DEFAULT_LL_BUFFSIZE).
NCCL_LL_BUFFSIZE = 8 * 512 * 8 * 16
# LL128: NCCL_LL128_ELEMS_PER_THREAD (120) x NCCL_LL128_MAX_NTHREADS (640) x NCCL_STEPS (8) x
# sizeof(uint64_t) = 4,915,200 bytes (src/init.cc: DEFAULT_LL128_BUFFSIZE).
NCCL_LL128_BUFFSIZE = 120 * 640 * 8 * 8
NCCL_PROTOCOL_BYTES = {"Simple": NCCL_BUFFSIZE, "LL": NCCL_LL_BUFFSIZE,
                       "LL128": NCCL_LL128_BUFFSIZE}

# cuBLAS workspace per (handle, stream), as PyTorch sizes it (aten/src/ATen/cuda/
# CublasHandlePool.cpp, parseChosenWorkspaceSize): ":4096:2:16:8" by default (two 4 MiB and eight
# 16 KiB chunks), ":4096:8" (32 MiB) on Hopper and Blackwell (compute capability 9.x to 12.x
# in recent PyTorch; 9.0 only in older releases).
# CUBLAS_WORKSPACE_CONFIG=":SIZE:COUNT[:SIZE:COUNT...]", SIZE in KiB, overrides both.
CUBLAS_WORKSPACE_CONFIG_DEFAULT = ":4096:2:16:8"
CUBLAS_WORKSPACE_CONFIG_SM90 = ":4096:8"

# How AdamW's step can run in torch.optim (foreach=False, foreach=True, fused=True).
OPTIMIZER_IMPLEMENTATIONS = ("for-loop", "foreach", "fused")


def _count(name: str, value: object, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < minimum:
        raise ValueError(f"{name} must be a whole number >= {minimum}, got {value!r}")
    return int(value)


def nccl_buffer_bytes(channels: int, peers: int = 1,
                      protocols: Iterable[str] = ("Simple", "LL", "LL128"),
                      buffsize: int = NCCL_BUFFSIZE) -> int:
    """Bytes of NCCL staging buffers in one communicator on one GPU: `channels` x `peers`
    receiving connections x the buffers of each enabled protocol. `buffsize` is NCCL_BUFFSIZE
    (the Simple protocol's); `protocols` what NCCL_PROTO leaves enabled. NCCL_DEBUG=INFO prints
    each communicator's channel count; NCCL_MAX_NCHANNELS caps it."""
    channels, peers = _count("channels", channels, 1), _count("peers", peers, 1)
    buffsize = _count("buffsize", buffsize, 1)
    protocols = tuple(protocols)
    unknown = [p for p in protocols if p not in NCCL_PROTOCOL_BYTES]
    if unknown or not protocols:
        raise ValueError(f"protocols must be some of {', '.join(NCCL_PROTOCOL_BYTES)}, "
                         f"got {protocols!r}")
    sizes = dict(NCCL_PROTOCOL_BYTES, Simple=buffsize)
    return channels * peers * sum(sizes[p] for p in set(protocols))


def parse_cublas_workspace_config(config: str) -> int:
    """Bytes of one workspace for CUBLAS_WORKSPACE_CONFIG=":SIZE:COUNT[:SIZE:COUNT...]" (SIZE in
    KiB), as PyTorch reads it. A malformed value is an error here (PyTorch warns and uses its
    default)."""
    if not isinstance(config, str) or not re.fullmatch(r"(:[0-9]+:[0-9]+)+", config.strip()):
        raise ValueError(f"CUBLAS_WORKSPACE_CONFIG must look like ':4096:8' or ':4096:2:16:8' "
                         f"(pairs of KiB per chunk and chunk count), got {config!r}")
    pairs = re.findall(r":([0-9]+):([0-9]+)", config)
    return sum(int(size) * 1024 * int(count) for size, count in pairs)


def cublas_workspace_bytes(capability: tuple[int, int], streams: int = 1,
                           config: str | None = None) -> int:
    """Bytes of cuBLAS workspaces PyTorch allocates on a GPU of compute `capability` that runs
    matmuls on `streams` streams (one per (handle, stream) pair)."""
    if (not isinstance(capability, tuple) or len(capability) != 2
            or not all(isinstance(c, int) and c >= 0 for c in capability)):
        raise ValueError(f"capability must be (major, minor), e.g. (9, 0) for an H100, "
                         f"got {capability!r}")
    streams = _count("streams", streams, 1)
    if config is None:
        config = (CUBLAS_WORKSPACE_CONFIG_SM90 if capability[0] in (9, 10, 11, 12)
                  else CUBLAS_WORKSPACE_CONFIG_DEFAULT)
    return streams * parse_cublas_workspace_config(config)


def optimizer_transient_bytes(param_bytes: Iterable[int], implementation: str) -> int:
    """Bytes AdamW's step allocates beyond its state, for parameters of the given sizes (bytes,
    in the optimizer's dtype: the fp32 master copy under mixed precision, one rank's shards under
    ZeRO/FSDP).

    for-loop: per parameter, `exp_avg_sq.sqrt()` and its division by the bias correction exist
    at once: twice the largest parameter. foreach: `torch._foreach_sqrt` materialises a list as
    large as all parameters (torch's docstring: "~ sizeof(params) more peak memory"). fused: one
    kernel, no intermediates.
    """
    if implementation not in OPTIMIZER_IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {', '.join(OPTIMIZER_IMPLEMENTATIONS)}, "
                         f"got {implementation!r}")
    sizes = [_count("parameter bytes", b) for b in param_bytes]
    if not sizes:
        raise ValueError("param_bytes is empty: give the size in bytes of each parameter")
    return {"for-loop": 2 * max(sizes), "foreach": sum(sizes), "fused": 0}[implementation]


def optimizer_phase_peak(breakdown: MemoryBreakdown, transient: float) -> float:
    """The step's peak once the optimizer step's intermediates are counted: the estimator's
    optimizer phase (weights, gradients, state) plus `transient`, or the estimator's peak."""
    if not transient >= 0:
        raise ValueError(f"transient must be >= 0 bytes, got {transient!r}")
    return max(breakdown.peak, breakdown.weights + breakdown.grads + breakdown.optimizer
               + transient)


def budget(breakdown: MemoryBreakdown, gpu: str = "h100-sxm", *,
           optimizer_transient: float = 0.0, context_mib: float = CUDA_CONTEXT_TYPICAL_MIB[1],
           communicators: int = 1, nccl_channels: int = 32, nccl_peers: int = 2,
           matmul_streams: int = 2, capability: tuple[int, int] = (9, 0), headroom: float,
           margin: float = ESTIMATE_MARGIN) -> list[dict]:
    """One device's memory as a budget, in rows of (item, GiB, what it is): capacity, the optimizer
    phase with the step's intermediates, the tensor peak, the estimator's error margin, the
    non-tensor items that can be counted, and the planner's headroom with what it leaves for
    fragmentation.

    Assumptions are arguments: `context_mib` (the top of the typical range), `communicators`
    NCCL communicators of `nccl_channels` channels with `nccl_peers` receiving peers each (ring
    plus tree), `matmul_streams` streams running matmuls (compute, plus one side stream) on a GPU
    of compute `capability` ((9, 0): H100, H200). `headroom` is the planner's
    (`parallel.step_cost.Cluster.headroom`), passed in: this layer cannot import the planner."""
    if not 0 <= headroom < 1 or not 0 <= margin < 1:
        raise ValueError(f"headroom and margin are fractions in [0, 1), got {headroom!r} and "
                         f"{margin!r}")
    if not context_mib >= 0:
        raise ValueError(f"context_mib must be >= 0, got {context_mib!r}")
    spec = hardware.get(gpu)
    cap = spec.capacity_gib * GiB
    peak = optimizer_phase_peak(breakdown, optimizer_transient)
    context = context_mib * MiB
    nccl = _count("communicators", communicators) * nccl_buffer_bytes(nccl_channels, nccl_peers)
    cublas = cublas_workspace_bytes(capability, matmul_streams)
    fixed = context + nccl + cublas
    room = headroom * cap
    rows = [
        ("capacity", cap, f"{spec.name}, as the device reports it"),
        ("optimizer phase", breakdown.weights + breakdown.grads + breakdown.optimizer
         + optimizer_transient, "weights + grads + state + step intermediates"),
        ("tensor peak", peak, "the estimator's, or the optimizer phase"),
        ("estimator margin", margin * peak, "the estimate's error on tensor bytes"),
        ("CUDA context", context, "top of the typical range: measure it"),
        ("NCCL buffers", nccl, f"{communicators} comm. x {nccl_channels} channels x "
         f"{nccl_peers} peers x 3 protocols"),
        ("cuBLAS workspaces", cublas, f"{matmul_streams} streams x PyTorch's workspace"),
        ("fixed reserve", fixed, "context + NCCL + cuBLAS"),
        ("planner headroom", room, f"{headroom:.0%} of capacity"),
        ("headroom left for fragmentation", room - fixed, "headroom - fixed reserve"),
        ("free after all", cap - peak * (1 + margin) - fixed,
         "capacity - peak - margin - fixed reserve"),
    ]
    return [{"item": item, "GiB": b / GiB, "what": what} for item, b, what in rows]
