"""Autoregressive language modelling, measured: the causal mask, n-gram baselines, what context
buys, induction heads, and teacher forcing against free-running generation.

The reference model's attention `core` is the seam used throughout: `attention_core` builds an
explicit-softmax core whose mask may look ahead (0: causal, k: k future tokens, None: none) and
which can record its attention weights, so the same model serves as the causal model, a leaky
one, and a probe of its own attention patterns. `future_leak` perturbs each token and reports
the largest change of any earlier logit. The plug-in n-gram entropies of the data are the
levels a loss curve passes; `ngram_distance` says how close the model's predictions are to the
unigram and bigram models at each checkpoint. `train_induction` trains a two-layer
attention-only model on repeated random tokens and tracks the phase change (Olsson et al.
2022); `teacher_forced_vs_free` measures the same model on its own samples.

Chapter: book/pretraining/autoregressive.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn

from ..configs import ModelConfig
from ..model import Transformer
from ..train import load_checkpoint

Core = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def attention_core(scale: float, lookahead: int | None = 0,
                   store: list[torch.Tensor] | None = None) -> Core:
    """An attention core with the softmax written out: query i sees keys j <= i + lookahead
    (0: causal, None: every key). Appends the weights (batch, heads, q, k) to `store` if given."""
    if lookahead is not None and lookahead < 0:
        raise ValueError(f"lookahead must be >= 0 or None, got {lookahead}")

    def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if k.shape[1] != q.shape[1]:  # grouped-query attention: each kv head serves a group
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        scores = (q @ k.transpose(-2, -1)).float() * scale  # (B, H, T, T)
        if lookahead is not None:
            T, S = scores.shape[-2:]
            allowed = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(lookahead)
            scores = scores.masked_fill(~allowed, float("-inf"))
        w = scores.softmax(-1)
        if store is not None:
            store.append(w.detach())
        return (w.to(v.dtype) @ v)

    return core


def _attentions(model: Transformer) -> list[nn.Module]:
    return [block.attn for block in model.layers()]


@contextmanager
def patched_cores(model: Transformer, lookahead: int | None = 0,
                  store: list[torch.Tensor] | None = None) -> Iterator[Transformer]:
    """Every attention of `model` runs `attention_core(...)` inside the block (its own scale);
    the model's own core comes back afterwards."""
    attns = _attentions(model)
    for a in attns:
        a.core = attention_core(a.softmax_scale or a.cfg.head_dim ** -0.5, lookahead, store)
    try:
        yield model
    finally:
        for a in attns:
            del a.core  # the instance attribute goes; the class's core is back


