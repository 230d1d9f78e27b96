"""The reference training loop used throughout the book.

AdamW with decoupled weight decay on matrices only, linear warmup then cosine decay, gradient
clipping, gradient accumulation, optional autocast (bf16, or fp16 with a GradScaler), logging of
loss, tokens/s and MFU, and checkpoints that resume bit for bit (model, optimizer, scaler, step,
RNG, data position), written atomically and loaded with `weights_only=True`. One process on CPU
or GPU, or several under `torchrun` with DistributedDataParallel.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import random
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch
import torch.distributed as dist

from .. import configs
from ..bench import peak as peak_of
from ..compute.flops import training_flops_per_token, utilization
from ..data import ShardedLoader, build_dataset, make_tokenizer
from ..layout import PP_SCHEDULES, RECOMPUTE, Layout, check_layout
from ..model import Transformer
from .parallelize import VIRTUAL
from .checkpoint import (checkpoint_path, is_sharded, latest_checkpoint, load_checkpoint,
                         load_sharded, rng_state, save_checkpoint, save_sharded, set_rng_state)
from .engine import Composed, Plain, evaluate, global_loss  # noqa: F401 (evaluate: public)


def _opt(default, help):  # a TrainConfig field whose help text becomes the CLI's --help
    return field(default=default, metadata={"help": help})


@dataclass
class TrainConfig:
    model: str = _opt("tiny-llama", "preset name or path to a Hugging Face config.json")
    d_model: int | None = _opt(None, "override the preset's hidden size")
    n_layers: int | None = _opt(None, "override the preset's number of layers")
    n_heads: int | None = _opt(None, "override the preset's number of attention heads")
    n_kv_heads: int | None = _opt(None, "override the preset's number of key/value heads")
    d_ff: int | None = _opt(None, "override the preset's MLP hidden size")
    tokenizer: str = _opt("bpe", "'bpe' (trained on the corpus) or 'bytes'")
    vocab_size: int = _opt(1024, "BPE vocabulary size (ignored for bytes)")
    corpus: str = _opt("tinyshakespeare", "shipped corpus to train on")
    seq_len: int = _opt(128, "tokens per sequence")
    batch_size: int = _opt(16, "sequences per micro-batch per rank")
    grad_accum: int = _opt(1, "micro-batches accumulated per optimizer step")
    steps: int = _opt(200, "optimizer steps")
    lr: float = _opt(3e-3, "peak learning rate")
    min_lr_ratio: float = _opt(0.1, "final learning rate as a fraction of the peak")
    warmup_steps: int = _opt(20, "linear warmup steps")
    weight_decay: float = _opt(0.1, "AdamW weight decay (matrices only)")
    beta1: float = _opt(0.9, "AdamW beta1")
    beta2: float = _opt(0.95, "AdamW beta2")
    grad_clip: float = _opt(1.0, "clip the global gradient norm to this (0: off)")
    dtype: str = _opt("fp32", "autocast dtype: fp32 (off), bf16, or fp16 (with loss scaling)")
    seed: int = _opt(0, "seed for initialisation and data order")
    device: str = _opt("auto", "'auto', 'cpu', 'cuda' (under torchrun: cuda:LOCAL_RANK)")
    compile: bool = _opt(False, "torch.compile the model")
    log_every: int = _opt(10, "print a log line every this many steps (0: never)")
    eval_every: int = _opt(0, "validation loss every this many steps (0: only at the end)")
    eval_batches: int = _opt(8, "validation batches per evaluation")
    ckpt_dir: str | None = _opt(None, "directory for checkpoints (none: no checkpoints)")
    ckpt_every: int = _opt(0, "save a checkpoint every this many steps (0: only at the end)")
    resume: bool = _opt(False, "resume from the newest checkpoint in ckpt_dir, if there is one")
    resume_from: str | None = _opt(None, "resume from this checkpoint file")
    stop_after: int | None = _opt(None, "stop after this step, as if interrupted (for demos)")
    timeout_s: int = _opt(300, "torch.distributed collective timeout, seconds")
    dp_replicate: int = _opt(1, "data-parallel replicas: DDP, or with dp_shard > 1 HSDP's "
                                "replicate dimension (under torchrun with every degree 1: all ranks)")
    dp_shard: int = _opt(1, "ranks FSDP2 shards parameters, gradients and optimizer state over")
    tp: int = _opt(1, "tensor-parallel ranks (DTensor TP with sequence parallel, loss parallel)")
    pp: int = _opt(1, "pipeline stages' ranks (torch.distributed.pipelining; micro-batches: "
                      "grad_accum)")
    pp_schedule: str = _opt("1f1b", "gpipe, 1f1b, interleaved-1f1b or zbv (2 stages per rank)")
    cp: int = _opt(1, "context-parallel ranks (needs CUDA SDPA kernels: refused on CPU)")
    recompute: str = _opt("none", "activation recomputation: none, selective (keep matmul "
                                  "outputs) or full (keep block inputs)")
    layout: str | None = _opt(None, "JSON file with a layout (a `plan --json` output or one of "
                                    "its layouts): sets dp, tp, pp, ZeRO, micro-batch, recompute")
    progress: bool = _opt(True, "show a progress bar")
    cache_dir: str | None = _opt(None, "directory to cache the trained tokenizer")

    def __post_init__(self):
        positive = ("seq_len", "batch_size", "grad_accum", "steps", "eval_batches", "vocab_size",
                    "timeout_s")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup_steps < 0 or self.warmup_steps > self.steps:
            raise ValueError(f"warmup_steps must be in [0, steps={self.steps}], got {self.warmup_steps}")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"need lr > 0 and min_lr_ratio in [0, 1], got {self.lr}, {self.min_lr_ratio}")
        if self.dtype not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"dtype must be fp32, bf16 or fp16, got {self.dtype!r}")
        if self.grad_clip < 0 or self.weight_decay < 0:
            raise ValueError("grad_clip and weight_decay must be >= 0")
        for name in ("log_every", "eval_every", "ckpt_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: off), got {getattr(self, name)}")
        if self.stop_after is not None and self.stop_after < 1:
            raise ValueError(f"stop_after must be >= 1 (or None), got {self.stop_after}")
        if (self.ckpt_every or self.resume) and not self.ckpt_dir:
            raise ValueError("ckpt_every and resume need ckpt_dir")
        for name in ("dp_replicate", "dp_shard", "tp", "pp", "cp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, "
                             f"got {self.recompute!r}")
        if self.pp_schedule not in PP_SCHEDULES:
            raise ValueError(f"pp_schedule must be one of {', '.join(PP_SCHEDULES)}, "
                             f"got {self.pp_schedule!r}")
        if self.layout is not None and not Path(self.layout).is_file():
            raise ValueError(f"layout file {self.layout!r} does not exist; write one with "
                             "python -m trainbook plan ... --json > layout.json")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to cfg.lr over warmup_steps, then cosine decay to min_lr_ratio * lr at cfg.steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def model_config(cfg: TrainConfig, vocab_size: int) -> configs.ModelConfig:
    """The preset with the tokenizer's vocabulary, the training context and any size overrides."""
    overrides = {k: getattr(cfg, k) for k in ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff")
                 if getattr(cfg, k) is not None}
    base = configs.resolve(cfg.model)
    return base.with_(vocab_size=vocab_size, max_seq_len=cfg.seq_len, **overrides)


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not on norms, biases)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))


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
    return Distributed(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


def resolve_device(name: str, ddp: Distributed) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if name != "cuda" and not name.removeprefix("cuda:").isdigit():
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {name!r}")
        if not torch.cuda.is_available():
            raise ValueError("device 'cuda' asked for, but torch.cuda.is_available() is False")
        return torch.device("cuda", ddp.local_rank if name == "cuda" else int(name[5:]))
    if name != "cpu":
        raise ValueError(f"device must be auto, cpu or cuda[:N], got {name!r}")
    return torch.device("cpu")


def peak_dtype(cfg: TrainConfig, device: torch.device) -> str:
    """The dtype whose peak MFU is measured against: the autocast dtype, tf32 for fp32 on GPUs with it on."""
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

    def losses(self) -> list[float]:
        return [r["loss"] for r in self.history]


def read_layout(path: str) -> tuple[Layout, dict]:
    """A layout from a JSON file: one layout's fields, or `plan --json` output (its first
    layout, the best ranked); returns the layout and the JSON object it came from."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read layout file {path}: {e}") from None
    if isinstance(data, dict) and "layouts" in data:
        if not data["layouts"]:
            raise ValueError(f"{path} lists no feasible layout; plan with more GPUs")
        data = data["layouts"][0]
    if not isinstance(data, dict) or not set(data) & set(Layout.__dataclass_fields__):
        raise ValueError(f"{path} holds no layout: give a JSON object with some of "
                         f"{', '.join(Layout.__dataclass_fields__)}")
    return Layout.from_dict(data), data


def layout_for(cfg: TrainConfig, world: int, mcfg: configs.ModelConfig) -> Layout:
    """The layout this run trains under, checked against the model, the launch and the device.

    Degrees come from the options (or a layout file). Every degree 1 under torchrun means DDP
    over all ranks, as before layouts existed."""
    if cfg.layout:  # the file decides; a planner's interleave 2 is interleaved 1F1B here
        lay = read_layout(cfg.layout)[0]
        if lay.interleave > 1 and VIRTUAL[lay.pp_schedule] == 1:
            lay = replace(lay, pp_schedule="interleaved-1f1b")
        if lay.pp > 1 and lay.interleave != VIRTUAL[lay.pp_schedule]:
            raise ValueError(f"interleave {lay.interleave} does not match pp_schedule "
                             f"{lay.pp_schedule} ({VIRTUAL[lay.pp_schedule]} stages per rank)")
    else:
        R, S = cfg.dp_replicate, cfg.dp_shard
        if world > 1 and R == S == cfg.tp == cfg.pp == cfg.cp == 1:
            R = world
        lay = Layout(dp=R * S, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp, zero=3 if S > 1 else 0,
                     dp_replicate=R if S > 1 else 1, micro_batch=cfg.batch_size,
                     recompute=cfg.recompute, pp_schedule=cfg.pp_schedule,
                     interleave=VIRTUAL[cfg.pp_schedule] if cfg.pp > 1 else 1)
    check_layout(lay, mcfg, cfg.seq_len)
    if lay.cp > 1:
        raise ValueError("context parallelism in the trainer needs PyTorch's CUDA attention "
                         "kernels; on a CPU run the from-scratch version: python -m trainbook cp")
    if lay.ep > 1:
        raise ValueError("expert parallelism is not in the trainer yet: python -m trainbook ep "
                         "runs the from-scratch version")
    stages = lay.pp * VIRTUAL[lay.pp_schedule] if lay.pp > 1 else 1
    if lay.pp > 1 and mcfg.n_layers % stages:
        raise ValueError(f"{mcfg.n_layers} layers do not split into {stages} equal pipeline "
                         f"stages ({lay.pp} ranks x {VIRTUAL[lay.pp_schedule]} per rank with "
                         f"{lay.pp_schedule}); pick pp and a schedule that divide the layers")
    if lay.pp > 1 and lay.pp_schedule == "zbv":
        raise ValueError("the zbv schedule is in the pipeline chapter (python -m trainbook "
                         "pipeline demos), not the trainer: in torch 2.13 its eval fails and, "
                         "with FSDP2, its split weight gradients skip the reduce-scatter; use "
                         "gpipe, 1f1b or interleaved-1f1b")
    if lay.pp > 1 and mcfg.tied:
        raise ValueError(f"{mcfg.name} ties its embedding and head, which live on different "
                         "pipeline stages; the trainer's pipeline needs an untied model (llama)")
    if lay.pp > 1 and cfg.grad_accum < stages:
        raise ValueError(f"the pipeline runs grad_accum micro-batches per step: give "
                         f"--grad-accum >= {stages} to fill {stages} stages")
    composed = lay.dp_shard > 1 or lay.tp > 1 or lay.pp > 1
    if composed and cfg.dtype == "fp16":
        raise ValueError("fp16 loss scaling is wired for one process and DDP only; "
                         "use --dtype bf16 with FSDP, TP or PP")
    if composed and cfg.compile:
        raise ValueError("--compile is wired for one process and DDP only")
    if lay.gpus != world:
        raise ValueError(f"layout {lay.short()} needs {lay.gpus} ranks but {world} were "
                         f"started: use torchrun --nproc_per_node {lay.gpus}, or change the layout")
    return lay


def train(cfg: TrainConfig) -> TrainResult:
    """Train the reference model as configured; returns history and model (see TrainResult)."""
    ddp = init_distributed("cuda" if cfg.device.startswith("cuda") or
                           (cfg.device == "auto" and torch.cuda.is_available()) else "cpu", cfg.timeout_s)
    device = resolve_device(cfg.device, ddp)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    log = print if ddp.is_main else (lambda *a, **k: None)

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
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.dtype)
    autocast = (lambda: torch.autocast(device.type, dtype=amp_dtype)) if amp_dtype else nullcontext
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.dtype == "fp16")
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

    start_step, history = 0, []
    resume_path = Path(cfg.resume_from) if cfg.resume_from else \
        (latest_checkpoint(cfg.ckpt_dir) if cfg.resume else None)
    if resume_path is not None:
        if is_sharded(resume_path):  # DCP: reshards into this layout (or one process)
            state = load_sharded(resume_path, engine.parts, optimizer)
        elif composed:
            raise ValueError(f"{resume_path} is a single-file checkpoint; a sharded layout "
                             "resumes from a DCP folder (step-NNNNNN/): resume it in one process "
                             "or with DDP, or start again")
        elif resume_path.is_file():
            state = load_checkpoint(resume_path)
        else:
            raise ValueError(f"no checkpoint at {resume_path}")
        if state["model_config"] != mcfg.to_dict():
            raise ValueError(f"checkpoint {resume_path} holds a different model "
                             f"({state['model_config']['name']}, d_model {state['model_config']['d_model']}); "
                             "resume with the same model settings or use another ckpt_dir")
        if "model" in state:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            scaler.load_state_dict(state["scaler"])
        loader.load_state_dict(state["loader"])
        set_rng_state(state["rng"])
        start_step, history = state["step"], state["history"]
        log(f"resumed from {resume_path} at step {start_step}")

    flops_per_token = training_flops_per_token(mcfg, cfg.seq_len)
    key = peak_dtype(cfg, device)
    spec = peak_of.detect(device, key)
    peak = spec.peak_flops(key)
    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum * lay.dp

    def checkpoint(step):
        if not cfg.ckpt_dir:
            return
        extra = {"loader": loader.state_dict(), "rng": rng_state(), "step": step,
                 "history": history, "model_config": mcfg.to_dict(), "train_config": asdict(cfg),
                 "layout": lay.to_dict()}
        if composed:
            save_sharded(checkpoint_path(cfg.ckpt_dir, step, sharded=True), engine.parts,
                         optimizer, extra)
        elif ddp.is_main:
            save_checkpoint(checkpoint_path(cfg.ckpt_dir, step), {
                "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict(), **extra})

    from tqdm.auto import tqdm
    bar = tqdm(range(start_step, cfg.steps), initial=start_step, total=cfg.steps,
               disable=not (cfg.progress and ddp.is_main), desc="train")
    for part in engine.parts:
        part.train()
    last = cfg.steps if cfg.stop_after is None else min(cfg.steps, cfg.stop_after)
    for step in bar:
        if step >= last:
            break
        t0 = time.perf_counter()
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batches = [tuple(t.to(device) for t in loader.next_batch()) for _ in range(cfg.grad_accum)]
        loss = engine.step(batches)
        norm = engine.clip(optimizer, cfg.grad_clip or float("inf"))
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
        history.append(rec)
        bar.set_postfix(loss=f"{loss_val:.3f}")
        if cfg.log_every and ((step + 1) % cfg.log_every == 0 or step == start_step):
            log(f"step {step + 1:5d} | loss {loss_val:.4f} | lr {lr:.2e} | gnorm {rec['grad_norm']:.2f} "
                f"| {tps:,.0f} tok/s | MFU {rec['mfu']:.1%}")
        if cfg.ckpt_every and (step + 1) % cfg.ckpt_every == 0:
            checkpoint(step + 1)
    bar.close()
    done = len(history)
    if cfg.ckpt_dir and not cfg.ckpt_every:
        checkpoint(done)
    val = engine.evaluate(data.val, cfg.batch_size, cfg.eval_batches, device)
    if cfg.log_every:
        log(f"done: {done} steps, validation loss {val:.4f}")
    return TrainResult(history, model, tokenizer, mcfg, cfg, flops_per_token, peak, spec.source, val,
                       ddp.world_size, lay)


def generate_text(model: Transformer, tokenizer, prompt: str, max_new_tokens: int = 200,
                  temperature: float = 0.8, top_k: int | None = 50, seed: int = 0) -> str:
    """Sample a continuation of `prompt` from a trained model, reproducibly (seeded)."""
    device = next(model.parameters()).device
    ids = tokenizer.encode(prompt) or [0]
    g = torch.Generator(device=device).manual_seed(seed)
    out = model.generate(torch.tensor([ids], device=device), max_new_tokens, temperature, top_k, g)
    return tokenizer.decode(out[0].tolist())


def config_fields() -> list:
    """TrainConfig's fields with their help text (the CLI builds its options from these)."""
    return list(fields(TrainConfig))
