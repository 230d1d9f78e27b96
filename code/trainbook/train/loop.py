"""The reference training loop used throughout the book.

AdamW with decoupled weight decay on matrices only (or another optimizer, `optim`), linear
warmup then cosine decay (or another schedule, `schedule`), an initialisation (`init`) and a
training objective (`objective`), gradient clipping, gradient accumulation, optional autocast
(bf16, or fp16 with a GradScaler), logging of loss, tokens/s and MFU, and checkpoints that
resume bit for bit (model, optimizer, scaler, step, RNG, data position), written atomically
and loaded with `weights_only=True`. One process on CPU or GPU, or several under `torchrun`
with DistributedDataParallel. Hooks (`hooks`) watch or change a run from outside the loop; the
monitors of `--monitor` are hooks, and `--dtype fp8-emulated` swaps the blocks' linear layers
(`emulate`) before the optimizer is built.

Chapter: book/start/first-run.
"""

from __future__ import annotations

import datetime
import os
import random
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from .. import configs
from ..bench import peak as peak_of
from ..compute.flops import training_flops_per_token, utilization
from ..data import BPETokenizer, ByteTokenizer, ShardedLoader, build_dataset, make_tokenizer
from ..launch import resolve_device
from ..layout import Layout
from ..model import Transformer
from .checkpoint import (
    AsyncCheckpointer,
    check_resume,
    checkpoint_path,
    data_digest,
    is_sharded,
    latest_checkpoint,
    load_checkpoint,
    load_sharded,
    prune_checkpoints,
    rng_state,
    save_checkpoint,
    save_sharded,
    set_rng_state,
)
from .config import TrainConfig, layout_for, model_config, parse_skips, read_layout
from .emulate import convert_linears, recipe
from .engine import Composed, Plain, global_loss
from .guard import Guard
from .hooks import Hook, StepContext, call, replace_batches
from .init import init_weights
from .monitor import make_monitors
from .objective import objective_batches, prepare_model
from .optim import make_optimizer
from .ownership import claim, identity, record_owner, take_over
from .schedule import lr_at


