"""Optimizers from scratch: SGD with momentum, Adam, AdamW, Adafactor and Muon, in torch.optim's
order of operations, so SGD, Adam, AdamW and Muon match it bit for bit and Adafactor to float
rounding (tests/test_optimizers.py); Lion is the trainer's own (`trainbook.train.optim.Lion`).
Plus what the chapter measures with them: state bytes per parameter, one step of weight decay
under L2-in-Adam and AdamW, momentum conventions after an lr drop, and an lr sweep.

Chapter: book/pretraining/optimizers.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

import pandas as pd
import torch

from .. import configs
from ..data import ByteTokenizer, ShardedLoader, build_dataset
from ..launch import threads
from ..model import Transformer
from ..train import TrainConfig, evaluate, lr_at
from ..train.optim import Composite, Lion, param_groups, split_hidden

__all__ = ["MUON_NS", "SCRATCH", "SGD", "Adafactor", "Adam", "AdamW", "Muon", "build",
           "decay_in_one_step", "lr_drop", "lr_sweep", "max_difference", "newton_schulz",
           "state_bytes", "state_elements"]

MUON_NS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic coefficients (a, b, c)
SCRATCH = ("sgd", "adam", "adamw", "adafactor", "lion", "muon")


def _check(lr: float, **nonneg: float) -> None:
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    for k, v in nonneg.items():
        if v < 0:
            raise ValueError(f"{k} must be >= 0, got {v}")


def _with_grad(group: dict) -> Iterable[torch.Tensor]:
    return (p for p in group["params"] if p.grad is not None)


def max_difference(make_a: Callable[[list], torch.optim.Optimizer],
                   make_b: Callable[[list], torch.optim.Optimizer],
                   shapes: Sequence[tuple[int, ...]] = ((24, 40), (40, 24), (16,)),
                   steps: int = 50, lr_decay: float = 0.97, seed: int = 0) -> float:
    """Largest |a - b| over all parameters after `steps` steps of two optimizers (each built
    from a parameter list) on the same random gradients, the lr decaying every step."""
    if steps < 1 or not shapes:
        raise ValueError(f"need steps >= 1 and at least one shape, got {steps}, {shapes}")
    g = torch.Generator().manual_seed(seed)
    pa = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    pb = [torch.nn.Parameter(p.detach().clone()) for p in pa]
    a, b = make_a(pa), make_b(pb)
    for _ in range(steps):
        for x, y in zip(pa, pb):
            x.grad = torch.randn(x.shape, generator=g)
            y.grad = x.grad.clone()
        for o in (a, b):
            for group in o.param_groups:
                group["lr"] *= lr_decay
            o.step()
    return max((x - y).abs().max().item() for x, y in zip(pa, pb))


class SGD(torch.optim.Optimizer):
    """SGD with momentum. PyTorch's convention: v <- mu v + g, p <- p - lr v (lr outside the
    velocity). classic=True: v <- mu v - lr g, p <- p + v (Sutskever et al. 2013, eq. 1-2; lr
    inside, so a learning-rate change reaches the step only as old velocity decays).
    weight_decay is L2: added to the gradient."""

    def __init__(self, params: Iterable, lr: float = 1e-3, momentum: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, classic: bool = False):
        _check(lr, momentum=momentum, weight_decay=weight_decay)
        if nesterov and (classic or momentum == 0):
            raise ValueError("nesterov needs momentum > 0 and PyTorch's convention")
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay,
                                  "nesterov": nesterov, "classic": classic})

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
            for p in _with_grad(group):
                g = p.grad.add(p, alpha=wd) if wd else p.grad
                if mu == 0:  # plain SGD keeps no state
                    p.add_(g, alpha=-lr)
                    continue
                v = self.state[p].setdefault("v", torch.zeros_like(p))
                if group["classic"]:
                    p.add_(v.mul_(mu).add_(g, alpha=-lr))
                    continue
                v.mul_(mu).add_(g)
                p.add_(g.add(v, alpha=mu) if group["nesterov"] else v, alpha=-lr)


class Adam(torch.optim.Optimizer):
    """Adam (Kingma and Ba 2015, Algorithm 1): moving averages of g and g^2, bias-corrected by
    1 - beta^t. weight_decay is L2 (added to the gradient, then normalised with it) unless
    decoupled, which shrinks the weights directly by lr * weight_decay: AdamW."""

    def __init__(self, params: Iterable, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, decoupled: bool = False):
        _check(lr, eps=eps, weight_decay=weight_decay)
        if not all(0 <= b < 1 for b in betas):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps,
                                  "weight_decay": weight_decay, "decoupled": decoupled})

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in _with_grad(group):
                g, s = p.grad, self.state[p]
                if not s:
                    s.update(step=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
                t = s["step"] = s["step"] + 1
                if wd and group["decoupled"]:
                    p.mul_(1 - lr * wd)
                elif wd:
                    g = g.add(p, alpha=wd)
                s["m"].lerp_(g, 1 - b1)  # m <- b1 m + (1 - b1) g
                s["v"].mul_(b2).addcmul_(g, g, value=1 - b2)  # v <- b2 v + (1 - b2) g^2
                # p <- p - lr m_hat / (sqrt(v_hat) + eps), m_hat = m / (1 - b1^t), likewise v
                denom = (s["v"].sqrt() / math.sqrt(1 - b2 ** t)).add_(eps)
                p.addcdiv_(s["m"], denom, value=-lr / (1 - b1 ** t))


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov and Hutter 2019), torch's defaults."""

    def __init__(self, params: Iterable, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2):
        super().__init__(params, lr, betas, eps, weight_decay, decoupled=True)


