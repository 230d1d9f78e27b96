"""LoRA from scratch: a low-rank update beside a frozen linear layer, injected by module name,
counted as peft counts it, merged back into the weight; and QLoRA, the same on an NF4 base.

A frozen linear layer y = W x gains a trainable update: y = W x + (alpha / r) B A x, with
A (r x in) and B (out x r), so that the update has rank at most r and costs r (in + out)
parameters instead of in * out (Hu et al. 2022, Section 4.1). B starts at zero, so training
starts from the base model exactly; A starts as peft starts it (`nn.init.kaiming_uniform_` with
a = sqrt(5), nn.Linear's own init: uniform in +-1/sqrt(in)). The scale alpha / r keeps the
update's size from changing with r when alpha is held fixed; rsLoRA's alpha / sqrt(r) (Kalajdzievski
2023) is the option `rslora`. Dropout, if any, applies to the adapter's input only.

`apply_lora` freezes every parameter of a model and wraps the linear layers whose names match
`targets` the way peft matches `target_modules` (the full name, or a suffix after a dot: "q"
matches "blocks.0.attn.q"; "all-linear" is every linear layer but the output head). It works on
the reference `Transformer` (attn.q, attn.k, attn.v, attn.o, mlp.gate, mlp.up, mlp.down) and on a
transformers model (q_proj, ..., down_proj); `HF_NAMES` translates, so either spelling works on
either model. `counts` gives (trainable, total) as peft's `get_nb_trainable_parameters`
does, a 4-bit weight counted at its logical size; `merge_and_unload` folds each update into its
weight and removes the adapters. `qlora` stores every linear layer of the blocks in NF4
(`align.nf4_linear`, as transformers' 4-bit loading does) and puts adapters on the targeted ones:
the frozen base in 4 bits, the adapters in fp32. `train_tokens` makes the embedding and output
rows of a few tokens trainable (peft's `trainable_token_indices`), for new special tokens.

tests/test_lora.py holds all of this to peft's LoRA on the same model exported to transformers:
the same counts, outputs, gradients and merged weights (`align.lora_check`).

Chapter: book/alignment/lora
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from . import nf4
from . import nf4_linear as NL

# peft's LoraConfig defaults and initialisation this module follows; tests/test_lora.py asserts
# each against the installed peft, so an upgrade that changes one fails a test.
PEFT_DEFAULT_R = 8
PEFT_DEFAULT_ALPHA = 8
PEFT_DEFAULT_DROPOUT = 0.0
PEFT_DEFAULT_RSLORA = False
PEFT_DEFAULT_BIAS = "none"  # adapters have no bias of their own
PEFT_INIT_A_KAIMING_A = math.sqrt(5)  # init_lora_weights=True: kaiming_uniform_(A, a=sqrt(5))
PEFT_AUTOCAST_ADAPTER_DTYPE = True  # get_peft_model: fp32 adapters on a bf16/fp16 base
ALL_LINEAR = "all-linear"  # peft's shorthand: every linear layer but the output layer
OUTPUT_LAYERS = ("head", "lm_head")  # left out of "all-linear" (ours, transformers')
# reference model name -> transformers Llama name (the suffixes peft's target_modules take)
HF_NAMES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
            "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
ATTENTION, MLP = ("q", "k", "v", "o"), ("gate", "up", "down")
Targets = str | list[str] | tuple[str, ...]  # 'q,v', ['q_proj', 'v_proj'] or 'all-linear'


class LoRALinear(nn.Module):
    """A frozen base layer (nn.Linear or nf4_linear.NF4Linear) plus (alpha / r) B A x.

    Adapters are fp32 when the base is 16-bit (peft's autocast_adapter_dtype); the adapter path
    computes in their dtype and the sum returns in the base output's dtype, as peft does."""

    def __init__(self, base: nn.Module, r: int = PEFT_DEFAULT_R,
                 alpha: float = PEFT_DEFAULT_ALPHA, dropout: float = PEFT_DEFAULT_DROPOUT,
                 rslora: bool = PEFT_DEFAULT_RSLORA):
        super().__init__()
        check_hyper(r, alpha, dropout)
        if not isinstance(base, (nn.Linear, NL.NF4Linear)):
            raise ValueError(f"LoRA wraps nn.Linear or NF4Linear layers, got {type(base).__name__}")
        self.base = base
        for p in base.parameters():
            p.requires_grad_(False)
        ref = base.weight if isinstance(base, nn.Linear) else base.absmax
        dtype = torch.float32 if ref.dtype in (torch.bfloat16, torch.float16, torch.uint8) \
            else ref.dtype
        self.in_features, self.out_features = base.in_features, base.out_features
        self.r, self.alpha, self.rslora = r, float(alpha), bool(rslora)
        self.scaling = alpha / math.sqrt(r) if rslora else alpha / r
        self.lora_A = nn.Parameter(torch.empty(r, self.in_features, device=ref.device,
                                               dtype=dtype))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, r, device=ref.device,
                                               dtype=dtype))
        nn.init.kaiming_uniform_(self.lora_A, a=PEFT_INIT_A_KAIMING_A)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.merged = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.merged:
            return y
        a = F.linear(self.dropout(x.to(self.lora_A.dtype)), self.lora_A)
        return (y + F.linear(a, self.lora_B) * self.scaling).to(y.dtype)

    def delta_weight(self) -> torch.Tensor:
        """(alpha / r) B A, the update the adapter adds to W (out x in, fp32)."""
        return (self.lora_B @ self.lora_A) * self.scaling

    @torch.no_grad()
    def merge(self) -> None:
        """W += (alpha / r) B A, in W's dtype; the adapter path is then skipped."""
        self._check_mergeable("merge")
        if not self.merged:
            w = self.base.weight
            w.copy_((w.float() + self.delta_weight().float()).to(w.dtype))
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """W -= (alpha / r) B A: the base weight back (to rounding, in a 16-bit W)."""
        self._check_mergeable("unmerge")
        if self.merged:
            w = self.base.weight
            w.copy_((w.float() - self.delta_weight().float()).to(w.dtype))
            self.merged = False

    def _check_mergeable(self, what: str) -> None:
        if not isinstance(self.base, nn.Linear):
            raise ValueError(f"cannot {what} into a 4-bit weight (it would be re-quantised); "
                             "dequantise the base to bf16/fp32 first and merge there")

    def extra_repr(self) -> str:
        rule = "alpha/sqrt(r)" if self.rslora else "alpha/r"
        return f"r={self.r}, alpha={self.alpha:g}, scaling={self.scaling:g} ({rule})"


