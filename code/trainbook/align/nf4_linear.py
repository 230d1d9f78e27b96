"""A frozen linear layer whose weight is stored in NF4 (`align.nf4`) and dequantised on the fly:
QLoRA's base layer, from scratch.

`NF4Linear` quantises an nn.Linear's weight at construction (NF4, blocks of 64, double
quantisation by default) and keeps only the packed codes and constants as buffers. `forward`
dequantises the weight to the input's dtype for one matmul. The backward pass matters as much:
`F.linear(x, dequantised W)` would make autograd keep the dequantised W to compute x's gradient,
a full-precision copy of every layer until backward; `_DequantizedLinear` keeps nothing and
dequantises again in backward (what bitsandbytes' `MatMul4Bit` does), so a 4-bit model stays
4-bit while it trains. `saved_for_backward` measures what autograd keeps; `quantize_linears`
swaps named layers of a model for NF4 ones.

Chapter: book/alignment/lora
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .nf4 import BLOCKSIZE, Quantized, dequantize, quantize


class _DequantizedLinear(torch.autograd.Function):
    """y = x W^T + b with W dequantised in forward and again in backward: autograd keeps the
    4-bit codes (module buffers), not a full-precision copy of W per layer. W is frozen: only x
    gets a gradient."""

    @staticmethod
    def forward(ctx, x, module):
        ctx.module = module
        return F.linear(x, module.weight_dequantized(x.dtype), module.bias)

    @staticmethod
    def backward(ctx, grad):
        return grad @ ctx.module.weight_dequantized(grad.dtype), None


class NF4Linear(nn.Module):
    """A frozen nn.Linear whose weight is stored in a 4-bit type (NF4 by default, with double
    quantisation) and dequantised for each matmul, in the input's dtype. The bias, if any,
    stays a frozen parameter in its dtype. `numel_weight` is the logical size, for counting."""

    def __init__(self, linear: nn.Linear, kind: str = "nf4", blocksize: int = BLOCKSIZE,
                 double: bool = True):
        super().__init__()
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"NF4Linear wraps an nn.Linear, got {type(linear).__name__}")
        if linear.weight.device.type == "meta":
            raise ValueError("cannot quantise a weight on the meta device: materialise it first "
                             "(count a meta model with align.lora.counts instead)")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q = quantize(linear.weight.detach(), kind, blocksize, double)
        self.kind, self.blocksize, self.shape = kind, blocksize, q.shape
        self.dq_blocksize, self.offset = q.dq_blocksize, q.offset
        self.register_buffer("packed", q.packed)
        self.register_buffer("absmax", q.absmax)
        self.register_buffer("absmax2", q.absmax2)
        self.bias = None if linear.bias is None else \
            nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.numel_weight = linear.weight.numel()

    def quantized(self) -> Quantized:
        return Quantized(self.packed, self.absmax, self.shape, self.kind, self.blocksize,
                         self.offset, self.absmax2, self.dq_blocksize)

    def weight_dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.quantized(), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            return _DequantizedLinear.apply(x, self)
        return F.linear(x, self.weight_dequantized(x.dtype), self.bias)

    def extra_repr(self) -> str:
        dq = ", double quant" if self.absmax2 is not None else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"{self.kind}, block {self.blocksize}{dq}")


def saved_for_backward(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> int:
    """Bytes autograd keeps for backward while `fn(*inputs)` runs (each saved tensor counted
    once per save, parameters and buffers included), then runs the backward pass."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.nbytes
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*inputs)
    out.float().sum().backward()
    return total


def quantize_linears(model: nn.Module, names: list[str], kind: str = "nf4",
                     blocksize: int = BLOCKSIZE, double: bool = True) -> nn.Module:
    """Replace the nn.Linear modules called `names` (full names, as model.named_modules gives
    them) by NF4Linear, in place; returns the model. Everything else is left as it is."""
    modules = dict(model.named_modules())
    missing = [n for n in names if not isinstance(modules.get(n), nn.Linear)]
    if missing:
        raise ValueError(f"not nn.Linear modules of this model: {missing[:3]}; pass full names "
                         "from model.named_modules()")
    for name in names:
        parent, _, child = name.rpartition(".")
        setattr(modules[parent] if parent else model, child,
                NF4Linear(modules[name], kind, blocksize, double))
    return model