def _rms(x: torch.Tensor) -> float:
    return x.norm().item() / math.sqrt(x.numel())


class Adafactor(torch.optim.Optimizer):
    """Adafactor (Shazeer and Stern 2018) as torch.optim defines it: no momentum; a matrix's second
    moment is the outer product of its row and column means of g^2; beta2_t = 1 - t^decay; the
    update, its RMS clipped to d, is scaled by max(eps2, RMS(p)) * min(lr, 1/sqrt(t))."""

    def __init__(self, params: Iterable, lr: float = 1e-2, beta2_decay: float = -0.8,
                 eps: tuple[float | None, float] = (None, 1e-3), d: float = 1.0,
                 weight_decay: float = 0.0):
        _check(lr, weight_decay=weight_decay, eps2=eps[1])
        if beta2_decay > 0 or d < 1:
            raise ValueError(f"need beta2_decay <= 0 and d >= 1, got {beta2_decay}, {d}")
        super().__init__(params, {"lr": lr, "beta2_decay": beta2_decay, "eps": tuple(eps),
                                  "d": d, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            lr, (eps1, eps2), wd = group["lr"], group["eps"], group["weight_decay"]
            for p in _with_grad(group):
                g, s = p.grad, self.state[p]
                eps1 = torch.finfo(p.dtype).eps if eps1 is None else eps1
                if not s:
                    s["step"] = 0
                    if p.dim() > 1:  # factored: one value per row and one per column
                        s["row"] = torch.zeros_like(g.sum(-1, keepdim=True))
                        s["col"] = torch.zeros_like(g.sum(-2, keepdim=True))
                    else:
                        s["v"] = torch.zeros_like(p)
                t = s["step"] = s["step"] + 1
                one_minus_beta2 = t ** group["beta2_decay"]
                alpha = max(eps2, _rms(p)) * min(lr, 1 / math.sqrt(t))  # relative step size
                p.mul_(1 - lr * wd)
                g2 = g * g
                if p.dim() > 1:
                    s["row"].lerp_(g2.mean(-1, keepdim=True), one_minus_beta2)
                    s["col"].lerp_(g2.mean(-2, keepdim=True), one_minus_beta2)
                    # V = R C / mean(R): rank one, exact when g^2 is an outer product
                    v = s["row"] @ s["col"] / s["row"].mean(-2, keepdim=True).clamp(min=eps1)
                else:
                    s["v"].lerp_(g2, one_minus_beta2)
                    v = s["v"]
                u = g * v.clamp(min=eps1 * eps1).rsqrt()
                p.add_(u, alpha=-alpha / max(1.0, _rms(u) / group["d"]))  # update clipping


def newton_schulz(G: torch.Tensor, steps: int = 5, coefficients: tuple = MUON_NS,
                  eps: float = 1e-7, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Approximately U V^T for G = U S V^T: each step maps every singular value s to
    a s + b s^3 + c s^5, after scaling G to Frobenius norm 1 (so all s <= 1). Works on the wide
    orientation (X X^T is the smaller Gram matrix)."""
    if G.dim() != 2 or steps < 0:
        raise ValueError(f"newton_schulz needs a 2-D matrix and steps >= 0, got shape "
                         f"{tuple(G.shape)} and steps {steps}")
    a, b, c = coefficients
    tall = G.size(0) > G.size(1)
    X = G.to(dtype).mT if tall else G.to(dtype)
    X = X / X.norm().clamp(min=eps)
    for _ in range(steps):
        A = X @ X.mT
        B = torch.addmm(A, A, A, beta=b, alpha=c)  # b A + c A^2
        X = torch.addmm(X, B, X, beta=a)  # a X + B X = a X + b (XX^T) X + c (XX^T)^2 X
    return X.mT if tall else X


def _muon_lr(lr: float, shape: torch.Size, adjust: str | None) -> float:
    """Keller Jordan's sqrt(max(1, rows/cols)), or Liu et al. 2025's 0.2 sqrt(max(rows, cols)),
    which gives the update AdamW's RMS so AdamW's lr and weight decay carry over."""
    A, B = shape[:2]
    return lr * (0.2 * math.sqrt(max(A, B)) if adjust == "match_rms_adamw"
                 else math.sqrt(max(1, A / B)))


class Muon(torch.optim.Optimizer):
    """Muon (Jordan et al. 2024): SGD momentum (Nesterov by default) on a 2-D matrix, the update
    orthogonalised by Newton-Schulz, decoupled weight decay; torch.optim.Muon's defaults.
    ns_dtype: bf16 as torch (and Keller Jordan) run it; fp32 where bf16 is emulated."""

    def __init__(self, params: Iterable, lr: float = 1e-3, weight_decay: float = 0.1,
                 momentum: float = 0.95, nesterov: bool = True,
                 ns_coefficients: tuple = MUON_NS, eps: float = 1e-7, ns_steps: int = 5,
                 adjust_lr_fn: str | None = None, ns_dtype: torch.dtype = torch.bfloat16):
        _check(lr, weight_decay=weight_decay, momentum=momentum)
        if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
            raise ValueError(f"adjust_lr_fn must be None, 'original' or 'match_rms_adamw', "
                             f"got {adjust_lr_fn!r}")
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, "momentum": momentum,
                                  "nesterov": nesterov, "ns_coefficients": ns_coefficients,
                                  "eps": eps, "ns_steps": ns_steps, "adjust_lr_fn": adjust_lr_fn,
                                  "ns_dtype": ns_dtype})
        for group in self.param_groups:
            if any(p.dim() != 2 for p in group["params"]):
                raise ValueError("Muon takes 2-D matrices only: give embeddings' and 1-D "
                                 "parameters to AdamW (trainbook.train.optim.split_hidden)")

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            lr, mu = group["lr"], group["momentum"]
            for p in _with_grad(group):
                g = p.grad
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                buf.lerp_(g, 1 - mu)  # B <- mu B + (1 - mu) g
                update = g.lerp(buf, mu) if group["nesterov"] else buf
                O = newton_schulz(update, group["ns_steps"], group["ns_coefficients"],
                                  group["eps"], group["ns_dtype"])
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(O, alpha=-_muon_lr(lr, p.shape, group["adjust_lr_fn"]))


def build(model: torch.nn.Module, cfg: TrainConfig,
          ns_dtype: torch.dtype = torch.bfloat16) -> torch.optim.Optimizer:
    """The from-scratch twin of `trainbook.train.make_optimizer(model, cfg)`: same groups, same
    hyperparameters, this module's classes (Lion is the trainer's own)."""
    groups = param_groups(model, cfg.weight_decay, cfg.init)
    betas = (cfg.beta1, cfg.beta2)
    if cfg.optimizer == "muon":
        hidden, rest = split_hidden(model, groups)
        return Composite(Muon(hidden, lr=cfg.lr, adjust_lr_fn="match_rms_adamw",
                              ns_dtype=ns_dtype), AdamW(rest, lr=cfg.lr, betas=betas))
    kinds = {"sgd": (SGD, {"momentum": cfg.beta1}), "adam": (Adam, {"betas": betas}),
             "adamw": (AdamW, {"betas": betas}), "adafactor": (Adafactor, {}), "lion": (Lion, {})}
    if cfg.optimizer not in kinds:
        raise ValueError(f"no from-scratch optimizer {cfg.optimizer!r}; one of {SCRATCH}")
    cls, kw = kinds[cfg.optimizer]
    return cls(groups, lr=cfg.lr, **kw)


def state_bytes(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """Optimizer state measured from its state_dict after a step: bytes per parameter, and apart
    the scalar step counters (bytes per tensor, not per element)."""
    n = sum(p.numel() for g in optimizer.param_groups for p in g["params"])
    if n == 0:
        raise ValueError("the optimizer holds no parameters")
    tensors = [v for s in optimizer.state_dict()["state"].values() for v in s.values()
               if torch.is_tensor(v)]
    per = sum(t.numel() * t.element_size() for t in tensors if t.dim() > 0)
    scalars = sum(t.element_size() for t in tensors if t.dim() == 0)
    return {"bytes_per_param": per / n, "scalar_bytes": float(scalars), "params": float(n)}


def decay_in_one_step(grad_scales: Sequence[float] = (1.0, 1e-2, 1e-3), lr: float = 1e-3,
                      weight_decay: float = 0.01, warm_steps: int = 1000) -> pd.DataFrame:
    """How far one step of weight decay moves a weight of 1.0 under L2-in-Adam and AdamW, for
    weights whose (constant) gradients differ in scale. Both optimizers are warmed up without
    decay; then the same step is taken with and without it; the difference is the decay's."""
    if not grad_scales or min(grad_scales) <= 0 or warm_steps < 1:
        raise ValueError("need positive gradient scales and warm_steps >= 1")
    _check(lr, weight_decay=weight_decay)
    rows = []
    for decoupled in (False, True):
        moved = []
        for wd in (weight_decay, 0.0):
            p = torch.nn.Parameter(torch.ones(len(grad_scales), dtype=torch.float64))
            opt = Adam([p], lr=lr, weight_decay=0.0, decoupled=decoupled)
            p.grad = torch.tensor(grad_scales, dtype=torch.float64)
            for _ in range(warm_steps):
                opt.step()
            p.data.fill_(1.0)
            opt.param_groups[0]["weight_decay"] = wd
            opt.step()
            moved.append(1.0 - p.detach())
        decay = (moved[0] - moved[1]).tolist()
        v_hat = (opt.state[p]["v"] / (1 - 0.999 ** (warm_steps + 1))).sqrt().tolist()
        rows += [{"optimizer": "AdamW" if decoupled else "Adam + L2", "grad": g,
                  "sqrt(v_hat)": v, "decay": d,
                  "decay / (lr wd)": d / (lr * weight_decay)}
                 for g, v, d in zip(grad_scales, v_hat, decay)]
    return pd.DataFrame(rows)


def lr_drop(momentum: float = 0.9, lr: float = 0.1, factor: float = 10.0, drop_at: int = 20,
            steps: int = 40) -> pd.DataFrame:
    """Step sizes of SGD momentum in both conventions on a constant gradient of 1, the learning
    rate divided by `factor` at step `drop_at`."""
    if not 0 < drop_at < steps or factor <= 0:
        raise ValueError(f"need 0 < drop_at < steps and factor > 0, got {drop_at}, {steps}")
    rows = []
    for classic in (False, True):
        p = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
        opt = SGD([p], lr=lr, momentum=momentum, classic=classic)
        p.grad = torch.ones_like(p)
        for t in range(steps):
            opt.param_groups[0]["lr"] = lr if t < drop_at else lr / factor
            before = p.item()
            opt.step()
            rows.append({"convention": "classic" if classic else "pytorch", "step": t + 1,
                         "lr": opt.param_groups[0]["lr"], "step_size": before - p.item()})
    return pd.DataFrame(rows)


def state_elements(rows: int, cols: int) -> dict[str, int]:
    """State elements for one rows x cols matrix: Shampoo keeps two Kronecker factors and their
    inverse roots, SOAP the factors, their eigenbases and Adam's two moments, Sophia a momentum
    and a diagonal Hessian estimate."""
    if rows < 1 or cols < 1:
        raise ValueError(f"a matrix needs rows, cols >= 1, got {rows} x {cols}")
    n, sq = rows * cols, rows * rows + cols * cols
    return {"sgd": 0, "sgd momentum": n, "adam(w)": 2 * n, "adafactor": rows + cols,
            "lion": n, "muon": n, "sophia": 2 * n, "shampoo": 2 * sq, "soap": 2 * sq + 2 * n}


def lr_sweep(grid: dict[str, Sequence[float]], steps: int = 100, d_model: int = 32,
             n_layers: int = 2, batch_size: int = 16, seq_len: int = 64, warmup_steps: int = 10,
             weight_decay: float = 0.1, ns_dtype: torch.dtype = torch.float32,
             device: str = "cpu", seed: int = 0, eval_batches: int = 8) -> pd.DataFrame:
    """Train the reference model (Llama flavour, bytes) once per (optimizer, peak lr) in `grid`
    with this module's optimizers: the same initial weights and batches for every run, the
    trainer's warmup + cosine schedule and gradient clipping at 1. One row per run: the final
    validation loss (inf if it diverged), the mean of the last 5 training losses, seconds."""
    if not grid or any(k not in SCRATCH or not v or min(v) <= 0 for k, v in grid.items()):
        raise ValueError(f"grid maps optimizers in {SCRATCH} to positive learning rates; got "
                         f"{dict(grid)}")
    base = TrainConfig(steps=steps, warmup_steps=warmup_steps, weight_decay=weight_decay,
                       batch_size=batch_size, seq_len=seq_len, d_model=d_model,
                       n_layers=n_layers)  # checks the sizes before any work
    heads = max(1, d_model // 16)
    mcfg = configs.get("tiny-llama").with_(vocab_size=256, d_model=d_model, n_layers=n_layers,
                                           n_heads=heads, n_kv_heads=heads, max_seq_len=seq_len,
                                           d_ff=(8 * d_model // 3 + 7) // 8 * 8)
    data = build_dataset(ByteTokenizer(), seq_len)
    loader = ShardedLoader(data.train, batch_size, seed=seed)
    batches = [tuple(t.to(device) for t in loader.next_batch()) for _ in range(steps)]

    def run(name: str, peak: float) -> dict:
        cfg = replace(base, optimizer=name, lr=peak)
        torch.manual_seed(seed)
        model = Transformer(mcfg).to(device)
        opt = build(model, cfg, ns_dtype)
        t0, losses = time.perf_counter(), []
        for step, (x, y) in enumerate(batches):
            for g in opt.param_groups:
                g["lr"] = lr_at(step, cfg) * g.get("lr_scale", 1.0)
            loss = model(x, y)[1]
            if not torch.isfinite(loss):
                break
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        ok = len(losses) == steps
        val = evaluate(model, data.val, batch_size, eval_batches, torch.device(device))
        return {"optimizer": name, "lr": peak,
                "loss": val if ok and math.isfinite(val) else math.inf,
                "train_loss": sum(losses[-5:]) / 5 if ok else math.inf,
                "seconds": time.perf_counter() - t0}

    with threads(1):  # a model this small is overhead-bound: spare the threads
        return pd.DataFrame([run(name, lr) for name, lrs in grid.items() for lr in lrs])