def check_hyper(r: int, alpha: float, dropout: float) -> None:
    """Reject a rank, alpha or dropout that LoRA cannot use, before any work."""
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"rank r must be a whole number >= 1, got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or \
            not math.isfinite(alpha) or alpha <= 0:
        raise ValueError(f"alpha must be a finite number > 0, got {alpha!r}")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or \
            not 0 <= dropout < 1:
        raise ValueError(f"dropout must be a probability in [0, 1), got {dropout!r}")


def _aliases(target: str) -> set[str]:
    """A target and its other spelling: "q" <-> "q_proj", "attn.q" <-> "self_attn.q_proj"."""
    back = {v: k for k, v in HF_NAMES.items()}
    head, _, last = target.rpartition(".")
    out = {target}
    for table in (HF_NAMES, back):
        if last in table:
            out.add(table[last])
            if head:
                prefix = {"attn": "self_attn", "self_attn": "attn"}.get(head, head)
                out.add(f"{prefix}.{table[last]}")
    return out


def normalize_targets(targets: Targets) -> list[str]:
    """Targets as a list of names: a comma-separated string, or a list of names."""
    if isinstance(targets, str):
        targets = [t for t in targets.replace(",", " ").split()]
    if not isinstance(targets, (list, tuple)) or not targets or \
            not all(isinstance(t, str) and t.strip() for t in targets):
        raise ValueError(f"targets must name linear layers (e.g. 'q,v', 'all-linear' or "
                         f"'q_proj v_proj'), got {targets!r}")
    return [t.strip() for t in targets]


def target_names(model: nn.Module, targets: Targets) -> list[str]:
    """Full names of the linear layers `targets` select, peft's rule: a module matches a target
    that is its whole name or a suffix after a dot. Every target must match something."""
    targets = normalize_targets(targets)
    linear = [n for n, m in model.named_modules()
              if isinstance(m, (nn.Linear, NL.NF4Linear, LoRALinear))]
    if ALL_LINEAR in targets:
        if len(targets) > 1:
            raise ValueError(f"'{ALL_LINEAR}' already selects every linear layer; give it alone")
        return [n for n in linear if n.rpartition(".")[2] not in OUTPUT_LAYERS]
    chosen, unmatched = [], []
    for t in targets:
        names = _aliases(t)
        hits = [n for n in linear if any(n == a or n.endswith("." + a) for a in names)]
        if not hits:
            unmatched.append(t)
        chosen += [n for n in hits if n not in chosen]
    if unmatched:
        suffixes = sorted({n.rpartition(".")[2] for n in linear})
        raise ValueError(f"targets {unmatched} match no linear layer of this model; its layers "
                         f"end in: {', '.join(suffixes)} (or use '{ALL_LINEAR}')")
    return [n for n in linear if n in chosen]