@dataclass
class Distributed:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_type: str, timeout_s: int) -> Distributed:
    """Join the torchrun process group when WORLD_SIZE > 1 (nccl on GPU, gloo on CPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Distributed()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=timeout_s))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return Distributed(dist.get_rank(), dist.get_world_size(), local_rank)


def peak_dtype(cfg: TrainConfig, device: torch.device) -> str:
    """The dtype whose peak MFU is measured against: the autocast dtype, or tf32 for fp32 on
    GPUs with it on; fp32 for fp8-emulated, whose matmuls are fp32 ones."""
    if cfg.dtype == "fp8-emulated":  # its matmuls run in fp32 (emulated FP8 has no peak)
        return "fp32"
    if cfg.dtype != "fp32":
        return cfg.dtype
    if device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "fp32"


@dataclass
class TrainResult:
    """What a run returns: per-step history, the trained model, and the numbers behind MFU."""

    history: list[dict]
    model: Transformer
    tokenizer: object
    model_config: configs.ModelConfig
    config: TrainConfig
    flops_per_token: float
    peak_flops: float  # per rank, FLOP/s
    peak_source: str
    val_loss: float | None
    world_size: int = 1
    layout: Layout | None = None
    stopped: str | None = None  # why a hook ended the run early (None: it ran to the end)

    def losses(self) -> list[float]:
        return [r["loss"] for r in self.history]


def train(cfg: TrainConfig, hooks: list[Hook] | tuple[Hook, ...] = ()) -> TrainResult:
    """Train the reference model as configured; returns history and model (see TrainResult).
    `hooks` run after the configured monitors, in order (`trainbook.train.hooks`). For the
    run's length a `Guard` turns SIGTERM/SIGUSR1 into a checkpoint and a clean stop, exits a
    torchrun worker whose agent died, and locks the checkpoint directory."""
    gpu = cfg.device.startswith("cuda") or (cfg.device == "auto" and torch.cuda.is_available())
    ddp = init_distributed("cuda" if gpu else "cpu", cfg.timeout_s)
    with Guard(cfg.ckpt_dir, ddp.rank) as guard:
        return _run(cfg, list(hooks), ddp, guard)


def _run(cfg: TrainConfig, hooks: list[Hook], ddp: Distributed, guard: Guard) -> TrainResult:
    device = resolve_device(cfg.device, ddp.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    log = print if ddp.is_main else (lambda *a, **k: None)
    # before any work, on every rank: may this run write into ckpt_dir? (RUN.json: its owner)
    doomed = claim(cfg.ckpt_dir, cfg.resume or bool(cfg.resume_from), cfg.overwrite) \
        if cfg.ckpt_dir else []

    tokenizer = make_tokenizer(cfg.tokenizer, cfg.vocab_size, cfg.corpus, cfg.cache_dir)
    data = build_dataset(tokenizer, cfg.seq_len, cfg.corpus)
    mcfg = model_config(cfg, tokenizer.vocab_size)

    lay = layout_for(cfg, ddp.world_size, mcfg)
    if cfg.layout:  # the layout file's micro-batch (and count), recomputation and schedule win
        row = read_layout(cfg.layout)[1]
        cfg = replace(cfg, batch_size=lay.micro_batch, recompute=lay.recompute,
                      pp_schedule=lay.pp_schedule,
                      grad_accum=row.get("micro-batches") or cfg.grad_accum)
    composed = lay.dp_shard > 1 or lay.tp > 1 or lay.pp > 1

    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    model = Transformer(mcfg).to(device)  # every rank the same weights: sharding starts whole
    init_weights(model, cfg.init, cfg.mup_base_width)
    prepare_model(model, cfg.objective)
    model.z_loss = cfg.z_loss
    if cfg.dtype == "fp8-emulated":
        convert_linears(model, recipe(cfg.fp8_recipe))
    # fp16 needs loss scaling, autocast's or the emulation's (the bf16 and fp16 recipes are the
    # emulation's baselines: the same rounding machinery without FP8's scales)
    fp16 = cfg.dtype == "fp16" or (cfg.dtype == "fp8-emulated" and cfg.fp8_recipe == "fp16")
    hooks = make_monitors(cfg.monitor, fp16_scaling=fp16) + list(hooks)
    call(hooks, "on_model", model)
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.dtype)
    autocast = (lambda: torch.autocast(device.type, dtype=amp_dtype)) if amp_dtype else nullcontext
    scaler = torch.amp.GradScaler(device.type, enabled=fp16)
    if composed:
        from .parallelize import build_mesh
        mesh = build_mesh(lay, device.type)
        dp_rank = mesh.get_local_rank("dp_replicate") * lay.dp_shard + \
            mesh.get_local_rank("dp_shard")
        engine = Composed(model, lay, mesh, device, autocast, cfg.grad_accum)
    else:
        dp_rank = ddp.rank
        from .parallelize import apply_recompute
        apply_recompute(model, cfg.recompute)
        train_model = torch.compile(model) if cfg.compile else model
        if ddp.enabled:
            from torch.nn.parallel import DistributedDataParallel as DDP
            train_model = DDP(train_model,
                              device_ids=[device.index] if device.type == "cuda" else None)
        engine = Plain(model, train_model, ddp.enabled, autocast, scaler)
    optimizer = make_optimizer(torch.nn.ModuleList(engine.parts), cfg)
    loader = ShardedLoader(data.train, cfg.batch_size, dp_rank, lay.dp, cfg.seed)
    digest = data_digest(data.train) if cfg.ckpt_dir or cfg.resume_from else None
    owner = identity(asdict(cfg), digest)

    start_step, history = 0, []
    resume_path = Path(cfg.resume_from) if cfg.resume_from else \
        (latest_checkpoint(cfg.ckpt_dir) if cfg.resume else None)
    if cfg.resume and resume_path is None:
        log(f"--resume: no checkpoint in {cfg.ckpt_dir} yet: starting at step 0")
    # the trainer resumes only from a verified checkpoint, unless told otherwise
    unverified = "warn" if cfg.allow_unverified else "refuse"
    if resume_path is not None:
        if is_sharded(resume_path):  # DCP: reshards into this layout (or one process)
            state = load_sharded(resume_path, engine.parts, optimizer, unverified)
        elif composed:
            raise ValueError(f"{resume_path} is a single-file checkpoint; a sharded layout "
                             "resumes from a DCP folder (step-NNNNNN/): resume it in one process "
                             "or with DDP, or start again")
        elif resume_path.is_file():
            state = load_checkpoint(resume_path, unverified_rule=unverified)
        else:
            raise ValueError(f"no checkpoint at {resume_path}")
        notes = check_resume(state, asdict(cfg), digest, str(resume_path))
        if state["model_config"] != mcfg.to_dict():
            raise ValueError(f"checkpoint {resume_path} holds a different model "
                             f"({state['model_config']['name']}, "
                             f"d_model {state['model_config']['d_model']}); "
                             "resume with the same model settings or use another ckpt_dir")
        if "model" in state:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            scaler.load_state_dict(state["scaler"])
        loader.load_state_dict(state["loader"])
        set_rng_state(state["rng"])
        start_step, history = state["step"], state["history"]
        log(f"resumed from {resume_path} at step {start_step}")
        for note in notes:
            log(note)

    flops_per_token = training_flops_per_token(mcfg, cfg.seq_len)
    key = peak_dtype(cfg, device)
    spec = peak_of.detect(device, key)
    peak = spec.peak_flops(key)
    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum * lay.dp

    saved = [start_step]  # the step of the newest checkpoint on disk
    writer = AsyncCheckpointer() if cfg.ckpt_async else None

    def checkpoint(step):
        if not cfg.ckpt_dir or saved[0] == step:
            return
        saved[0] = step
        if doomed:  # --overwrite: the other run's checkpoints go now, before the first write
            if ddp.is_main:
                take_over(cfg.ckpt_dir, doomed)
            if composed and dist.is_initialized():
                dist.barrier()
            doomed.clear()
        if ddp.is_main:
            record_owner(cfg.ckpt_dir, owner)
        extra = {"loader": loader.state_dict(), "rng": rng_state(), "step": step,
                 "history": history, "model_config": mcfg.to_dict(), "train_config": asdict(cfg),
                 "layout": lay.to_dict(), "data_sha256": digest}
        if composed:
            save_sharded(checkpoint_path(cfg.ckpt_dir, step, sharded=True), engine.parts,
                         optimizer, extra)
        elif ddp.is_main:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "scaler": scaler.state_dict(), **extra}
            prune = (lambda: prune_checkpoints(cfg.ckpt_dir, cfg.keep_last)) \
                if cfg.keep_last else None
            if writer:  # copy now, write in the background (then prune)
                writer.save(checkpoint_path(cfg.ckpt_dir, step), state, after=prune)
                return
            save_checkpoint(checkpoint_path(cfg.ckpt_dir, step), state)
        if cfg.keep_last and ddp.is_main:
            prune_checkpoints(cfg.ckpt_dir, cfg.keep_last)

    from tqdm.auto import tqdm
    bar = tqdm(range(start_step, cfg.steps), initial=start_step, total=cfg.steps,
               disable=not (cfg.progress and ddp.is_main), desc="train")
    for part in engine.parts:
        part.train()
    last = cfg.steps if cfg.stop_after is None else min(cfg.steps, cfg.stop_after)
    skips = {first: last_ - first + 1 for first, last_ in parse_skips(cfg.skip_batches)}
    stopped = None
    for step in bar:
        if step >= last or stopped:
            break
        t0 = time.perf_counter()
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        for _ in range(skips.get(step + 1, 0) * cfg.grad_accum):  # never trained on
            loader.next_batch()
        batches = [tuple(t.to(device) for t in loader.next_batch()) for _ in range(cfg.grad_accum)]
        batches = objective_batches(cfg.objective, batches, mcfg.vocab_size,
                                    (cfg.seed, dp_rank, step))  # clm: unchanged
        batches = replace_batches(hooks, step + 1, batches)  # a hook may plant or drop data
        loss = engine.step(batches)
        norm = engine.clip(optimizer, cfg.grad_clip or float("inf"))
        ctx = None
        if hooks:
            ctx = StepContext(step + 1, model, optimizer, batches, global_loss(loss, device),
                              norm.item(), engine.autocast, scaler.get_scale()
                              if scaler.is_enabled() else 1.0)
            stopped = call(hooks, "before_update", ctx)
        if stopped:  # the weights stay as they were before this step
            optimizer.zero_grad(set_to_none=True)
            break
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        loss_val = global_loss(loss, device)  # synchronises: the step time below is real
        dt = time.perf_counter() - t0
        tps = tokens_per_step / dt
        rec = {"step": step + 1, "loss": loss_val, "lr": lr, "grad_norm": norm.item(),
               "step_time_s": dt, "tokens_per_s": tps,
               "mfu": utilization(flops_per_token * tokens_per_step, dt, peak, ddp.world_size)}
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0:
            rec["val_loss"] = engine.evaluate(data.val, cfg.batch_size, cfg.eval_batches, device)
        if ctx is not None:
            ctx.record = rec
            stopped = call(hooks, "after_update", ctx)
        history.append(rec)
        bar.set_postfix(loss=f"{loss_val:.3f}")
        if cfg.log_every and ((step + 1) % cfg.log_every == 0 or step == start_step):
            log(f"step {step + 1:5d} | loss {loss_val:.4f} | lr {lr:.2e} "
                f"| gnorm {rec['grad_norm']:.2f} | {tps:,.0f} tok/s | MFU {rec['mfu']:.1%}")
        if cfg.ckpt_every and (step + 1) % cfg.ckpt_every == 0:
            checkpoint(step + 1)
        signalled = guard.stop_requested(device)
        if signalled:  # SIGTERM or the scheduler's warning: checkpoint now, then stop
            stopped = f"{signalled} received"
            checkpoint(step + 1)
    bar.close()
    done = len(history)
    if stopped:
        log(f"stopped after step {done}: {stopped}")
    if cfg.ckpt_dir:  # every run saves where it ended (a no-op if that step is saved)
        checkpoint(done)
    if writer:
        writer.wait()  # the last checkpoint is on disk before the run returns
    val = engine.evaluate(data.val, cfg.batch_size, cfg.eval_batches, device)
    if cfg.log_every:
        log(f"done: {done} steps, validation loss {val:.4f}")
    result = TrainResult(history, model, tokenizer, mcfg, cfg, flops_per_token, peak,
                         spec.source, val, ddp.world_size, lay, stopped)
    call(hooks, "on_end", result)
    return result


def generate_text(model: Transformer, tokenizer: ByteTokenizer | BPETokenizer, prompt: str,
                  max_new_tokens: int = 200, temperature: float = 0.8, top_k: int | None = 50,
                  seed: int = 0) -> str:
    """Sample a continuation of `prompt` from a trained model, reproducibly (seeded)."""
    device = next(model.parameters()).device
    ids = tokenizer.encode(prompt) or [0]
    g = torch.Generator(device=device).manual_seed(seed)
    out = model.generate(torch.tensor([ids], device=device), max_new_tokens, temperature, top_k, g)
    return tokenizer.decode(out[0].tolist())
