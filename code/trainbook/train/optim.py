"""The trainer's optimizers: one builder per name, weight decay on matrices only.

`make_optimizer` builds what `cfg.optimizer` names: torch.optim's AdamW, Adam, SGD (momentum
beta1), Adafactor and Muon, and `Lion`, which torch does not ship (written here, checked against
the authors' algorithm and the lion-pytorch package in tests/test_optimizers.py). Muon
orthogonalises updates of 2-D matrices only, so "muon" is a `Composite`: Muon on the blocks'
hidden matrices, AdamW on embeddings, head and 1-D parameters, behind one optimizer object that
the loop, GradScaler and checkpoints treat like any other.

Chapter: book/start/first-run (AdamW); book/pretraining/optimizers (the rest).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from .config import OPTIMIZERS, TrainConfig
from .init import lr_scale

__all__ = ["OPTIMIZERS", "Composite", "Lion", "is_hidden_matrix", "make_optimizer",
           "param_groups", "split_hidden"]

LION_BETAS = (0.9, 0.99)  # Chen et al. 2023: found by the search, the defaults of Lion


def param_groups(model: torch.nn.Module, weight_decay: float, init: str = "scaled") -> list[dict]:
    """Matrices decay; norms and biases (1-D parameters) do not. Parameters whose learning rate
    the initialisation scales (muP) get their own group with "lr_scale"; the loop sets each
    group's learning rate to the schedule's times its lr_scale."""
    groups: dict[tuple[bool, float], list[torch.nn.Parameter]] = {}
    for name, p in model.named_parameters():
        key = (p.dim() >= 2, lr_scale(model, name, init))
        groups.setdefault(key, []).append(p)
    return [{"params": ps, "weight_decay": weight_decay if decay else 0.0, "lr_scale": scale}
            for (decay, scale), ps in groups.items()]


def is_hidden_matrix(name: str, p: torch.Tensor) -> bool:
    """A 2-D weight inside a transformer block: what Muon optimises. Embeddings and the output
    head are matrices too, but map tokens, not hidden states, and stay with AdamW."""
    return p.dim() == 2 and "blocks" in name.split(".")


def split_hidden(model: torch.nn.Module, groups: list[dict]) -> tuple[list[dict], list[dict]]:
    """`groups` (from `param_groups`) split into (hidden matrices, everything else), each group
    keeping its keys (weight_decay, lr_scale); empty groups are dropped."""
    hidden = {id(p) for n, p in model.named_parameters() if is_hidden_matrix(n, p)}
    parts: tuple[list[dict], list[dict]] = ([], [])
    for g in groups:
        for part, keep in zip(parts, (True, False)):
            ps = [p for p in g["params"] if (id(p) in hidden) == keep]
            if ps:
                part.append({**g, "params": ps})
    return parts


def _evaluate(closure: Callable[[], float] | None) -> float | None:
    """torch.optim's closure protocol: re-evaluate the loss with gradients on."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class Lion(torch.optim.Optimizer):
    """Lion, Chen et al. 2023 (Algorithm 2): the update is the sign of an interpolation of
    momentum and gradient, so every element moves by exactly lr (plus decoupled weight decay);
    one state tensor (the momentum) per parameter, half of Adam's."""

    def __init__(self, params: Iterable, lr: float = 1e-4,
                 betas: tuple[float, float] = LION_BETAS, weight_decay: float = 0.0):
        if not lr > 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"Lion needs lr > 0, weight_decay >= 0 and betas in [0, 1), got "
                             f"lr={lr}, weight_decay={weight_decay}, betas={betas}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = _evaluate(closure)
        for group in self.param_groups:
            lr, wd, (beta1, beta2) = group["lr"], group["weight_decay"], group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g, state = p.grad, self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                m = state["exp_avg"]
                c = m.mul(beta1).add_(g, alpha=1 - beta1)  # c_t = b1 m + (1 - b1) g
                p.mul_(1 - lr * wd)  # decoupled weight decay, as in AdamW
                p.add_(c.sign_(), alpha=-lr)
                m.mul_(beta2).add_(g, alpha=1 - beta2)  # m_t = b2 m + (1 - b2) g
        return loss


class Composite(torch.optim.Optimizer):
    """Several optimizers over disjoint parameters as one: one list of param_groups (the
    parts' own group dicts, so the loop's learning-rate writes reach them), one state, one
    state_dict; step() steps every part. GradScaler unscales and steps it like any optimizer."""

    def __init__(self, *parts: torch.optim.Optimizer):
        if not parts:
            raise ValueError("Composite needs at least one optimizer")
        groups = []
        for i, part in enumerate(parts):
            for g in part.param_groups:
                g["part"] = i
                groups.append(g)
        super().__init__(groups, {})
        self.parts = list(parts)
        self._bind()

    def _bind(self) -> None:
        """Point every part at this optimizer's groups and state (load_state_dict replaces
        both)."""
        for i, part in enumerate(self.parts):
            part.param_groups = [g for g in self.param_groups if g["part"] == i]
            part.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._bind()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = _evaluate(closure)
        self._bind()
        for part in self.parts:
            part.step()
        return loss


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """The optimizer `cfg.optimizer` names, over `model`'s parameters.

    adamw, adam (weight decay as L2, coupled), sgd (momentum beta1, L2 decay), adafactor
    (torch's: lr is the largest relative step), lion (betas 0.9, 0.99 as published: lower
    --lr 3-10x from AdamW's) and muon (Muon with its lr scaled to match AdamW's update RMS,
    Liu et al. 2025, so one --lr serves it and the AdamW it keeps for the other parameters).
    """
    if cfg.optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, "
                         f"got {cfg.optimizer!r}")
    groups = param_groups(model, cfg.weight_decay, cfg.init)
    betas = (cfg.beta1, cfg.beta2)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(groups, lr=cfg.lr, betas=betas)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.beta1)
    if cfg.optimizer == "adafactor":
        return torch.optim.Adafactor(groups, lr=cfg.lr)
    if cfg.optimizer == "lion":
        return Lion(groups, lr=cfg.lr)
    if cfg.optimizer == "muon":
        if any(hasattr(p, "placements") for p in model.parameters()):
            raise ValueError("muon orthogonalises whole matrices and torch.optim.Muon does not "
                             "take sharded (DTensor) parameters: train with FSDP or TP using "
                             "another optimizer, or run muon with DDP or one process")
        hidden, rest = split_hidden(model, groups)
        if not hidden:
            raise ValueError("muon found no hidden matrices (2-D weights under 'blocks'); "
                             "use --optimizer adamw for this model")
        parts = [torch.optim.Muon(hidden, lr=cfg.lr, adjust_lr_fn="match_rms_adamw")]
        if rest:
            parts.append(torch.optim.AdamW(rest, lr=cfg.lr, betas=betas))
        return Composite(*parts)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas)
