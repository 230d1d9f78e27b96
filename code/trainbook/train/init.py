"""The trainer's initialisations: how the model's weights are drawn before step 0, and the
per-parameter learning-rate factors a parametrisation asks for.

Three schemes, all rescalings of the draw `Transformer.__init__` already made (so they use no
random numbers and runs under different schemes start from the same directions):

- "scaled" (the default): the reference model's own init, GPT-2's: every matrix N(0, 0.02^2),
  the residual stream's output projections (attention `o`, MLP `down`) N(0, (0.02/sqrt(2L))^2).
- "standard": every matrix N(0, 0.02^2), no residual scaling (the projections multiplied back
  by sqrt(2L)).
- "mup": the Maximal Update Parametrization for Adam (Yang et al. 2022, Tensor Programs V), in
  the formulation of their Table 8 (the one that allows a tied embedding and head), relative
  to a base width: with m = d_model / base_width, hidden matrices get init std / sqrt(m) and
  learning rate / m, the output weights (head, MoE router) a 1/m multiplier on their output
  (a forward hook), attention 1/head_dim scaling (`softmax_scale`), and everything else
  (embeddings, biases, norm gains) stays as it is. At m = 1 the model is the reference one.

Chapter: book/pretraining/initialisation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import configs
from .config import INITS

__all__ = ["INITS", "MupRule", "base_width_of", "init_weights", "lr_scale", "mup_rule",
           "param_kind"]

PROJECTIONS = ("o.weight", "down.weight")  # write into the residual stream: 1/sqrt(2L) in "scaled"
INPUTS = ("embed.weight", "pos.weight")  # map a fixed size (vocabulary, positions) to the width
OUTPUTS = ("head", "router")  # modules that map the width to a fixed size (logits, experts)


def param_kind(name: str, ndim: int) -> str:
    """muP's class of a parameter, by its (possibly prefixed) name: "input" (embeddings and
    every vector: biases, norm gains), "output" (head, router) or "hidden" (the other
    matrices). TP5 Table 3's columns are "input weights & all biases", "output weights",
    "hidden weights"."""
    if ndim < 2 or name.endswith(INPUTS):
        return "input"
    if name.endswith(tuple(f"{m}.weight" for m in OUTPUTS)):
        return "output"
    return "hidden"


@dataclass(frozen=True)
class MupRule:
    """How muP changes one class of parameter at width multiplier m, relative to the base."""

    init_std: float  # factor on the base init's standard deviation
    lr: float  # factor on the (Adam) learning rate
    multiplier: float  # factor on the module's output in the forward pass


def mup_rule(kind: str, width_mult: float) -> MupRule:
    """TP5 Table 8 (Adam), relative to the base width: init variance 1/fan_in for hidden
    weights and constant for input and output weights; Adam LR 1/fan_in for hidden weights
    and constant otherwise; a 1/fan_in multiplier on output weights."""
    if width_mult <= 0:
        raise ValueError(f"width multiplier must be positive, got {width_mult}")
    if kind == "hidden":
        return MupRule(1 / math.sqrt(width_mult), 1 / width_mult, 1.0)
    if kind == "output":
        return MupRule(1.0, 1.0, 1 / width_mult)
    if kind == "input":
        return MupRule(1.0, 1.0, 1.0)
    raise ValueError(f"parameter kind must be input, hidden or output, got {kind!r}")


def base_width_of(cfg: configs.ModelConfig, base_width: int | None = None) -> int:
    """muP's base width: `base_width` if given, else the d_model of the preset the model is
    named after (a model that is no preset is its own base: muP then equals "scaled")."""
    if base_width is not None:
        if isinstance(base_width, bool) or not isinstance(base_width, int) or base_width < 1:
            raise ValueError(f"mup base width must be a positive integer, got {base_width!r}")
        return base_width
    return configs.PRESETS[cfg.name].d_model if cfg.name in configs.PRESETS else cfg.d_model


def _output_multiplier(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    return out * module.mup_output_mult  # a forward hook: muP's 1/m on the readout


@torch.no_grad()
def init_weights(model: torch.nn.Module, scheme: str, base_width: int | None = None) -> None:
    """Initialise a freshly built reference `Transformer` in place under `scheme` (see the
    module docstring). `base_width` is muP's base d_model (default: the preset's); the other
    schemes ignore it. The muP family scales d_model, d_ff and head_dim together, with heads,
    layers and vocabulary fixed, so one width multiplier m = d_model / base_width holds for
    every matrix."""
    if scheme not in INITS:
        raise ValueError(f"init must be one of {', '.join(INITS)}, got {scheme!r}")
    cfg = getattr(model, "cfg", None)
    if not isinstance(cfg, configs.ModelConfig):
        raise ValueError(f"init_weights needs the reference Transformer (with .cfg), "
                         f"got {type(model).__name__}")
    if hasattr(model, "init_scheme"):  # the rescalings below would compound
        raise ValueError(f"this model was already initialised under {model.init_scheme}; "
                         "build a fresh one")
    if scheme == "scaled":  # what Transformer.__init__ drew: nothing to redo
        return
    model.init_scheme = scheme
    if scheme == "standard":
        for name, p in model.named_parameters():
            if p.dim() >= 2 and name.endswith(PROJECTIONS):
                p.mul_(math.sqrt(2 * cfg.n_layers))  # N(0, 0.02^2 / 2L) -> N(0, 0.02^2)
        return
    m = cfg.d_model / base_width_of(cfg, base_width)
    for name, p in model.named_parameters():
        rule = mup_rule(param_kind(name, p.dim()), m)
        if rule.init_std != 1.0:
            p.mul_(rule.init_std)
    for name, module in model.named_modules():
        module.mup_width_mult = m  # lr_scale reads it, under any wrapper or pipeline stage
        if hasattr(module, "softmax_scale"):
            # 1/head_dim attention (TP5 Definition 4.1), equal to 1/sqrt(head_dim) at the base
            module.softmax_scale = 1.0 / math.sqrt(cfg.head_dim) / math.sqrt(m)
        if name.rsplit(".", 1)[-1] in OUTPUTS and isinstance(module, torch.nn.Linear):
            module.mup_output_mult = mup_rule("output", m).multiplier
            module.register_forward_hook(_output_multiplier)


def lr_scale(model: torch.nn.Module, name: str, scheme: str) -> float:
    """The factor on the schedule's learning rate for parameter `name` of `model` under
    `scheme`: 1 except under muP, where hidden matrices get 1/m. `name` is as
    `model.named_parameters()` gives it (a wrapper's prefix such as "0." is fine)."""
    if scheme not in INITS:
        raise ValueError(f"init must be one of {', '.join(INITS)}, got {scheme!r}")
    if scheme != "mup":
        return 1.0
    path = name.rsplit(".", 1)[0] if "." in name else ""
    try:
        module = model.get_submodule(path)
        ndim = model.get_parameter(name).dim()
    except AttributeError:
        raise ValueError(f"{type(model).__name__} has no parameter {name!r}") from None
    m = getattr(module, "mup_width_mult", None)
    if m is None:
        raise ValueError(f"parameter {name!r} was not initialised under mup: call "
                         "init_weights(model, 'mup') before building the optimizer")
    return mup_rule(param_kind(name, ndim), m).lr
