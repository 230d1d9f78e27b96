"""Image tokens of real vision encoders, and what they cost the language model.

A ViT with patch size p at resolution r makes floor(r / p)^2 patch tokens (the patch
convolution has stride p and no padding: pixels past the last whole patch are dropped, which is
why SigLIP so400m/14 at 384 pixels gives 27 x 27 = 729), plus one CLS token for ViT and CLIP.
LLaVA drops the CLS token and feeds the patch tokens to the language model, so one image adds
`image_tokens` positions to the sequence: 576 for CLIP ViT-L/14 at 336 pixels (LLaVA-1.5), five
times that for LLaVA-NeXT's 2 x 2 tiles plus a downscaled overview. `ENCODERS` holds the numbers
of the released configs (the `config.json` of each Hugging Face checkpoint named, and the paper);
`table` ties each to sequence length, the language model's training FLOPs
(`compute.flops.training_flops`), the encoder's forward FLOPs (`vision.forward_flops`) and the
activation memory of a production Llama stack (`compute.activations`), per stage of the recipe:
stage 1 runs the frozen language model forward and backward for the input gradients only (the
projector needs them; no weight gradients), stage 2 trains it in full; the frozen encoder runs
forward only in both.

Chapter: book/frontier/multimodal
"""

from __future__ import annotations

from dataclasses import dataclass

from ..compute import activations as A
from ..compute.flops import forward_flops, training_flops
from ..configs import PRESETS, ModelConfig
from .vision import ViTConfig
from .vision import forward_flops as vit_flops

GiB = 2 ** 30


@dataclass(frozen=True)
class Encoder:
    """A released image encoder's shape (from its config.json), and the source."""

    name: str
    image_size: int
    patch_size: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    cls: bool
    source: str

    @property
    def grid(self) -> int:
        """Patches per side: floor(image_size / patch_size)."""
        return self.image_size // self.patch_size

    @property
    def n_patches(self) -> int:
        return self.grid ** 2

    @property
    def n_tokens(self) -> int:
        """Tokens the encoder itself runs on (patches, plus CLS where it has one)."""
        return self.n_patches + int(self.cls)

    def vit_config(self) -> ViTConfig:
        """The ViTConfig of the pixels the patch convolution covers (grid x patch per side)."""
        return ViTConfig(image_size=self.grid * self.patch_size, patch_size=self.patch_size,
                         d_model=self.d_model, n_layers=self.n_layers, n_heads=self.n_heads,
                         d_ff=self.d_ff, cls=self.cls)


ENCODERS: dict[str, Encoder] = {e.name: e for e in [
    # Dosovitskiy et al. 2021, Table 1 (ViT-Base); google/vit-base-patch16-224 config.json
    Encoder("ViT-B/16 @224", 224, 16, 768, 12, 12, 3072, True, "dosovitskiy2021vit"),
    # Radford et al. 2021; openai/clip-vit-large-patch14 config.json (vision_config): LLaVA
    Encoder("CLIP ViT-L/14 @224", 224, 14, 1024, 24, 16, 4096, True, "radford2021clip"),
    # openai/clip-vit-large-patch14-336 config.json (vision_config): LLaVA-1.5
    Encoder("CLIP ViT-L/14 @336", 336, 14, 1024, 24, 16, 4096, True, "radford2021clip"),
    # Zhai et al. 2023; google/siglip-so400m-patch14-384 config.json (vision_config)
    Encoder("SigLIP so400m/14 @384", 384, 14, 1152, 27, 16, 4304, False, "zhai2023siglip"),
]}


def image_tokens(encoder: Encoder, tiles: int = 1, keep_cls: bool = False) -> int:
    """Tokens one image adds to the language model's sequence: patch tokens per tile (CLS
    dropped, as LLaVA does, unless keep_cls) times the tiles (LLaVA-NeXT: 2 x 2 tiles and a
    downscaled overview make 5)."""
    if not isinstance(encoder, Encoder):
        raise TypeError(f"image_tokens needs an Encoder (see ENCODERS), got "
                        f"{type(encoder).__name__}")
    if isinstance(tiles, bool) or not isinstance(tiles, int) or tiles < 1:
        raise ValueError(f"tiles must be a whole number >= 1, got {tiles!r}")
    per = encoder.n_patches + int(keep_cls and encoder.cls)
    return per * tiles


