"""The trainer's configuration: one option per field, and the layout a configuration asks for.

`TrainConfig`'s fields carry their help text, so `python -m trainbook train --help` documents
every option from here. `layout_for` turns the parallelism options (or a layout file written by
`python -m trainbook plan --json`) into one `trainbook.layout.Layout`, checked against the
model, the launch and what the trainer implements, before any work is done.

Chapter: book/start/first-run; book/parallelism/putting-it-together.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from .. import configs
from ..layout import PP_SCHEDULES, RECOMPUTE, Layout, check_layout
from .emulate import RECIPES
from .monitor import make_monitors
from .objective import special_tokens
from .parallelize import VIRTUAL

# the choices each trainer module implements (train/objective.py, optim.py, schedule.py, init.py)
OBJECTIVES = ("clm", "mlm", "span", "prefix")
OPTIMIZERS = ("adamw", "adam", "sgd", "adafactor", "lion", "muon")
SCHEDULES = ("cosine", "wsd", "linear", "constant")
DECAY_SHAPES = ("1-sqrt", "linear")  # the shapes of WSD's final decay (train/schedule.py)
INITS = ("scaled", "standard", "mup")
DTYPES = ("fp32", "bf16", "fp16", "fp8-emulated")


def parse_skips(text: str) -> list[tuple[int, int]]:
    """'120-180,300-320' -> [(120, 180), (300, 320)]: 1-based step ranges, inclusive, whose
    batches are skipped (PaLM's recipe after a spike); '' -> []."""
    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        first, sep, last = part.partition("-")
        try:
            a, b = int(first), int(last if sep else first)
        except ValueError:
            raise ValueError(f"skip_batches: {part!r} is not a step range; write FIRST-LAST, "
                             "e.g. 120-180 (comma-separated for several)") from None
        if not 1 <= a <= b:
            raise ValueError(f"skip_batches: {part!r} must have 1 <= FIRST <= LAST")
        if out and a <= out[-1][1]:
            raise ValueError(f"skip_batches: ranges must be in order and not overlap, got {text!r}")
        out.append((a, b))
    return out


def decay_start(steps: int, decay_frac: float) -> int:
    """The step WSD's final decay starts at: the last decay_frac of the run, rounded to the
    nearest step (half up) and at least one step, decays (train/schedule.py)."""
    return steps - max(1, math.floor(decay_frac * steps + 0.5))


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
    tokenizer: str = _opt("bpe", "'bpe' (trained on the corpus), 'bytes', or the path of a "
                                 "tokenizers JSON file (its own vocabulary)")
    vocab_size: int = _opt(1024, "BPE vocabulary size (ignored for bytes)")
    corpus: str = _opt("tinyshakespeare", "shipped corpus, or the path of a UTF-8 text file "
                                          "(its last tenth is the validation split)")
    seq_len: int = _opt(128, "tokens per sequence")
    batch_size: int = _opt(16, "sequences per micro-batch per rank")
    grad_accum: int = _opt(1, "micro-batches accumulated per optimizer step")
    steps: int = _opt(200, "optimizer steps")
    objective: str = _opt("clm", "training objective: " + ", ".join(OBJECTIVES))
    optimizer: str = _opt("adamw", "optimizer: " + ", ".join(OPTIMIZERS))
    schedule: str = _opt("cosine", "learning-rate schedule: " + ", ".join(SCHEDULES))
    decay_frac: float = _opt(0.2, "wsd: share of the steps in the final decay (the cooldown)")
    decay_shape: str = _opt("1-sqrt", "wsd: shape of the final decay: " + ", ".join(DECAY_SHAPES))
    init: str = _opt("scaled", "weight initialisation: " + ", ".join(INITS))
    mup_base_width: int | None = _opt(None, "muP's base d_model, whose tuned learning rate "
                                            "transfers (default: the preset's); scale d_ff "
                                            "with d_model, keep the heads")
    lr: float = _opt(3e-3, "peak learning rate")
    min_lr_ratio: float = _opt(0.1, "final learning rate as a fraction of the peak")
    warmup_steps: int = _opt(20, "linear warmup steps")
    weight_decay: float = _opt(0.1, "AdamW weight decay (matrices only)")
    beta1: float = _opt(0.9, "AdamW beta1")
    beta2: float = _opt(0.95, "AdamW beta2")
    grad_clip: float = _opt(1.0, "clip the global gradient norm to this (0: off)")
    dtype: str = _opt("fp32", "autocast dtype: fp32 (off), bf16, fp16 (with loss scaling), or "
                              "fp8-emulated (the blocks' linear layers with FP8 numerics, "
                              "emulated in fp32: --fp8-recipe)")
    fp8_recipe: str = _opt("tensorwise", "fp8-emulated: how operands are rounded and scaled: "
                                         + ", ".join(RECIPES) + " (bf16 and fp16: the same "
                                         "emulation without scales, a baseline; fp16 with loss "
                                         "scaling)")
    qk_norm: bool = _opt(False, "normalise queries and keys per head (QK-norm): bounds the "
                                "attention logits")
    z_loss: float = _opt(0.0, "PaLM's z-loss coefficient (1e-4 in PaLM): keeps the output "
                              "logits' normaliser near 1")
    embed_scale: float = _opt(1.0, "multiply the token embeddings by this (Gemma: "
                                   "sqrt(d_model))")
    monitor: str = _opt("", "monitors, comma-separated: spikes (loss and update-norm z-scores), "
                            "nan (stop at the first inf/NaN and name the module), grad-norms "
                            "(each block's gradient norm before clipping), fingerprint "
                            "(a per-step digest of the parameters, to compare runs)")
    skip_batches: str = _opt("", "step ranges whose batches are never trained on, e.g. 120-180 "
                                 "(PaLM's restart-and-skip after a spike)")
    seed: int = _opt(0, "seed for initialisation and data order")
    device: str = _opt("auto", "'auto', 'cpu', 'cuda' (under torchrun: cuda:LOCAL_RANK)")
    compile: bool = _opt(False, "torch.compile the model")
    log_every: int = _opt(10, "print a log line every this many steps (0: never)")
    eval_every: int = _opt(0, "validation loss every this many steps (0: only at the end)")
    eval_batches: int = _opt(8, "validation batches per evaluation")
    ckpt_dir: str | None = _opt(None, "directory for checkpoints (none: no checkpoints)")
    ckpt_every: int = _opt(0, "save a checkpoint every this many steps (0: only at the end)")
    keep_last: int = _opt(0, "keep only the newest this many checkpoints in ckpt_dir (0: all)")
    ckpt_async: bool = _opt(False, "write checkpoints in a background thread: the step pays "
                                   "for a copy of the state, not the write (one process, DDP)")
    resume: bool = _opt(False, "resume from the newest checkpoint in ckpt_dir, if there is one")
    resume_from: str | None = _opt(None, "resume from this checkpoint file")
    overwrite: bool = _opt(False, "start a new run in a ckpt_dir that holds another run's "
                                  "checkpoints: they are deleted when this run writes its first")
    allow_unverified: bool = _opt(False, "resume from a checkpoint that has no recorded checksum "
                                         "(SHA256SUMS), with a warning: nothing vouches for its "
                                         "bytes")
    stop_after: int | None = _opt(None, "stop after this step, as if interrupted (for demos)")
    timeout_s: int = _opt(300, "torch.distributed collective timeout, seconds")
    dp_replicate: int = _opt(1, "data-parallel replicas: DDP, or with dp_shard > 1 HSDP's "
                                "replicate dimension (under torchrun with every degree 1: all "
                                "ranks)")
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
            raise ValueError(f"warmup_steps must be in [0, steps={self.steps}], "
                             f"got {self.warmup_steps}: set --warmup-steps to at most "
                             f"{self.steps} (e.g. {self.steps // 10}, a tenth of the run)")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"need lr > 0 and min_lr_ratio in [0, 1], "
                             f"got {self.lr}, {self.min_lr_ratio}")
        for name, choices in (("objective", OBJECTIVES), ("optimizer", OPTIMIZERS),
                              ("schedule", SCHEDULES), ("init", INITS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {', '.join(choices)}, "
                                 f"got {getattr(self, name)!r}")
        if self.mup_base_width is not None and self.mup_base_width < 1:
            raise ValueError(f"mup_base_width must be >= 1 (or None), got {self.mup_base_width}")
        if not 0 < self.decay_frac <= 1:
            raise ValueError(f"decay_frac must be in (0, 1] (the share of the steps in WSD's "
                             f"final decay), got {self.decay_frac}")
        if self.decay_shape not in DECAY_SHAPES:
            raise ValueError(f"decay_shape must be one of {', '.join(DECAY_SHAPES)}, "
                             f"got {self.decay_shape!r}")
        if self.schedule == "wsd" and decay_start(self.steps, self.decay_frac) < self.warmup_steps:
            raise ValueError(f"wsd: {self.warmup_steps} warmup steps and a decay over the last "
                             f"{self.decay_frac:g} of {self.steps} steps do not fit in "
                             f"{self.steps} steps; lower warmup_steps or decay_frac")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.fp8_recipe not in RECIPES:
            raise ValueError(f"fp8_recipe must be one of {', '.join(RECIPES)}, "
                             f"got {self.fp8_recipe!r}")
        if not self.z_loss >= 0 or self.z_loss == float("inf"):
            raise ValueError(f"z_loss must be >= 0 (PaLM: 1e-4), got {self.z_loss}")
        if not 0 < self.embed_scale < float("inf"):
            raise ValueError(f"embed_scale must be positive, got {self.embed_scale}")
        make_monitors(self.monitor)
        parse_skips(self.skip_batches)
        if self.grad_clip < 0 or self.weight_decay < 0:
            raise ValueError("grad_clip and weight_decay must be >= 0")
        for name in ("log_every", "eval_every", "ckpt_every", "keep_last"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: off), got {getattr(self, name)}")
        if self.stop_after is not None and self.stop_after < 1:
            raise ValueError(f"stop_after must be >= 1 (or None), got {self.stop_after}")
        if (self.ckpt_every or self.resume or self.keep_last or self.overwrite) \
                and not self.ckpt_dir:
            raise ValueError("ckpt_every, keep_last, resume and overwrite need ckpt_dir")
        if self.overwrite and (self.resume or self.resume_from):
            raise ValueError("overwrite starts a new run in ckpt_dir and resume continues one: "
                             "pass one of them")
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


def model_config(cfg: TrainConfig, vocab_size: int) -> configs.ModelConfig:
    """The preset with the tokenizer's vocabulary, the training context and any size overrides."""
    sizes = ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff")
    overrides = {k: getattr(cfg, k) for k in sizes
                 if getattr(cfg, k) is not None}
    if cfg.qk_norm:
        overrides["qk_norm"] = True
    if cfg.embed_scale != 1.0:
        overrides["embed_scale"] = cfg.embed_scale
    base = configs.resolve(cfg.model)
    vocab_size += special_tokens(cfg.objective, cfg.seq_len)  # [MASK], sentinels: on top
    return base.with_(vocab_size=vocab_size, max_seq_len=cfg.seq_len, **overrides)


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
    if composed and cfg.objective != "clm":
        raise ValueError(f"--objective {cfg.objective} is wired for one process and DDP only "
                         "(its attention mask is read from the targets, which FSDP/TP/PP "
                         "stages do not all see); use --objective clm with FSDP, TP or PP")
    if composed and cfg.compile:
        raise ValueError("--compile is wired for one process and DDP only")
    whole = {"--dtype fp8-emulated": cfg.dtype == "fp8-emulated",
             "--monitor nan": "nan" in cfg.monitor, "--ckpt-async": cfg.ckpt_async,
             "--monitor grad-norms": "grad-norms" in cfg.monitor,
             "--monitor fingerprint": "fingerprint" in cfg.monitor}
    for option, used in whole.items():
        if composed and used:
            raise ValueError(f"{option} is wired for one process and DDP only; drop it, or "
                             "train without FSDP, TP or PP")
    for option, used in (("--z-loss", bool(cfg.z_loss)), ("--qk-norm", mcfg.qk_norm)):
        if used and (lay.tp > 1 or lay.pp > 1):
            raise ValueError(f"{option} is wired for one process, DDP and FSDP; drop it, or "
                             "train without TP and PP")
    if lay.gpus != world:
        raise ValueError(f"layout {lay.short()} needs {lay.gpus} ranks but {world} were "
                         f"started: use torchrun --nproc_per_node {lay.gpus}, or change the layout")
    return lay


def config_fields() -> list:
    """TrainConfig's fields with their help text (the CLI builds its options from these)."""
    return list(fields(TrainConfig))
