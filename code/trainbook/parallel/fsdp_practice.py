"""FSDP2 in practice: accumulation, prefetch, offload, meta-device init and HSDP, measured.

What a production FSDP2 (`torch.distributed.fsdp.fully_shard`) run sets beyond the wrap, each
measured on gloo ranks with the reference model or costed with the book's models:

- `accumulate_step`: gradient accumulation with a reduce-scatter per micro-batch, or with
  `set_requires_gradient_sync(False)` on all but the last one (one reduce-scatter per unit and
  step, but each rank keeps the unsharded gradients between micro-batches);
- `shard`: one block per FSDP unit, `reshard_after_forward` and explicit prefetching;
- `init_sharded`: initialise a model built on the meta device after sharding, with the same
  values as a model materialised whole (DTensor's random ops on a CPU mesh draw every shard
  from the same generator state: each shard would get the same numbers);
- `practice_rank`: all of the above on one rank, in one launch (counts, peaks, parameters);
- `offload_traffic`: what `CPUOffloadPolicy` moves over PCIe per step, against compute;
- `hsdp_comm`: FSDP over every GPU against HSDP (shard in a node, replicate across), with the
  planner's link model.

Chapter: book/parallelism/zero-fsdp.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from .. import configs, hardware
from ..compute import flops, memory
from ..configs import ModelConfig
from ..model import Transformer, rope_tables
from .collectives import collective_time
from .harness import CommCounter
from .step_cost import Cluster, link

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

PCIE5_X16_GBPS = hardware.PCIE5_X16_GBPS  # per direction, decimal GB/s


def _check_rank_args(micro_batches: int, micro_batch: int, seq_len: int,
                     cfg: ModelConfig) -> None:
    for name, v in (("micro_batches", micro_batches), ("micro_batch", micro_batch),
                    ("seq_len", seq_len)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if micro_batches < 2:
        raise ValueError(f"micro_batches must be >= 2 to compare accumulation modes, got "
                         f"{micro_batches}")
    if seq_len > cfg.max_seq_len:
        raise ValueError(f"seq_len {seq_len} exceeds the model's max_seq_len {cfg.max_seq_len}; "
                         "use a shorter seq_len")


def shard(model: Transformer, mesh: DeviceMesh, reshard_after_forward: bool | int = True,
          prefetch: int = 0) -> Transformer:
    """fully_shard each block, then the root (the production recipe: one all-gather per block;
    the root keeps FSDP2's default, gathered from forward to backward).

    `prefetch=k` prefetches explicitly: block i's forward starts the all-gathers of the next k
    blocks, its backward those of the k blocks before it. On a GPU a gather issued early runs
    while the current block computes; each block prefetched is one more block held gathered.
    (Backward already prefetches one block implicitly: k=1 changes the forward only.)"""
    from torch.distributed.fsdp import fully_shard

    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be a number of blocks >= 0, got {prefetch!r}")
    blocks = list(model.blocks)
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh)
    for i, block in enumerate(blocks):
        if prefetch and i + 1 < len(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + prefetch])
        if prefetch and i > 0:
            block.set_modules_to_backward_prefetch(blocks[max(0, i - prefetch):i][::-1])
    return model


def accumulate_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
                    y: torch.Tensor, micro_batches: int, sync_each: bool) -> None:
    """One optimizer step over `micro_batches` slices of (x, y), losses scaled by 1/m.

    sync_each=False skips the reduce-scatter on all but the last micro-batch
    (`set_requires_gradient_sync`): FSDP2 then keeps each unit's unsharded gradient on every
    rank until the last backward, which reduce-scatters the sum once."""
    xs, ys = x.chunk(micro_batches), y.chunk(micro_batches)
    for i, (xb, yb) in enumerate(zip(xs, ys, strict=True)):
        if not sync_each:
            model.set_requires_gradient_sync(i == micro_batches - 1)
        _, loss = model(xb, yb)
        (loss / micro_batches).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


class _FullParameters:
    """Stands in for the model inside `Transformer.reset_parameters`: hands out one full-size
    plain tensor per parameter, then copies this rank's dim-0 shard of it into the sharded one."""

    def __init__(self, model: Transformer):
        self.cfg, self.model = model.cfg, model

    def named_parameters(self):
        import torch.distributed as dist

        for name, p in self.model.named_parameters():
            full = torch.empty(p.shape, dtype=p.dtype)  # the DTensor's global shape
            yield name, full  # reset_parameters fills it with the reference's rule
            n, r = dist.get_world_size(p.device_mesh.get_group()), p.device_mesh.get_local_rank()
            chunks = full.chunk(n, dim=0)
            if r < len(chunks):
                p.to_local().copy_(chunks[r])


def init_sharded(model: Transformer, seed: int) -> Transformer:
    """Initialise a sharded model built on the meta device and moved with `to_empty`, exactly as
    `torch.manual_seed(seed); model.reset_parameters()` does on a whole model.

    Each full parameter is drawn in turn on this rank (peak: one parameter, not the model) and
    only the local shard is kept. Buffers computed in `__init__` (the RoPE tables) were on the
    meta device too: `to_empty` leaves them uninitialised, so they are recomputed here."""
    from torch.distributed.tensor import DTensor, Shard

    for name, p in model.named_parameters():
        if not isinstance(p, DTensor) or tuple(p.placements) != (Shard(0),):
            raise ValueError(f"parameter {name} is not sharded on dim 0 over a 1-D mesh; call "
                             "init_sharded after shard(model, mesh) and model.to_empty(...)")
    torch.manual_seed(seed)
    Transformer.reset_parameters(_FullParameters(model))
    if model.rope_cos is not None:
        device = model.rope_cos.device
        cos, sin = rope_tables(model.cfg.max_seq_len, model.cfg.head_dim, model.cfg.rope_theta)
        model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
    return model


def reference_init(cfg: ModelConfig, seed: int) -> Transformer:
    """The whole-model path with the same draws: build, then seed right before the init (the
    constructor's default nn.Linear init draws first, a meta build draws nothing)."""
    model = Transformer(cfg)
    torch.manual_seed(seed)
    model.reset_parameters()
    return model


def _micro_batch_tracker(watch: torch.nn.Module | None = None,
                         held: list[dict] | None = None) -> type:
    """MemTracker that lets a module run forward more than once in the tracked region (it
    refuses otherwise): the per-module stats restart at each micro-batch's forward, the global
    peak, which is what is read, is kept. With `watch`, it appends to `held` the snapshot of
    what is live each time `watch`'s forward is about to start (before FSDP's own pre-forward
    hook gathers it): a point every run reaches in the same state, unlike the peak, whose
    position depends on when asynchronous collectives complete."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class MicroBatchTracker(MemTracker):
        def _pre_fw_hook(self, module: torch.nn.Module, inputs: object) -> None:
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                self.reset_mod_stats()
            if module is watch and held is not None and not self._mod_tracker.is_bw:
                held.append(self.get_tracker_snapshot("current"))
            super()._pre_fw_hook(module, inputs)

    return MicroBatchTracker


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _tracked_build(build: Callable[[], torch.nn.Module],
                   device: torch.device) -> tuple[torch.nn.Module, int]:
    """(model, peak bytes on `device` while `build` ran), MemTracker watching every allocation
    (it files meta tensors under the meta device: they take no memory and are left out)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with tracker:
        model = build()
    snap = tracker.get_tracker_snapshot("peak")
    return model, int(snap.get(device, {}).get("Total", 0))


def practice_rank(cfg: ModelConfig, micro_batches: int = 4, micro_batch: int = 1,
                  seq_len: int = 32, big: ModelConfig | None = None, seed: int = 0,
                  lr: float = 0.1) -> dict:
    """Every measurement of the chapter's section on this rank (run through `launch.run`).

    Accumulation (SGD, so equal gradients give equal parameters): reduce-scatters per step and
    peak bytes with and without a sync per micro-batch, and the parameters after three steps.
    Resharding and prefetch: all-gathers per step and peak bytes. Meta init: the largest
    difference from `reference_init`, with and without `init_sharded`, and the peak bytes of
    building `big` (default: `cfg`) on the meta device and sharding it, against building it
    whole and then sharding."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ..bench.memory_measure import by_category, tracked_peak
    from ..launch import rank_device

    _check_rank_args(micro_batches, micro_batch, seq_len, cfg)
    if not dist.is_initialized():
        raise ValueError("practice_rank runs inside a process group: use "
                         "trainbook.launch.run(practice_rank, nprocs=2, args=(cfg,))")
    device, rank = rank_device(), dist.get_rank()
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    g = torch.Generator().manual_seed(seed + 1 + rank)
    tokens = (micro_batches * micro_batch, seq_len)
    x = torch.randint(0, cfg.vocab_size, tokens, generator=g).to(device)
    y = torch.randint(0, cfg.vocab_size, tokens, generator=g).to(device)
    units = cfg.n_layers + 1
    out: dict = {"rank": rank, "units": units}

    def build(**kw) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = shard(Transformer(cfg).to(device), mesh, **kw)
        return model, torch.optim.SGD(model.parameters(), lr=lr)

    def measure(model, opt, xb, yb, m: int, sync_each: bool) -> dict:
        """A warm-up step, then a tracked one (MemTracker); collectives of the tracked step,
        and the bytes live as the third block's forward is about to start in the last
        micro-batch ("at_block", by category)."""
        counters, held = [], []

        def step(mod, o, xs, ys):
            with CommCounter() as c:
                accumulate_step(mod, o, xs, ys, m, sync_each)
            counters.append(c)

        watch = model.blocks[min(2, len(model.blocks) - 1)]
        mem = tracked_peak(model, opt, xb, yb, step=step,
                           tracker_cls=_micro_batch_tracker(watch, held))
        return {"reduce_scatter": counters[-1].calls.get("reduce_scatter", 0),
                "all_gather": counters[-1].calls.get("all_gather", 0),
                "at_block": by_category(held[-1]), **mem}

    params = {}
    for name, sync_each in (("sync_each", True), ("sync_last", False)):
        model, opt = build()
        out[name] = measure(model, opt, x, y, micro_batches, sync_each)
        params[name] = _full(model)
    out["accumulation_param_diff"] = _max_diff(params["sync_last"], params["sync_each"])
    whole_model = Transformer(cfg)
    out["param_bytes"] = 4 * sum(p.numel() for p in whole_model.parameters())
    out["block_bytes"] = 4 * sum(p.numel() for p in whole_model.blocks[0].parameters())

    for name, kw in (("reshard", {}), ("prefetch_1", {"prefetch": 1}),
                     ("prefetch_2", {"prefetch": 2}),
                     ("no_reshard", {"reshard_after_forward": False})):
        model, opt = build(**kw)
        out[name] = measure(model, opt, x[:micro_batch], y[:micro_batch], 1, True)

    ref = {n: p.detach() for n, p in reference_init(cfg, seed).named_parameters()}
    for name, exact in (("naive", False), ("exact", True)):
        with torch.device("meta"):
            model = Transformer(cfg)
        shard(model, mesh).to_empty(device=device)
        if exact:
            init_sharded(model, seed)
        else:  # what a CPU mesh does with reset_parameters on DTensors
            import warnings

            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "DTensor random operators")
                torch.manual_seed(seed)
                model.reset_parameters()
            top, bottom = model.embed.weight.full_tensor().chunk(2)
            out["meta_naive_halves_equal"] = torch.equal(top, bottom)
        out[f"meta_{name}_diff"] = _max_diff(_full(model), ref)
        if exact:  # the RoPE buffers came back, and the model trains
            rope_ok = torch.equal(model.rope_cos.cpu(), Transformer(cfg).rope_cos)
            out["meta_rope_ok"] = rope_ok

    big = big or cfg

    def whole():
        torch.manual_seed(seed)
        return shard(Transformer(big).to(device), mesh)

    def meta():
        with torch.device("meta"):
            model = Transformer(big)
        shard(model, mesh).to_empty(device=device)
        return init_sharded(model, seed)

    dist.barrier()
    _, out["whole_build_peak"] = _tracked_build(whole, device)
    _, out["meta_build_peak"] = _tracked_build(meta, device)
    out["big_param_bytes"] = 4 * sum(p.numel() for p in Transformer(big).parameters())
    return out


def offload_traffic(model: str = "llama-3-8b", gpus: int = 8, seq_len: int = 8192,
                    micro_batches: int = 1, gpu: str = "h100-sxm", mfu: float = 0.5,
                    pcie_gbps: float = PCIE5_X16_GBPS) -> dict:
    """Per-GPU bytes and seconds `CPUOffloadPolicy` moves over PCIe in one step, against the
    step's compute (bf16 matmuls at `mfu` of the dense peak), FSDP over `gpus` ranks.

    FSDP2 keeps the fp32 sharded parameters on the host and copies them to the GPU before every
    all-gather (forward and, resharded, backward: 2 per micro-batch); each reduce-scattered fp32
    gradient shard goes back (once per step with `set_requires_gradient_sync(False)`, else once
    per micro-batch); the optimizer state never moves: AdamW steps on the host."""
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus must be a positive integer, got {gpus!r}")
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches must be a positive integer, got {micro_batches!r}")
    if pcie_gbps <= 0 or not 0 < mfu <= 1:
        raise ValueError(f"pcie_gbps must be > 0 and mfu in (0, 1], got {pcie_gbps}, {mfu}")
    cfg = configs.get(model)
    est = memory.estimate(memory.MemoryInputs(model=cfg, dtype="bf16", dp=gpus, zero=3,
                                              seq_len=seq_len, micro_batch=1,
                                              microbatches=micro_batches))
    shard_fp32 = 4 * est.params_per_rank / gpus
    h2d = 2 * micro_batches * shard_fp32
    d2h = shard_fp32
    compute = (flops.training_flops(cfg, seq_len)["total"] * micro_batches
               / (hardware.get(gpu).peak_flops("bf16") * mfu))
    return {"params": est.params_per_rank, "freed_bytes": est.weights + est.grads + est.optimizer,
            "h2d_bytes": h2d, "d2h_bytes": d2h, "h2d_s": h2d / (pcie_gbps * 1e9),
            "d2h_s": d2h / (pcie_gbps * 1e9), "compute_s": compute,
            "hbm_gib": est.peak / 2**30}


def hsdp_comm(model: str = "llama-3-8b", gpus: int = 64, shard_size: int = 8,
              gpu: str = "h100-sxm", micro_batches: int = 1, dtype: str = "bf16") -> dict:
    """Seconds of FSDP traffic per step (all-gathers + reduce-scatters, one per layer and
    direction) for FSDP over all `gpus` against HSDP: shard over `shard_size` GPUs of one
    NVLink domain, replicate across, where each rank all-reduces its gradient shard with its
    replicas (the same `shard_size` stride apart). Links and latencies: `step_cost.link`."""
    from ..compute.roofline import BYTES_PER_ELEMENT

    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1 \
            or gpus % shard_size:
        raise ValueError(f"shard_size must be a positive divisor of gpus={gpus}, got "
                         f"{shard_size!r}")
    cluster = Cluster(gpu=gpu, gpus=gpus)
    cfg = configs.get(model)
    psi = configs.param_counts(cfg)["total"]
    unit = psi * BYTES_PER_ELEMENT[dtype] / cfg.n_layers  # one layer's weights (or gradients)
    L, m = cfg.n_layers, micro_batches

    def gather_scatter(size: int) -> dict:
        a_g, bw_g = link(1, size, cluster, "all_gather")
        a_r, bw_r = link(1, size, cluster, "reduce_scatter")
        return {"all_gather": 2 * m * L * collective_time("all_gather", size, unit, a_g,
                                                          bw_g * 1e9),
                "reduce_scatter": L * collective_time("reduce_scatter", size, unit, a_r,
                                                      bw_r * 1e9)}

    fsdp = gather_scatter(gpus)
    hsdp = gather_scatter(shard_size)
    replicas = gpus // shard_size
    a, bw = link(shard_size, replicas, cluster, "all_reduce")
    hsdp["all_reduce"] = L * collective_time("all_reduce", replicas, unit / shard_size, a,
                                             bw * 1e9)
    fsdp["total"], hsdp["total"] = sum(fsdp.values()), sum(hsdp.values())
    states = {k: memory.zero_model_states(psi, n, 3, dtype, "adamw") / 2**30
              for k, n in (("fsdp", gpus), ("hsdp", shard_size))}
    return {"fsdp": fsdp, "hsdp": hsdp, "params": psi, "states_gib": states}