def step_flops(lm: ModelConfig, encoder: Encoder, text_tokens: int, images: int = 1,
               stage: int = 2, tiles: int = 1) -> dict[str, float]:
    """Matmul FLOPs of one sample (`images` images of `tiles` tiles and `text_tokens` text
    tokens) in stage 1 or 2: "lm" (forward + backward: 2x forward in stage 1, input gradients
    only; 3x in stage 2), "encoder" (forward only, frozen), "total", and "seq" the length."""
    if not isinstance(lm, ModelConfig):
        raise TypeError(f"lm must be a ModelConfig, got {type(lm).__name__}")
    if stage not in (1, 2):
        raise ValueError(f"stage must be 1 or 2, got {stage!r}")
    if isinstance(text_tokens, bool) or not isinstance(text_tokens, int) or text_tokens < 0:
        raise ValueError(f"text_tokens must be a whole number >= 0, got {text_tokens!r}")
    if isinstance(images, bool) or not isinstance(images, int) or images < 0:
        raise ValueError(f"images must be a whole number >= 0, got {images!r}")
    seq = text_tokens + images * image_tokens(encoder, tiles)
    if seq < 1:
        raise ValueError("a sample needs at least one token")
    llm = 2 * forward_flops(lm, seq)["total"] if stage == 1 else training_flops(lm, seq)["total"]
    enc = vit_flops(encoder.vit_config(), images * tiles)["total"] if images else 0
    return {"seq": seq, "lm": float(llm), "encoder": float(enc), "total": float(llm + enc)}


def activation_gib(lm: ModelConfig, seq: int, micro_batch: int = 1, dtype: str = "bf16") -> float:
    """Activation memory (GiB) the language model keeps for backward at this sequence length:
    the production Llama estimate of `compute.activations`, all layers and the final norm."""
    if not isinstance(lm, ModelConfig):
        raise TypeError(f"lm must be a ModelConfig, got {type(lm).__name__}")
    per_layer = A.layer_bytes(lm, micro_batch, seq, dtype, "production")
    return (lm.n_layers * per_layer + A.head_bytes(lm, micro_batch, seq, dtype,
                                                   "production")) / GiB


def table(lm: ModelConfig | None = None, text_tokens: int = 128) -> list[dict]:
    """One row per encoder (and LLaVA-NeXT's five tiles of CLIP ViT-L/14 @336): tokens per
    image, sequence length with `text_tokens` of text, attention's share of the language
    model's FLOPs, FLOPs per sample in each stage and activation memory. Default language
    model: Llama-2-7B, the shape of Vicuna-7B v1.5 that LLaVA-1.5 trains."""
    lm = lm or PRESETS["llama-2-7b"]
    rows = []
    cases = [(e, 1) for e in ENCODERS.values()] + [(ENCODERS["CLIP ViT-L/14 @336"], 5)]
    for enc, tiles in cases:
        s2 = step_flops(lm, enc, text_tokens, 1, 2, tiles)
        s1 = step_flops(lm, enc, text_tokens, 1, 1, tiles)
        fwd = forward_flops(lm, s2["seq"])
        rows.append({
            "encoder": enc.name + (f" x {tiles} tiles" if tiles > 1 else ""),
            "grid": f"{enc.grid}x{enc.grid}", "encoder tokens": enc.n_tokens,
            "image tokens": image_tokens(enc, tiles), "seq": s2["seq"],
            "attention share": (fwd["attn_scores"] + fwd["attn_values"]) / fwd["total"],
            "stage 1 TFLOP": s1["total"] / 1e12, "stage 2 TFLOP": s2["total"] / 1e12,
            "encoder share": s2["encoder"] / s2["total"],
            "activations GiB": activation_gib(lm, s2["seq"]),
            "source": enc.source})
    return rows
