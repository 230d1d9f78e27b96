"""The reference training loop used throughout the book.

AdamW with decoupled weight decay on matrices only, linear warmup then cosine decay, gradient
clipping, gradient accumulation, optional autocast (bf16, or fp16 with a GradScaler), logging of
loss, tokens/s and MFU, and checkpoints that resume bit for bit (model, optimizer, scaler, step,
RNG, data position), written atomically and loaded with `weights_only=True`. One process on CPU
or GPU, or several under `torchrun` with DistributedDataParallel.
"""

from __future__ import annotations

import datetime
import math
import os
import random
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import torch.distributed as dist

from . import configs
from .bench import peak as peak_of
from .compute.flops import training_flops_per_token, utilization
from .data import ShardedLoader, build_dataset, make_tokenizer
from .model import Transformer


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


def save_checkpoint(path: str | Path, state: dict) -> None:
    """torch.save to a temporary file, then rename: a crash never leaves a half-written checkpoint."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def checkpoint_path(ckpt_dir: str | Path, step: int) -> Path:
    return Path(ckpt_dir) / f"step-{step:06d}.pt"


def latest_checkpoint(ckpt_dir: str | Path) -> Path | None:
    """The highest-step checkpoint in ckpt_dir, or None when there is none yet."""
    found = sorted(Path(ckpt_dir).glob("step-*.pt"))
    return found[-1] if found else None


def load_checkpoint(path: str | Path) -> dict:
    """Load with weights_only=True: a checkpoint cannot run code."""
    return torch.load(path, map_location="cpu", weights_only=True)


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


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

    def losses(self) -> list[float]:
        return [r["loss"] for r in self.history]


@torch.no_grad()
def evaluate(model, blocks: torch.Tensor, batch_size: int, batches: int, device, autocast) -> float:
    """Mean loss over the first `batches` batches of `blocks` (a fixed, comparable set)."""
    was_training = model.training
    model.eval()
    losses = []
    for i in range(min(batches, max(1, len(blocks) // batch_size))):
        block = blocks[i * batch_size:(i + 1) * batch_size].to(device)
        with autocast():
            losses.append(model(block[:, :-1], block[:, 1:])[1].item())
    model.train(was_training)
    return sum(losses) / len(losses)


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

    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    model = Transformer(mcfg).to(device)
    optimizer = make_optimizer(model, cfg)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.dtype == "fp16")
    loader = ShardedLoader(data.train, cfg.batch_size, ddp.rank, ddp.world_size, cfg.seed)
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.dtype)
    autocast = (lambda: torch.autocast(device.type, dtype=amp_dtype)) if amp_dtype else nullcontext

    start_step, history = 0, []
    resume_path = Path(cfg.resume_from) if cfg.resume_from else \
        (latest_checkpoint(cfg.ckpt_dir) if cfg.resume else None)
    if resume_path is not None:
        if not resume_path.is_file():
            raise ValueError(f"no checkpoint at {resume_path}")
        state = load_checkpoint(resume_path)
        if state["model_config"] != mcfg.to_dict():
            raise ValueError(f"checkpoint {resume_path} holds a different model "
                             f"({state['model_config']['name']}, d_model {state['model_config']['d_model']}); "
                             "resume with the same model settings or use another ckpt_dir")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        loader.load_state_dict(state["loader"])
        _set_rng_state(state["rng"])
        start_step, history = state["step"], state["history"]
        log(f"resumed from {resume_path} at step {start_step}")

    train_model = model
    if cfg.compile:
        train_model = torch.compile(model)
    if ddp.enabled:
        from torch.nn.parallel import DistributedDataParallel as DDP
        train_model = DDP(train_model, device_ids=[device.index] if device.type == "cuda" else None)

    flops_per_token = training_flops_per_token(mcfg, cfg.seq_len)
    key = peak_dtype(cfg, device)
    spec = peak_of.detect(device, key)
    peak = spec.peak_flops(key)
    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum * ddp.world_size

    def checkpoint(step):
        if ddp.is_main and cfg.ckpt_dir:
            save_checkpoint(checkpoint_path(cfg.ckpt_dir, step), {
                "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict(), "loader": loader.state_dict(), "rng": _rng_state(),
                "step": step, "history": history, "model_config": mcfg.to_dict(),
                "train_config": asdict(cfg)})

    from tqdm.auto import tqdm
    bar = tqdm(range(start_step, cfg.steps), initial=start_step, total=cfg.steps,
               disable=not (cfg.progress and ddp.is_main), desc="train")
    model.train()
    last = cfg.steps if cfg.stop_after is None else min(cfg.steps, cfg.stop_after)
    for step in bar:
        if step >= last:
            break
        t0 = time.perf_counter()
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), device=device)
        for micro in range(cfg.grad_accum):
            x, y = (t.to(device) for t in loader.next_batch())
            sync = not ddp.enabled or micro == cfg.grad_accum - 1
            with (nullcontext() if sync else train_model.no_sync()), autocast():
                _, loss = train_model(x, y)
            scaler.scale(loss / cfg.grad_accum).backward()
            loss_sum += loss.detach()
        scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or float("inf"))
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        loss_val = loss_sum / cfg.grad_accum
        if ddp.enabled:  # log the global mean loss (gloo has no ReduceOp.AVG)
            dist.all_reduce(loss_val)
            loss_val /= ddp.world_size
        loss_val = loss_val.item()  # synchronises: the step time below is real
        dt = time.perf_counter() - t0
        tps = tokens_per_step / dt
        rec = {"step": step + 1, "loss": loss_val, "lr": lr, "grad_norm": norm.item(),
               "step_time_s": dt, "tokens_per_s": tps,
               "mfu": utilization(flops_per_token * tokens_per_step, dt, peak, ddp.world_size)}
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0:
            rec["val_loss"] = evaluate(model, data.val, cfg.batch_size, cfg.eval_batches, device, autocast)
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
    val = evaluate(model, data.val, cfg.batch_size, cfg.eval_batches, device, autocast)
    if cfg.log_every:
        log(f"done: {done} steps, validation loss {val:.4f}")
    return TrainResult(history, model, tokenizer, mcfg, cfg, flops_per_token, peak, spec.source, val,
                       ddp.world_size)


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
