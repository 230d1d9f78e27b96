"""The mixture-of-experts layer with the seams training needs, swapped in by a trainer hook.

`RoutedLayer` is built from the reference model's `MoE` (it keeps its router and experts, so
parameter names and initial values are the model's) and adds what `MoEOptions` asks for: the
router (`moe_router.ROUTERS`), a balancing loss ("switch": Switch's eq. 4 with top-k shares;
"sequence": DeepSeek-V3's sequence-wise loss) and the router z-loss (ST-MoE), each with its
coefficient; a capacity factor (assignments over ceil(C T k / E) per expert are dropped, GShard's
priority; None: dropless); DeepSeek-V3's bias balancing (a per-expert bias on the sigmoid scores,
for the choice only, moved by gamma after each step); and shared experts (DeepSeekMoE: the first
`n_shared` of the model's experts see every token, the router chooses among the rest).

The auxiliary losses reach the weights without changing the loss the trainer reports:
`AuxLossScaler` is the identity on the layer's output in the forward pass and, in the backward
pass, also sends the gradient `coefficient / micro-batches` into the layer's auxiliary loss, as
Megatron-Core's MoEAuxLossAutoScaler does. So `train.train` needs no change: `MoEHook` swaps
the layers in (`on_model`), sets the micro-batch scale (`on_batches`), and after each step
records the loads, drops and auxiliary losses in the step's history row and moves the biases
(`after_update`). `upcycle` copies a trained dense model into an MoE model's experts (sparse
upcycling, Komatsuzaki et al. 2022); the `Upcycle` hook does it at `on_model`.

Chapter: book/frontier/moe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..model import MoE
from ..parallel import moe_balance as mb
from ..parallel import moe_routing as mr
from ..train.hooks import Hook, StepContext
from . import moe_router as R

BALANCE = ("none", "switch", "sequence")


@dataclass(frozen=True)
class MoEOptions:
    """How the MoE layers route, balance and drop (see the module docstring)."""

    router: str = "mixtral"
    balance: str = "none"  # "switch" or "sequence" with balance_coef > 0
    balance_coef: float = 0.0  # alpha: Switch 1e-2, DeepSeek-V3's sequence-wise loss 1e-4
    z_coef: float = 0.0  # ST-MoE's router z-loss coefficient (1e-3 there)
    capacity_factor: float | None = None  # None: dropless
    bias_gamma: float = 0.0  # DeepSeek-V3's bias update speed (0.001 there); sigmoid router
    n_shared: int = 0  # shared experts: the first n_shared of the model's experts

    def __post_init__(self):
        if self.router not in R.ROUTERS:
            raise ValueError(f"router must be one of {', '.join(R.ROUTERS)}, got {self.router!r}")
        if self.balance not in BALANCE:
            raise ValueError(f"balance must be one of {', '.join(BALANCE)}, "
                             f"got {self.balance!r}")
        for name in ("balance_coef", "z_coef", "bias_gamma"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if (self.balance == "none") != (self.balance_coef == 0):
            raise ValueError(f"balance {self.balance!r} with balance_coef {self.balance_coef}: "
                             "give both (e.g. balance='switch', balance_coef=0.01) or neither")
        if self.capacity_factor is not None and not 0 < self.capacity_factor < math.inf:
            raise ValueError(f"capacity_factor must be positive (or None: dropless), "
                             f"got {self.capacity_factor}")
        if self.bias_gamma and self.router != "sigmoid":
            raise ValueError("bias balancing (bias_gamma > 0) steers DeepSeek-V3's sigmoid "
                             "router; set router='sigmoid'")
        if isinstance(self.n_shared, bool) or not isinstance(self.n_shared, int) \
                or self.n_shared < 0:
            raise ValueError(f"n_shared must be a whole number >= 0, got {self.n_shared!r}")


class AuxLossScaler(torch.autograd.Function):
    """Identity on `out`; backward also gives `aux` the gradient `scale` (Megatron-Core's
    MoEAuxLossAutoScaler), so d(total)/d(weights) includes scale * d(aux)/d(weights)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