@torch.no_grad()
def future_leak(model: nn.Module, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Replace the token at each position p in turn: (largest |change| of any logit at positions
    < p, largest |change| at positions >= p), each of shape (T,); entry 0 of the first is 0.
    A causal model gives exactly 0 before p; the second shows the replacement mattered."""
    if idx.dim() != 2 or idx.shape[1] < 2:
        raise ValueError(f"idx must be (batch, time >= 2) token ids, got {tuple(idx.shape)}")
    vocab = model.cfg.vocab_size
    base = model(idx)[0]
    before, after = torch.zeros(idx.shape[1]), torch.zeros(idx.shape[1])
    for p in range(idx.shape[1]):
        x = idx.clone()
        x[:, p] = (x[:, p] + 1) % vocab  # a different token at p
        diff = (model(x)[0] - base).abs()
        before[p] = diff[:, :p].max() if p else 0.0
        after[p] = diff[:, p:].max()
    return before, after


def train_steps(model: nn.Module, blocks: torch.Tensor, steps: int, batch_size: int = 16,
                lr: float = 3e-3, generator: torch.Generator | None = None) -> list[float]:
    """A bare loop (AdamW, constant lr) on random packed blocks: the per-step training losses.
    For side-by-side runs of a model with different attention cores."""
    if steps < 1 or batch_size < 1 or lr <= 0 or blocks.dim() != 2:
        raise ValueError(f"need steps, batch_size >= 1, lr > 0 and blocks (n, seq_len + 1), got "
                         f"{steps}, {batch_size}, {lr}, {tuple(blocks.shape)}")
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        b = blocks[torch.randint(0, len(blocks), (batch_size,), generator=generator)]
        _, loss = model(b[:, :-1], b[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


# --- n-gram baselines ---------------------------------------------------------------------------

def _codes(tokens: torch.Tensor, n: int, vocab: int) -> torch.Tensor:
    N = len(tokens) - n + 1
    code = torch.zeros(N, dtype=torch.long)
    for j in range(n):
        code = code * vocab + tokens[j:j + N]
    return code


def conditional_entropies(tokens: torch.Tensor, vocab: int, max_n: int = 3) -> list[float]:
    """Plug-in H(X_n | X_1..X_{n-1}) in nats for n = 1..max_n: the loss of the best n-gram model
    fitted to these very tokens (biased low as n grows and contexts get rare)."""
    if tokens.dim() != 1 or len(tokens) <= max_n:
        raise ValueError(f"need a 1-D token stream longer than max_n={max_n}")
    if max_n < 1 or vocab ** max_n >= 2 ** 62:
        raise ValueError(f"max_n must be >= 1 with vocab ** max_n < 2**62, got {max_n}")
    joint = []
    for n in range(1, max_n + 1):
        counts = torch.unique(_codes(tokens, n, vocab), return_counts=True)[1].double()
        p = counts / counts.sum()
        joint.append(float(-(p * p.log()).sum()))
    return [joint[0]] + [joint[i] - joint[i - 1] for i in range(1, max_n)]


def ngram_tables(tokens: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Unigram p(x) (vocab,) and bigram p(x | previous) (vocab, vocab) fitted to `tokens`
    (rows of unseen contexts are 0)."""
    if tokens.dim() != 1 or len(tokens) < 2:
        raise ValueError("need a 1-D token stream of at least 2 tokens")
    uni = torch.bincount(tokens, minlength=vocab).double()
    big = torch.bincount(_codes(tokens, 2, vocab), minlength=vocab * vocab).double()
    big = big.view(vocab, vocab)
    return uni / uni.sum(), big / big.sum(1, keepdim=True).clamp_min(1)


def _kl(p: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row; p may hold zeros, q comes as log-probabilities."""
    return (p * (p.clamp_min(1e-300).log() - logq)).sum(-1)


@torch.no_grad()
def ngram_distance(model: nn.Module, x: torch.Tensor, y: torch.Tensor, unigram: torch.Tensor,
                   bigram: torch.Tensor) -> dict[str, float]:
    """The model's loss on (x, y) and how far its predictions are from the n-gram models':
    mean KL(unigram || model) and KL(bigram(. | x_t) || model), nats. Near 0: it predicts as
    that n-gram model does."""
    logq = F.log_softmax(model(x)[0].double(), -1)
    return {"loss": float(F.nll_loss(logq.flatten(0, 1), y.flatten())),
            "kl_unigram": float(_kl(unigram.expand_as(logq), logq).mean()),
            "kl_bigram": float(_kl(bigram[x], logq).mean())}


def checkpoint_trajectory(ckpt_dir: str | Path, x: torch.Tensor, y: torch.Tensor,
                          unigram: torch.Tensor, bigram: torch.Tensor) -> pd.DataFrame:
    """`ngram_distance` at every checkpoint the trainer wrote to ckpt_dir, one row per step
    (the model is rebuilt from the configuration each checkpoint records)."""
    paths = sorted(Path(ckpt_dir).glob("step-*.pt"))
    if not paths:
        raise ValueError(f"no checkpoints in {ckpt_dir}; train with ckpt_dir and ckpt_every")
    model, rows = None, []
    for path in paths:
        state = load_checkpoint(path)
        if model is None:
            model = Transformer(ModelConfig(**state["model_config"])).eval()
        model.load_state_dict(state["model"])
        rows.append({"step": state["step"], **ngram_distance(model, x, y, unigram, bigram)})
    return pd.DataFrame(rows)


@torch.no_grad()
def loss_by_position(model: nn.Module, blocks: torch.Tensor, batch_size: int = 32
                     ) -> torch.Tensor:
    """Mean loss at each position of packed (inputs + 1) blocks: position t predicts token t + 1
    from t + 1 tokens of context."""
    if blocks.dim() != 2 or blocks.shape[1] < 2 or batch_size < 1:
        raise ValueError(f"need blocks (n, seq_len + 1) and batch_size >= 1, "
                         f"got {tuple(blocks.shape)}, {batch_size}")
    total = torch.zeros(blocks.shape[1] - 1, dtype=torch.float64)
    device = next(model.parameters()).device
    for i in range(0, len(blocks), batch_size):
        b = blocks[i:i + batch_size].to(device)
        logits = model(b[:, :-1])[0].float()
        total += F.cross_entropy(logits.transpose(1, 2), b[:, 1:], reduction="none").sum(0).cpu()
    return total / len(blocks)


# --- induction heads ------------------------------------------------------------------------------

@dataclass(frozen=True)
class InductionConfig:
    """Two-layer attention-only model trained on periodic random tokens (period min_period to
    half, drawn per sequence), probed on random tokens repeated once (Olsson et al. 2022)."""

    vocab: int = 64
    half: int = 32  # sequences of 2 * half tokens; the probe repeats `half` random tokens once
    min_period: int = 8
    d_model: int = 64
    n_heads: int = 2
    batch_size: int = 32
    steps: int = 400
    lr: float = 2e-3
    eval_every: int = 10
    eval_batch: int = 64
    seed: int = 0

    def __post_init__(self):
        for name in ("vocab", "half", "d_model", "n_heads", "batch_size", "steps", "eval_every",
                     "eval_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.half < 3 or self.lr <= 0 or not 1 <= self.min_period <= self.half:
            raise ValueError(f"need half >= 3, lr > 0 and 1 <= min_period <= half, got "
                             f"{self.half}, {self.lr}, {self.min_period}")


def repeated_tokens(batch: int, half: int, vocab: int,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """(batch, 2 * half): uniform random tokens, then the same tokens again."""
    if batch < 1 or half < 1 or vocab < 2:
        raise ValueError(f"need batch, half >= 1 and vocab >= 2, got {batch}, {half}, {vocab}")
    device = generator.device if generator is not None else None
    r = torch.randint(0, vocab, (batch, half), generator=generator, device=device)
    return torch.cat([r, r], dim=1)


def periodic_tokens(batch: int, seq_len: int, vocab: int, min_period: int, max_period: int,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """(batch, seq_len): each row repeats its own random tokens with a period drawn from
    [min_period, max_period]. The period varies, so copying from a fixed offset does not work:
    predicting the repeats takes looking the current token up in the context."""
    if batch < 1 or vocab < 2 or not 1 <= min_period <= max_period <= seq_len:
        raise ValueError(f"need batch >= 1, vocab >= 2 and 1 <= min_period <= max_period <= "
                         f"seq_len, got {batch}, {vocab}, {min_period}, {max_period}, {seq_len}")
    device = generator.device if generator is not None else None
    period = torch.randint(min_period, max_period + 1, (batch, 1), generator=generator,
                           device=device)
    r = torch.randint(0, vocab, (batch, seq_len), generator=generator, device=device)
    return r.gather(1, torch.arange(seq_len, device=device)[None] % period)


class _NoMLP(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x)


def attention_only(cfg: ModelConfig) -> Transformer:
    """The reference model with every MLP removed (the block adds zeros): attention and norms
    only, as in Elhage et al. 2021."""
    model = Transformer(cfg)
    for block in model.layers():
        block.mlp, block.mlp_norm = _NoMLP(), nn.Identity()
    return model


def head_scores(weights: list[torch.Tensor], half: int) -> dict[str, torch.Tensor]:
    """Per layer and head, on repeated sequences: 'previous' = mean attention from position i to
    i - 1; 'prefix' = mean attention from a repeated token at i >= half to i - half + 1, the token
    that followed its first occurrence (the prefix-matching score). Each (layers, heads)."""
    prev, prefix = [], []
    for w in weights:  # (B, H, T, T) with T = 2 * half - 1 (the inputs)
        T = w.shape[-1]
        i = torch.arange(1, T, device=w.device)
        prev.append(w[..., i, i - 1].mean(dim=(0, 2)))
        j = torch.arange(half, T, device=w.device)
        prefix.append(w[..., j, j - half + 1].mean(dim=(0, 2)))
    return {"previous": torch.stack(prev).cpu(), "prefix": torch.stack(prefix).cpu()}


@torch.no_grad()
def shifted_repeat_loss(model: nn.Module, length: int, offset: int, seq_len: int, batch: int,
                        generator: torch.Generator | None = None) -> float:
    """Loss on the predictable part of a repeat placed elsewhere: random tokens with
    x[offset + length + i] = x[offset + i] for i < length. Low only for a model that looks the
    current token up (an induction head), not one that copies from a fixed distance."""
    if length < 2 or offset < 0 or offset + 2 * length > seq_len:
        raise ValueError(f"a repeat of length {length} >= 2 at offset {offset} >= 0 must fit in "
                         f"seq_len {seq_len}")
    device = generator.device if generator is not None else None
    x = torch.randint(0, model.cfg.vocab_size, (batch, seq_len), generator=generator,
                      device=device)
    x[:, offset + length:offset + 2 * length] = x[:, offset:offset + length]
    logits = model(x[:, :-1])[0].float()
    per_token = F.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none")
    return per_token[:, offset + length:offset + 2 * length - 1].mean().item()


def split_losses(logits: torch.Tensor, x: torch.Tensor, half: int) -> tuple[float, float]:
    """(mean loss on the first half's targets, on the repeated half's), leaving out the first
    repeated token (unpredictable: it follows the boundary)."""
    per_token = F.cross_entropy(logits.float().transpose(1, 2), x[:, 1:], reduction="none")
    return per_token[:, :half - 1].mean().item(), per_token[:, half:].mean().item()


@dataclass
class InductionRun:
    config: InductionConfig
    model: Transformer
    history: pd.DataFrame  # step, loss_first, loss_repeat, previous, prefix (eval batch)
    eval_tokens: torch.Tensor
    weights: list[torch.Tensor]  # final attention patterns on eval_tokens, one per layer

    def phase_change(self) -> dict[str, float] | None:
        """The fall of the repeated-half loss from its start to its final value, timed as a rise
        time: 'start' is the last evaluation still above 90% of the way down from the
        final value, 'mid' the first below 50%, 'end' the first below 10%. None when the loss
        fell by less than half of ln V (no phase change yet)."""
        h = self.history
        first, final = h.loss_repeat.iloc[0], h.loss_repeat.iloc[-5:].min()
        if first - final < 0.5 * math.log(self.config.vocab):
            return None
        level = lambda f: final + f * (first - final)  # noqa: E731
        mid = h.index[h.loss_repeat < level(0.5)][0]
        end = h.index[h.loss_repeat < level(0.1)][0]
        start = h.index[(h.index < mid) & (h.loss_repeat > level(0.9))][-1]
        return {"start": int(h.step[start]), "mid": int(h.step[mid]), "end": int(h.step[end]),
                "loss_start": float(h.loss_repeat[start]), "loss_end": float(h.loss_repeat[end]),
                "loss_final": float(final)}


def train_induction(cfg: InductionConfig, device: str = "cpu") -> InductionRun:
    """Train the attention-only model with AdamW (no weight decay, constant lr) on fresh
    periodic sequences each step; every eval_every steps record both halves' losses and the best
    previous-token (layer 1) and prefix-matching (layer 2) scores on a fixed batch."""
    torch.manual_seed(cfg.seed)
    mcfg = ModelConfig(name="induction", flavour="llama", vocab_size=cfg.vocab, n_layers=2,
                       d_model=cfg.d_model, n_heads=cfg.n_heads, d_ff=4,
                       max_seq_len=2 * cfg.half)
    model = attention_only(mcfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    g = torch.Generator(device=device).manual_seed(cfg.seed + 1)
    evals = repeated_tokens(cfg.eval_batch, cfg.half, cfg.vocab, g)

    @torch.no_grad()
    def evaluate(step: int) -> tuple[dict, list[torch.Tensor]]:
        store: list[torch.Tensor] = []
        with patched_cores(model, 0, store):
            logits = model(evals[:, :-1])[0]
        first, repeat = split_losses(logits, evals, cfg.half)
        s = head_scores(store, cfg.half)
        return ({"step": step, "loss_first": first, "loss_repeat": repeat,
                 "previous": s["previous"][0].max().item(),
                 "prefix": s["prefix"][1].max().item()}, store)

    rows = [evaluate(0)[0]]
    for step in range(1, cfg.steps + 1):
        x = periodic_tokens(cfg.batch_size, 2 * cfg.half, cfg.vocab, cfg.min_period, cfg.half, g)
        _, loss = model(x[:, :-1], x[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % cfg.eval_every == 0 or step == cfg.steps:
            rows.append(evaluate(step)[0])
    weights = evaluate(cfg.steps)[1]
    return InductionRun(cfg, model.eval(), pd.DataFrame(rows), evals, weights)


@torch.no_grad()
def teacher_forced_vs_free(model: Transformer, x: torch.Tensor, half: int, prompt: int = 8,
                           generator: torch.Generator | None = None,
                           greedy: bool = False) -> pd.DataFrame:
    """On repeated sequences x (batch, 2 * half), for the repeated tokens k = prompt..half - 1:
    the loss of the true token and the chance the model's token is right, given the true prefix
    (teacher forcing, as in training) or the model's own tokens after the first half and
    `prompt` true repeated tokens (free-running: sampled at temperature 1, or greedy)."""
    if x.dim() != 2 or x.shape[1] != 2 * half or not 1 <= prompt < half:
        raise ValueError(f"x must be (batch, 2 * half) and 1 <= prompt < half, got "
                         f"{tuple(x.shape)}, half {half}, prompt {prompt}")
    start = half + prompt  # the first generated position
    targets = x[:, start:]
    tf_logits = model(x[:, :-1])[0][:, start - 1:].float()
    free = model.generate(x[:, :start], half - prompt, top_k=1 if greedy else None,
                          generator=generator)
    fr_logits = model(free[:, :-1])[0][:, start - 1:].float()
    nll = lambda z: F.cross_entropy(z.transpose(1, 2), targets, reduction="none")  # noqa: E731
    tf_right = (tf_logits.argmax(-1) == targets).float() if greedy else (-nll(tf_logits)).exp()
    return pd.DataFrame({
        "position": range(prompt, half), "tf_loss": nll(tf_logits).mean(0).cpu(),
        "free_loss": nll(fr_logits).mean(0).cpu(), "tf_correct": tf_right.mean(0).cpu(),
        "free_correct": (free[:, start:] == targets).float().mean(0).cpu()})