def _swap(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def apply_lora(model: nn.Module, targets: Targets = ALL_LINEAR, r: int = PEFT_DEFAULT_R,
               alpha: float = PEFT_DEFAULT_ALPHA, dropout: float = PEFT_DEFAULT_DROPOUT,
               rslora: bool = PEFT_DEFAULT_RSLORA) -> nn.Module:
    """Freeze every parameter and wrap the targeted linear layers in LoRALinear, in place;
    returns the model. Works on a model on the meta device (for counting)."""
    check_hyper(r, alpha, dropout)
    names = target_names(model, targets)
    modules = dict(model.named_modules())
    if any(isinstance(modules[n], LoRALinear) for n in names):
        raise ValueError("this model already has LoRA adapters on those layers; merge or "
                         "start from a fresh model")
    check_rank(r, [modules[n] for n in names])
    for p in model.parameters():
        p.requires_grad_(False)
    for n in names:
        _swap(model, n, LoRALinear(modules[n], r, alpha, dropout, rslora))
    return model


def check_rank(r: int, layers: list[nn.Module]) -> None:
    """B A has rank at most min(in, out) of its layer: a larger r only adds parameters."""
    narrow = min(min(m.in_features, m.out_features) for m in layers)
    if r > narrow:
        raise ValueError(f"rank {r} exceeds {narrow}, the smallest width of the targeted layers: "
                         f"use a rank <= {narrow} (an update of a {narrow}-wide layer has at "
                         f"most rank {narrow})")


def qlora(model: nn.Module, targets: Targets = ALL_LINEAR, r: int = PEFT_DEFAULT_R,
          alpha: float = PEFT_DEFAULT_ALPHA, dropout: float = PEFT_DEFAULT_DROPOUT,
          rslora: bool = PEFT_DEFAULT_RSLORA, double: bool = True,
          blocksize: int = nf4.BLOCKSIZE) -> nn.Module:
    """QLoRA: every linear layer but the output head to NF4 (with double quantisation), as
    transformers' 4-bit loading does whatever the targets, then LoRA on the targeted ones.
    Embeddings, norms and the head stay as they are."""
    check_hyper(r, alpha, dropout)
    target_names(model, targets)  # bad targets fail before anything is quantised
    NL.quantize_linears(model, target_names(model, ALL_LINEAR), "nf4", blocksize, double)
    return apply_lora(model, targets, r, alpha, dropout, rslora)


class TokenRows(nn.Module):
    """Trainable rows of a frozen embedding or output layer, for a few token ids: the layer's
    output plus a delta on those rows only (peft's `trainable_token_indices`, which trains the
    embeddings of new special tokens without the whole vocabulary). Deltas start at zero."""

    def __init__(self, base: nn.Module, ids: list[int]):
        super().__init__()
        if not isinstance(base, (nn.Embedding, nn.Linear)):
            raise ValueError(f"TokenRows wraps an nn.Embedding or the output nn.Linear, got "
                             f"{type(base).__name__}")
        vocab, width = base.weight.shape
        if not ids or len(set(ids)) != len(ids) or not all(
                isinstance(i, int) and 0 <= i < vocab for i in ids):
            raise ValueError(f"ids must be distinct token ids in [0, {vocab}), got {ids!r}")
        self.base = base
        for p in base.parameters():
            p.requires_grad_(False)
        w = base.weight
        self.register_buffer("ids", torch.tensor(ids, device=w.device))
        slot = torch.zeros(vocab, dtype=torch.long, device=w.device)  # 0: no delta
        slot[self.ids] = torch.arange(1, len(ids) + 1, device=w.device)
        self.register_buffer("slot", slot)
        self.delta = nn.Parameter(torch.zeros(len(ids), width, device=w.device, dtype=w.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if isinstance(self.base, nn.Embedding):  # row 0 of the padded table is zero
            table = torch.cat([self.delta.new_zeros(1, self.delta.shape[1]), self.delta])
            return y + F.embedding(self.slot[x], table)
        return y.index_add(-1, self.ids, F.linear(x, self.delta))


def train_tokens(model: nn.Module, ids: list[int]) -> nn.Module:
    """Make the embedding and output rows of `ids` trainable on a reference Transformer (the
    rest of both stays frozen), in place; returns the model."""
    if not all(hasattr(model, n) for n in ("embed", "head")) or model.cfg.tied:
        raise ValueError("train_tokens works on the reference Transformer with an untied head "
                         "(the llama flavour)")
    model.embed, model.head = TokenRows(model.embed, ids), TokenRows(model.head, ids)
    return model


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def counts(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters as peft's get_nb_trainable_parameters counts them: each
    parameter once (tied weights once), a 4-bit weight at its logical size."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    total += sum(m.numel_weight for m in model.modules() if isinstance(m, NL.NF4Linear))
    return trainable, total


def peft_line(trainable: int, total: int) -> str:
    """The line peft's print_trainable_parameters prints."""
    if total <= 0:
        raise ValueError(f"total must be positive, got {total}")
    return (f"trainable params: {trainable:,d} || all params: {total:,d} || "
            f"trainable%: {100 * trainable / total:.4f}")


@torch.no_grad()
def merge_and_unload(model: nn.Module) -> nn.Module:
    """Fold every adapter into its weight and put the plain base layer back, in place (peft's
    merge_and_unload); the returned model has no LoRA modules and the same function."""
    layers = lora_layers(model)
    if not layers:
        raise ValueError("the model has no LoRA adapters to merge")
    for name, layer in layers.items():
        layer.merge()
        _swap(model, name, layer.base)
    return model
