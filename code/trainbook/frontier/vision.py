"""A vision transformer (ViT) from scratch, and its match with transformers' ViT and CLIP.

An image of H x W pixels is cut into (H/p) x (W/p) square patches of p x p pixels; each patch,
flattened to C p^2 numbers, is multiplied by one matrix into a d-wide token (`patchify` then a
linear layer: exactly a convolution with kernel p and stride p, which is how transformers
stores it). A learned class token (CLS) may be prepended, learned position embeddings are added,
and a stack of pre-norm transformer blocks (LayerNorm, bidirectional attention, a GELU MLP) mixes
the tokens (Dosovitskiy et al. 2021). CLIP's image tower (Radford et al. 2021) is the same with
no patch bias, one more LayerNorm before the blocks and "quick GELU"; SigLIP has no CLS.

`ViT` holds those variants in one `ViTConfig`; `from_hf` builds one from a transformers
`ViTModel` or `CLIPVisionModel` and copies its weights, so the chapter checks this file against
transformers on the same weights (`hidden_states_of`). `forward_flops` counts the encoder's
matmul FLOPs, checked against torch's FLOP counter (`measured_forward_flops`).

Chapter: book/frontier/multimodal
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = ("gelu", "quick_gelu", "gelu_tanh")


@dataclass(frozen=True)
class ViTConfig:
    """An image encoder's shape. Defaults: the chapter's CPU encoder (16 x 16 RGB, 4 x 4
    patches, 16 patch tokens and a CLS token)."""

    image_size: int = 16
    patch_size: int = 4
    channels: int = 3
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 128
    cls: bool = True  # prepend a class token (ViT, CLIP); SigLIP has none
    patch_bias: bool = True  # ViT and SigLIP have one; CLIP has none
    pre_norm: bool = False  # CLIP's extra LayerNorm on the embeddings ("pre_layrnorm")
    final_norm: bool = True  # LayerNorm on the last hidden state (ViT, SigLIP; CLIP: pooled only)
    act: str = "gelu"
    eps: float = 1e-12

    def __post_init__(self):
        for name in ("image_size", "patch_size", "channels", "d_model", "n_layers", "n_heads",
                     "d_ff"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ViTConfig.{name} must be a positive whole number, got {v!r}")
        if self.image_size % self.patch_size:
            raise ValueError(f"image size {self.image_size} is not divisible by patch size "
                             f"{self.patch_size}; pick a patch size that tiles the image")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by {self.n_heads} heads")
        if self.act not in ACTIVATIONS:
            raise ValueError(f"act {self.act!r} is unknown; use one of {', '.join(ACTIVATIONS)}")
        if not self.eps > 0:
            raise ValueError(f"eps must be positive, got {self.eps!r}")

    @property
    def n_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def n_tokens(self) -> int:
        """Tokens the encoder runs on: the patches, plus one for CLS."""
        return self.n_patches + int(self.cls)


def patchify(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, N, C p^2): the patches in row-major order, each flattened channel
    first then rows then columns (the layout of a Conv2d weight (d, C, p, p))."""
    if images.dim() != 4:
        raise ValueError(f"images must be (batch, channels, height, width), got shape "
                         f"{tuple(images.shape)}")
    B, C, H, W = images.shape
    if isinstance(patch_size, bool) or not isinstance(patch_size, int) or patch_size < 1 or \
            H % patch_size or W % patch_size:
        raise ValueError(f"patch size {patch_size!r} must be a whole number dividing the image "
                         f"size {H} x {W}")
    p = patch_size
    x = images.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(B, (H // p) * (W // p), C * p * p)


def _act(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "quick_gelu":  # CLIP: x * sigmoid(1.702 x)
        return x * torch.sigmoid(1.702 * x)
    return F.gelu(x, approximate="tanh" if name == "gelu_tanh" else "none")


class EncoderBlock(nn.Module):
    """Pre-norm block: x + attn(norm1(x)), then x + mlp(norm2(x)); attention sees all tokens."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        d = cfg.d_model
        self.cfg = cfg
        self.norm1, self.norm2 = nn.LayerNorm(d, eps=cfg.eps), nn.LayerNorm(d, eps=cfg.eps)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(d, cfg.d_ff), nn.Linear(cfg.d_ff, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        h = self.norm1(x)
        q, k, v = (f(h).view(B, T, self.cfg.n_heads, -1).transpose(1, 2)
                   for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v)  # no causal mask: every patch sees all
        x = x + self.o(y.transpose(1, 2).reshape(B, T, d))
        return x + self.fc2(_act(self.cfg.act, self.fc1(self.norm2(x))))


class ViT(nn.Module):
    """Images (B, C, H, W) -> hidden states (B, n_tokens, d_model), CLS first when there is one."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        if not isinstance(cfg, ViTConfig):
            raise TypeError(f"ViT needs a ViTConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        d = cfg.d_model
        self.patch = nn.Linear(cfg.channels * cfg.patch_size ** 2, d, bias=cfg.patch_bias)
        self.cls = nn.Parameter(torch.randn(d) * 0.02) if cfg.cls else None
        self.pos = nn.Parameter(torch.randn(cfg.n_tokens, d) * 0.02)
        self.pre_norm = nn.LayerNorm(d, eps=cfg.eps) if cfg.pre_norm else None
        self.blocks = nn.ModuleList(EncoderBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(d, eps=cfg.eps) if cfg.final_norm else None

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """The patch embedding: patches times one matrix, CLS prepended, positions added."""
        c = self.cfg
        if images.dim() != 4 or tuple(images.shape[1:]) != (c.channels, c.image_size,
                                                            c.image_size):
            raise ValueError(f"images must be (batch, {c.channels}, {c.image_size}, "
                             f"{c.image_size}), got shape {tuple(images.shape)}")
        x = self.patch(patchify(images, c.patch_size))  # (B, N, d)
        if self.cls is not None:
            x = torch.cat([self.cls.expand(x.shape[0], 1, -1), x], dim=1)
        return x + self.pos

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.embed(images)
        if self.pre_norm is not None:
            x = self.pre_norm(x)
        for block in self.blocks:
            x = block(x)
        return x if self.norm is None else self.norm(x)

    def patch_features(self, images: torch.Tensor) -> torch.Tensor:
        """The patch tokens only (B, n_patches, d): CLS dropped, as LLaVA feeds the LLM."""
        x = self(images)
        return x[:, 1:] if self.cfg.cls else x


# ---- transformers: the same encoder, and its weights -------------------------------------------

def _kind(hf_model: nn.Module) -> str:
    kind = getattr(getattr(hf_model, "config", None), "model_type", None)
    if kind not in ("vit", "clip_vision_model"):
        raise ValueError(f"from_hf takes a transformers ViTModel or CLIPVisionModel, got "
                         f"{type(hf_model).__name__} (model_type {kind!r})")
    return kind


def config_from_hf(hf_config: object) -> ViTConfig:
    """The ViTConfig of a transformers ViTConfig or CLIPVisionConfig."""
    kind = getattr(hf_config, "model_type", None)
    if kind not in ("vit", "clip_vision_model"):
        raise ValueError(f"config_from_hf takes a transformers ViTConfig or CLIPVisionConfig, "
                         f"got model_type {kind!r}")
    c = hf_config
    act = {"gelu": "gelu", "quick_gelu": "quick_gelu", "gelu_pytorch_tanh": "gelu_tanh"}
    if c.hidden_act not in act:
        raise ValueError(f"activation {c.hidden_act!r} is not one of {sorted(act)}")
    clip = kind == "clip_vision_model"
    if not clip and not getattr(c, "qkv_bias", True):
        raise ValueError("ViT without q, k, v biases is not modelled here; use qkv_bias=True")
    return ViTConfig(image_size=c.image_size, patch_size=c.patch_size, channels=c.num_channels,
                     d_model=c.hidden_size, n_layers=c.num_hidden_layers,
                     n_heads=c.num_attention_heads, d_ff=c.intermediate_size, cls=True,
                     patch_bias=not clip, pre_norm=clip, final_norm=not clip,
                     act=act[c.hidden_act], eps=c.layer_norm_eps)


def _names(kind: str, n_layers: int) -> dict[str, str]:
    """This file's parameter names -> transformers' (5.x) names."""
    if kind == "vit":
        top = {"patch.weight": "embeddings.patch_embeddings.projection.weight",
               "patch.bias": "embeddings.patch_embeddings.projection.bias",
               "cls": "embeddings.cls_token", "pos": "embeddings.position_embeddings",
               "norm.weight": "layernorm.weight", "norm.bias": "layernorm.bias"}
        layer = "layers.{i}."
        parts = {"norm1": "layernorm_before", "norm2": "layernorm_after",
                 "q": "attention.q_proj", "k": "attention.k_proj", "v": "attention.v_proj",
                 "o": "attention.o_proj", "fc1": "mlp.fc1", "fc2": "mlp.fc2"}
    else:
        top = {"patch.weight": "embeddings.patch_embedding.weight",
               "cls": "embeddings.class_embedding", "pos": "embeddings.position_embedding.weight",
               "pre_norm.weight": "pre_layrnorm.weight", "pre_norm.bias": "pre_layrnorm.bias"}
        layer = "encoder.layers.{i}."
        parts = {"norm1": "layer_norm1", "norm2": "layer_norm2", "q": "self_attn.q_proj",
                 "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.out_proj",
                 "fc1": "mlp.fc1", "fc2": "mlp.fc2"}
    out = dict(top)
    for i in range(n_layers):
        for mine, theirs in parts.items():
            for p in ("weight", "bias"):
                out[f"blocks.{i}.{mine}.{p}"] = layer.format(i=i) + f"{theirs}.{p}"
    return out


@torch.no_grad()
def from_hf(hf_model: nn.Module) -> ViT:
    """A `ViT` with a transformers ViTModel's or CLIPVisionModel's weights (fp32 copies)."""
    kind = _kind(hf_model)
    cfg = config_from_hf(hf_model.config)
    model = ViT(cfg)
    theirs = hf_model.state_dict()
    theirs = {k.removeprefix("vision_model."): v for k, v in theirs.items()}
    names = _names(kind, cfg.n_layers)
    state = {}
    for mine, param in model.state_dict().items():
        if names.get(mine) not in theirs:
            raise ValueError(f"transformers model has no weight {names.get(mine)!r} for {mine}; "
                             "this mapping follows transformers 5.x names")
        state[mine] = theirs[names[mine]].reshape(param.shape).float()
    model.load_state_dict(state)
    return model.eval()


@torch.no_grad()
def hidden_states_of(hf_model: nn.Module, images: torch.Tensor) -> tuple[torch.Tensor,
                                                                          torch.Tensor]:
    """(patch embedding, last hidden state) of a transformers ViT or CLIP vision model, to
    compare with `ViT.embed` and `ViT.forward` on the same weights."""
    _kind(hf_model)
    core = getattr(hf_model, "vision_model", hf_model)
    emb = core.embeddings(images)
    out = hf_model(pixel_values=images).last_hidden_state
    return emb, out


# ---- FLOPs -----------------------------------------------------------------------------------

def forward_flops(cfg: ViTConfig, images: int = 1) -> dict[str, int]:
    """Matmul FLOPs of the encoder's forward pass over `images` images, by component (2 per
    multiply-add; attention over the full T x T square, T = n_tokens)."""
    if not isinstance(cfg, ViTConfig):
        raise TypeError(f"forward_flops needs a ViTConfig, got {type(cfg).__name__}")
    if isinstance(images, bool) or not isinstance(images, int) or images < 1:
        raise ValueError(f"images must be a whole number >= 1, got {images!r}")
    T, d, L = cfg.n_tokens, cfg.d_model, cfg.n_layers
    out = {"patch": 2 * cfg.n_patches * cfg.channels * cfg.patch_size ** 2 * d,
           "attn_proj": L * 2 * T * 4 * d * d, "attn_core": L * 2 * 2 * T * T * d,
           "mlp": L * 2 * 2 * T * d * cfg.d_ff}
    out = {k: v * images for k, v in out.items()}
    out["total"] = sum(out.values())
    return out


def measured_forward_flops(model: ViT, images: torch.Tensor) -> int:
    """FLOPs torch's `FlopCounterMode` counts for one forward pass, attention on the math SDPA
    kernel (the counter has no formula for the CPU flash kernel and would count it as zero)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    if not isinstance(model, ViT):
        raise TypeError(f"measured_forward_flops needs a ViT, got {type(model).__name__}")
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), counter:
        model(images)
    return counter.get_total_flops()
