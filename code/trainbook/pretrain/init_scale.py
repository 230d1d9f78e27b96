"""Initialisation scale by depth, and the short training runs the chapter's experiments share.

`build_model` makes the reference model under one of the trainer's inits (train/init.py) or
PyTorch's own module defaults ("pytorch": nn.Linear's kaiming_uniform, nn.Embedding's N(0, 1)),
for contrast. `depth_profile` measures, at initialisation, the RMS of the residual stream after
every block and the gradient norm of every block's parameters, at several depths: the quantities
that GPT-2's 1/sqrt(2L) scaling of the residual projections keeps in check. `short_run` trains a
model for a few steps with the trainer's own optimizer and schedule (`make_optimizer`, `lr_at`),
so muP's per-parameter learning rates (`lr_scale`) apply exactly as in `python -m trainbook
train`.

Chapter: book/pretraining/initialisation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import pandas as pd
import torch

from .. import configs
from ..data import ByteTokenizer, build_dataset
from ..model import Transformer
from ..train import TrainConfig, lr_at, make_optimizer
from ..train.init import INITS, init_weights

SCHEMES = (*INITS, "pytorch")  # the trainer's inits and PyTorch's module defaults


def byte_blocks(seq_len: int, split: str = "train", corpus: str = "tinyshakespeare"
                ) -> torch.Tensor:
    """The shipped corpus as bytes, packed into blocks of seq_len + 1 tokens: the training
    split, or the held-out "val" split (the last 10% of the text)."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    return getattr(build_dataset(ByteTokenizer(), seq_len, corpus), split)


def family(d_model: int, n_layers: int = 2, n_heads: int = 2, ff_mult: int = 3,
           seq_len: int = 32, vocab_size: int = 256) -> configs.ModelConfig:
    """One member of the chapter's model family: tiny-llama's architecture with every width
    (d_model, d_ff = ff_mult * d_model, head_dim = d_model / n_heads) proportional to d_model,
    and heads, layers, vocabulary and context fixed: the family muP scales along."""
    return configs.get("tiny-llama").with_(
        d_model=d_model, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_heads,
        d_ff=ff_mult * d_model, vocab_size=vocab_size, max_seq_len=seq_len)


def pytorch_default_init(model: Transformer) -> None:
    """Re-draw every Linear, Embedding and LayerNorm with PyTorch's own reset_parameters
    (Linear: kaiming_uniform_ with a = sqrt(5), i.e. U(-1/sqrt(fan_in), 1/sqrt(fan_in));
    Embedding: N(0, 1)). A head tied to the embedding keeps the embedding's draw."""
    for module in model.modules():
        if module is model.head and model.cfg.tied:
            continue
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding, torch.nn.LayerNorm)):
            module.reset_parameters()


def build_model(cfg: configs.ModelConfig, scheme: str, seed: int = 0,
                base_width: int | None = None) -> Transformer:
    """The reference model drawn from `seed` and initialised under `scheme` (one of SCHEMES);
    `base_width` is muP's."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    torch.manual_seed(seed)
    model = Transformer(cfg)
    if scheme == "pytorch":
        pytorch_default_init(model)
    else:
        init_weights(model, scheme, base_width)
    return model


def batches(blocks: torch.Tensor, batch_size: int, seed: int = 0
            ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """An endless seeded stream of (inputs, targets) batches of random blocks: every run that
    uses the same seed sees the same data in the same order."""
    if batch_size < 1 or batch_size > len(blocks):
        raise ValueError(f"batch_size must be in [1, {len(blocks)}], got {batch_size}")
    g = torch.Generator().manual_seed(seed)
    while True:
        rows = torch.randint(0, len(blocks), (batch_size,), generator=g)
        b = blocks[rows]
        yield b[:, :-1], b[:, 1:]


def short_run(model: Transformer, init: str, blocks: torch.Tensor, lr: float, steps: int,
              batch_size: int = 16, warmup_steps: int = 0, weight_decay: float = 0.0,
              seed: int = 0, on_step: Callable[[int, Transformer], None] | None = None,
              device: str = "cpu") -> list[float]:
    """Train `model` (initialised under `init`) for `steps` AdamW steps at peak `lr` with the
    trainer's optimizer and warmup-cosine schedule, each group's learning rate times its
    lr_scale as in the trainer's loop; no clipping. `on_step(step, model)` runs before each
    step's update. Returns the training loss of every step (inf from the first non-finite)."""
    if steps < 1 or lr <= 0:
        raise ValueError(f"need steps >= 1 and lr > 0, got steps={steps}, lr={lr}")
    if init not in SCHEMES:
        raise ValueError(f"init must be one of {', '.join(SCHEMES)}, got {init!r}")
    cfg = TrainConfig(lr=lr, steps=steps, warmup_steps=warmup_steps,
                      init=init if init in INITS else "scaled",  # pytorch: no lr factors
                      weight_decay=weight_decay, grad_clip=0.0, progress=False, log_every=0)
    model.to(device).train()
    opt = make_optimizer(model, cfg)
    losses: list[float] = []
    data = batches(blocks, batch_size, seed)
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg) * group.get("lr_scale", 1.0)
        x, y = next(data)
        _, loss = model(x.to(device), y.to(device))
        if not torch.isfinite(loss):
            return losses + [float("inf")] * (steps - step)
        loss.backward()
        if on_step is not None:
            on_step(step, model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@torch.no_grad()
def eval_loss(model: Transformer, blocks: torch.Tensor) -> float:
    """Mean next-token loss of `model` over all of `blocks` (one batch: keep it small)."""
    blocks = blocks.to(next(model.parameters()).device)
    _, loss = model(blocks[:, :-1], blocks[:, 1:])
    return loss.item()


def _block_grad_norm(block: torch.nn.Module) -> float:
    sq = sum(float(p.grad.pow(2).sum()) for p in block.parameters() if p.grad is not None)
    return sq ** 0.5


def depth_profile(cfg: configs.ModelConfig, depths: Sequence[int], schemes: Sequence[str],
                  blocks: torch.Tensor, batch_size: int = 16, seed: int = 0,
                  device: str = "cpu") -> pd.DataFrame:
    """At initialisation, for each scheme and depth: the RMS of the residual stream after the
    embedding (layer 0) and after each block (layers 1..L), and the gradient norm of the
    embedding and of each block's parameters, on one batch of real text.

    One row per (scheme, depth, layer); `cfg` gives everything but the depth."""
    if not depths or not schemes:
        raise ValueError("depth_profile needs at least one depth and one scheme")
    x, y = (t.to(device) for t in next(batches(blocks, batch_size, seed)))
    rows = []
    for scheme in schemes:
        for depth in depths:
            model = build_model(cfg.with_(n_layers=depth), scheme, seed).to(device)
            rms: list[float] = []
            hooks = [m.register_forward_hook(
                lambda mod, args, out, rms=rms: rms.append(
                    float(out.detach().float().pow(2).mean().sqrt())))
                for m in [model.embed, *model.blocks]]
            _, loss = model(x, y)
            loss.backward()
            for h in hooks:
                h.remove()
            grads = [_block_grad_norm(model.embed), *map(_block_grad_norm, model.blocks)]
            for layer, (r, g) in enumerate(zip(rms, grads)):
                rows.append({"scheme": scheme, "depth": depth, "layer": layer,
                             "resid_rms": r, "grad_norm": g, "loss": loss.item()})
    return pd.DataFrame(rows)