def dispatch(x: torch.Tensor, experts: nn.ModuleList, weights: torch.Tensor,
             chosen: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """sum over each token's kept (token, slot) assignments of weight * expert(token)."""
    out = torch.zeros_like(x)
    for e, expert in enumerate(experts):
        mask = chosen == e if keep is None else (chosen == e) & keep
        token, slot = mask.nonzero(as_tuple=True)
        if token.numel():
            out.index_add_(0, token, expert(x[token]) * weights[token, slot, None].to(x.dtype))
    return out


class RoutedLayer(nn.Module):
    """An MoE layer with the options' router, losses, capacity, bias and shared experts, built
    from a `trainbook.model.MoE` (same parameters; a new router over the routed experts only
    when some are shared)."""

    def __init__(self, moe: MoE, options: MoEOptions):
        super().__init__()
        if not isinstance(moe, MoE):
            raise ValueError(f"RoutedLayer wraps a trainbook.model.MoE, got {type(moe).__name__}")
        n_routed = len(moe.experts) - options.n_shared
        if n_routed < 2 or moe.top_k > n_routed:
            raise ValueError(f"{len(moe.experts)} experts with {options.n_shared} shared leave "
                             f"{n_routed} routed for top_k {moe.top_k}: need at least "
                             f"max(2, top_k) routed experts")
        self.options, self.top_k = options, moe.top_k
        self.shared = nn.ModuleList(moe.experts[:options.n_shared])
        self.experts = nn.ModuleList(moe.experts[options.n_shared:])
        self.router = moe.router
        if options.n_shared:  # the router scores the routed experts only
            self.router = nn.Linear(moe.router.in_features, n_routed, bias=False)
            self.router.weight.data.copy_(moe.router.weight.data[options.n_shared:])
        self.register_buffer("bias", torch.zeros(n_routed) if options.router == "sigmoid"
                             else None)  # in the checkpoint, as DeepSeek-V3's
        self.scale = 1.0  # 1 / micro-batches per step (MoEHook sets it)
        self.reset_stats()

    def reset_stats(self) -> None:
        """Zero what training forwards accumulate between optimizer steps."""
        self.counts = torch.zeros(len(self.experts), dtype=torch.long)
        self.dropped, self.assigned, self.calls = 0, 0, 0
        self.balance_value, self.z_value = 0.0, 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, opt = x.shape, self.options
        flat = x.reshape(-1, shape[-1])
        logits = self.router(flat)
        r = R.route(logits, self.top_k, opt.router, self.bias if opt.bias_gamma else None)
        keep = None
        if opt.capacity_factor is not None:
            cap = mr.capacity(len(flat), len(self.experts), self.top_k, opt.capacity_factor)
            keep = mr.keep_mask(r.chosen, len(self.experts), cap)
        out = dispatch(flat, self.experts, r.weights, r.chosen, keep)
        for expert in self.shared:
            out = out + expert(flat)
        if self.training:
            out = self._account(out, logits, r, keep, shape)
        return out.reshape(shape)

    def _account(self, out, logits, r: R.Routing, keep, shape) -> torch.Tensor:
        """Record the step's loads and drops; attach the auxiliary losses to the output."""
        opt = self.options
        self.counts += mr.expert_counts(r.chosen.detach(), len(self.experts)).cpu()
        self.assigned += r.chosen.numel()
        self.dropped += 0 if keep is None else int((~keep).sum())
        self.calls += 1
        aux = None
        if opt.balance != "none":
            if opt.balance == "switch":
                bal = R.topk_loss(r.probs, r.chosen)
            else:
                bal = R.sequence_loss(r.probs, r.chosen, shape[-2] if len(shape) == 3
                                      else len(r.chosen))
            self.balance_value += bal.item()
            aux = opt.balance_coef * bal
        z = mr.router_z_loss(logits)  # recorded always: the size of the router logits
        self.z_value += z.item()
        if opt.z_coef:
            aux = opt.z_coef * z if aux is None else aux + opt.z_coef * z
        if aux is None:
            return out
        return AuxLossScaler.apply(out, aux, self.scale)


def routed_layers(model: nn.Module) -> list[RoutedLayer]:
    """The model's RoutedLayers, in block order."""
    return [m for m in model.modules() if isinstance(m, RoutedLayer)]


class MoEHook(Hook):
    """Swap every MoE block of the model for a RoutedLayer with `options`, and per step record
    `expert_counts` (layers x routed experts), `dropped_frac`, `balance_loss` and `z_loss` (means
    over the layers and micro-batches; z_loss, the router's mean squared log-sum-exp, is recorded
    whether or not it is trained on) in the history row, then move the biases."""

    def __init__(self, options: MoEOptions | None = None):
        self.options = options or MoEOptions()
        if not isinstance(self.options, MoEOptions):
            raise ValueError(f"options must be MoEOptions, got {type(options).__name__}")
        self.layers: list[RoutedLayer] = []

    def on_model(self, model: nn.Module) -> None:
        blocks = list(model.layers())
        if not any(isinstance(b.mlp, MoE) for b in blocks):
            raise ValueError("the model has no MoE layers to route: train an MoE model "
                             "(a config with n_experts > 1, e.g. tiny-mixtral)")
        for block in blocks:
            if isinstance(block.mlp, MoE):
                block.mlp = RoutedLayer(block.mlp, self.options)
        self.layers = routed_layers(model)

    def on_batches(self, step: int, batches: list) -> None:
        for layer in self.layers:
            layer.scale = 1.0 / len(batches)

    def before_update(self, ctx: StepContext) -> None:
        if ctx.loss_scale != 1.0 and (self.options.balance_coef or self.options.z_coef):
            raise ValueError("the auxiliary losses' gradient is not loss-scaled: train MoE "
                             "layers with auxiliary losses in fp32 or bf16, not fp16")

    def after_update(self, ctx: StepContext) -> None:
        counts = torch.stack([layer.counts for layer in self.layers])
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(counts)  # every rank moves its biases by the global load
        calls = sum(layer.calls for layer in self.layers) or 1
        rec = ctx.record
        rec["expert_counts"] = counts.tolist()
        rec["dropped_frac"] = sum(la.dropped for la in self.layers) / max(
            1, sum(la.assigned for la in self.layers))
        rec["balance_loss"] = sum(la.balance_value for la in self.layers) / calls
        rec["z_loss"] = sum(la.z_value for la in self.layers) / calls
        for layer, c in zip(self.layers, counts):
            if self.options.bias_gamma:
                layer.bias.copy_(mb.update_bias(layer.bias, c.to(layer.bias.device),
                                                self.options.bias_gamma))
            layer.reset_stats()


@torch.no_grad()
def upcycle(moe_model: nn.Module, dense_state: dict[str, torch.Tensor]) -> None:
    """Sparse upcycling: copy a dense model's weights into an MoE model of the same shape but
    its MLPs: every other weight by name, the dense MLP into every expert; the routers keep
    their fresh initialisation. With Mixtral's router (weights summing to 1) the upcycled model
    computes exactly what the dense one does, until the experts drift apart."""
    if not isinstance(dense_state, dict) or not dense_state:
        raise ValueError("give the dense model's state_dict")
    own = moe_model.state_dict()
    experts_of = {}
    for i, block in enumerate(moe_model.layers()):
        if not isinstance(block.mlp, MoE):
            raise ValueError(f"block {i} of the target has no trainbook.model.MoE to fill; "
                             "upcycle into a freshly built MoE model, before swapping layers")
        experts_of[i] = block.mlp.experts
    for name, value in dense_state.items():
        if ".mlp." in name:
            continue
        if name not in own or own[name].shape != value.shape:
            raise ValueError(f"dense weight {name} {tuple(value.shape)} has no match in the MoE "
                             "model: build it with the same d_model, layers, heads and vocabulary")
        own[name].copy_(value)
    for i, experts in experts_of.items():
        for part in ("gate", "up", "down"):
            key = f"blocks.{i}.mlp.{part}.weight"
            if key not in dense_state:
                raise ValueError(f"the dense state has no {key}: upcycle a llama-flavour dense "
                                 "model (SwiGLU MLP)")
            w = dense_state[key]
            for expert in experts:
                target: nn.Linear = getattr(expert, part)
                if target.weight.shape != w.shape:
                    raise ValueError(f"expert {part} {tuple(target.weight.shape)} differs from "
                                     f"the dense {tuple(w.shape)}: sparse upcycling copies the "
                                     "dense MLP, so give the experts the dense d_ff")
                target.weight.copy_(w)


class Upcycle(Hook):
    """`upcycle` at on_model, before MoEHook swaps the layers (pass it first)."""

    def __init__(self, dense_state: dict[str, torch.Tensor]):
        if not isinstance(dense_state, dict) or not dense_state:
            raise ValueError("give the dense model's state_dict")
        self.dense_state = dense_state

    def on_model(self, model: nn.Module) -> None:
        upcycle(model, self.dense_state)

