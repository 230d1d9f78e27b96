"""LLaVA: a vision encoder, a projector and a language model, trained in two stages.

`LLaVA` runs the image encoder (`vision.ViT`), keeps the patch tokens (CLS dropped), maps each
through the projector (LLaVA-1.5's two-layer GELU MLP, `projector`) into the language model's
embedding width, and writes them over the placeholder tokens of the text: the language model
(the book's reference `Transformer`, through its seams `embed_inputs`, `layers` and
`project_logits`) then reads a sequence in which some positions are images (Liu et al. 2023;
2024). Which positions is given by the placeholder id, so any number of images can sit anywhere
in any row of a batch (`multimodal_data.collate`).

The recipe (`set_stage`): stage 1 ("feature alignment") trains only the projector on captions,
encoder and language model frozen; stage 2 ("instruction tuning") trains the projector and the
language model on questions, the encoder still frozen. `changed` lists the parameters a step
really moved, so the chapter asserts stage 1 touched nothing but the projector. `answers`
decodes greedily and `accuracy` scores exact matches per kind of question.

Chapter: book/frontier/multimodal
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..align.task import EOS, PAD, ChatTokenizer
from ..model import Transformer
from . import multimodal_data as D
from .vision import ViT

STAGES = (1, 2)


def projector(d_vision: int, d_model: int, kind: str = "mlp2x_gelu") -> nn.Module:
    """LLaVA-1.5's projector (Linear, GELU, Linear) or LLaVA-1's single "linear" layer."""
    for name, v in (("d_vision", d_vision), ("d_model", d_model)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive whole number, got {v!r}")
    if kind == "linear":
        return nn.Linear(d_vision, d_model)
    if kind == "mlp2x_gelu":
        return nn.Sequential(nn.Linear(d_vision, d_model), nn.GELU(), nn.Linear(d_model, d_model))
    raise ValueError(f"projector kind {kind!r} is unknown; use 'mlp2x_gelu' or 'linear'")


class LLaVA(nn.Module):
    """forward(ids, images) -> logits (B, T, vocab); ids hold `image_id` where image tokens go."""

    def __init__(self, vision: ViT, lm: Transformer, image_id: int, kind: str = "mlp2x_gelu"):
        super().__init__()
        if not isinstance(vision, ViT) or not isinstance(lm, Transformer):
            raise TypeError("LLaVA needs a vision.ViT and a reference Transformer")
        if not 0 <= image_id < lm.cfg.vocab_size:
            raise ValueError(f"image_id {image_id} is outside the vocabulary of "
                             f"{lm.cfg.vocab_size}")
        self.vision, self.lm, self.image_id = vision, lm, image_id
        self.projector = projector(vision.cfg.d_model, lm.cfg.d_model, kind)

    @property
    def tokens_per_image(self) -> int:
        return self.vision.cfg.n_patches

    def image_tokens(self, images: torch.Tensor) -> torch.Tensor:
        """(n_images, 3, H, W) -> projected patch tokens (n_images, n_patches, d_model)."""
        return self.projector(self.vision.patch_features(images))

    def forward(self, ids: torch.Tensor, images: torch.Tensor | None = None) -> torch.Tensor:
        if ids.dim() != 2:
            raise ValueError(f"ids must be (batch, time), got shape {tuple(ids.shape)}")
        if ids.shape[1] > self.lm.cfg.max_seq_len:
            raise ValueError(f"sequence length {ids.shape[1]} exceeds max_seq_len "
                             f"{self.lm.cfg.max_seq_len}")
        slots = ids == self.image_id
        n_img = 0 if images is None else images.shape[0]
        if int(slots.sum()) != n_img * self.tokens_per_image:
            raise ValueError(f"the ids hold {int(slots.sum())} image placeholders but "
                             f"{n_img} images give {n_img * self.tokens_per_image} tokens; "
                             "build batches with multimodal_data.collate")
        x, rope = self.lm.embed_inputs(ids)
        if n_img:
            feats = self.image_tokens(images).to(x.dtype)
            x = x.masked_scatter(slots[..., None].expand_as(x), feats)
        for block in self.lm.layers():
            x = block(x, rope)
        return self.lm.project_logits(x)


def set_stage(model: LLaVA, stage: int) -> list[str]:
    """Freeze for LLaVA's stage 1 (projector only) or stage 2 (projector and language model);
    the encoder stays frozen. Returns the names of the trainable parameters."""
    if not isinstance(model, LLaVA):
        raise TypeError(f"set_stage needs a LLaVA model, got {type(model).__name__}")
    if stage not in STAGES:
        raise ValueError(f"stage must be 1 (projector only) or 2 (projector and LM), got "
                         f"{stage!r}")
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("projector.") or
                         (stage == 2 and name.startswith("lm.")))
    return [n for n, p in model.named_parameters() if p.requires_grad]


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every parameter, to compare with after training (`changed`)."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def changed(model: nn.Module, before: dict[str, torch.Tensor]) -> list[str]:
    """Names of the parameters that differ from the snapshot `before`."""
    now = dict(model.named_parameters())
    if set(now) != set(before):
        raise ValueError("the snapshot is of another model (parameter names differ)")
    return [n for n, p in now.items() if not torch.equal(p.detach(), before[n])]


def batch_loss(model: LLaVA, ids: torch.Tensor, mask: torch.Tensor,
               images: torch.Tensor | None) -> torch.Tensor:
    """Mean cross-entropy over the answer tokens (mask 1), as `align.sft.masked_lm_loss`."""
    if mask.shape != ids.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} differs from ids {tuple(ids.shape)}")
    logits = model(ids, images)[:, :-1]
    targets = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                           ignore_index=-100)


@torch.no_grad()
def examples_loss(model: LLaVA, tok: ChatTokenizer, examples: Sequence[D.Example],
                  batch: int = 128) -> float:
    """Mean answer-token loss over examples (evaluation mode)."""
    if not examples:
        raise ValueError("no examples to score")
    was = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(examples), batch):
        ids, mask, imgs = D.collate(tok, examples[i:i + batch], model.tokens_per_image)
        n = int(mask[:, 1:].sum())
        total += batch_loss(model, ids, mask, imgs).item() * n
        count += n
    model.train(was)
    return total / count


@torch.no_grad()
def answers(model: LLaVA, tok: ChatTokenizer, examples: Sequence[D.Example],
            max_new_tokens: int = 24, batch: int = 128) -> list[str]:
    """Greedy completions of the examples' prompts (images included), up to `<|eos|>`; a
    completion without `<|eos|>` within the budget ends with a '…' so it never matches. The
    placeholder id is never generated (it would ask for an image that is not there)."""
    if not examples:
        raise ValueError("no examples to answer")
    was = model.training
    model.eval()
    out: dict[int, str] = {}
    by_prompt: dict[str, list[int]] = {}
    for i, e in enumerate(examples):
        by_prompt.setdefault(e.prompt, []).append(i)
    n_tok = model.tokens_per_image
    for rows_all in by_prompt.values():
        for s in range(0, len(rows_all), batch):
            rows = rows_all[s:s + batch]
            prompt = examples[rows[0]].prompt.replace(D.IMAGE, D.PLACEHOLDER * n_tok)
            ids = torch.tensor([tok.prompt_ids(prompt)] * len(rows))
            imgs = torch.cat([examples[i].images for i in rows])
            done = torch.zeros(len(rows), dtype=torch.bool)
            for _ in range(max_new_tokens):
                logits = model(ids, imgs)[:, -1]
                logits[:, model.image_id] = float("-inf")  # never write a placeholder
                nxt = logits.argmax(-1)
                nxt = torch.where(done, torch.full_like(nxt, PAD), nxt)
                ids = torch.cat([ids, nxt[:, None]], dim=1)
                done |= nxt == EOS
                if bool(done.all()):
                    break
            start = len(tok.prompt_ids(prompt))
            for j, i in enumerate(rows):
                gen = ids[j, start:].tolist()
                ended = EOS in gen
                gen = gen[:gen.index(EOS)] if ended else gen
                out[i] = tok.decode(gen) + ("" if ended else "…")
    model.train(was)
    return [out[i] for i in range(len(examples))]


def caption_fields(text: str, truth: str) -> float:
    """Share of a caption's four fields (count, colour, shape, quadrant) a generated caption
    gets right, word by word (the plural counts as the shape): partial credit, where exact
    match gives none."""
    if not isinstance(text, str) or not isinstance(truth, str):
        raise TypeError("caption_fields compares two strings")
    plural = {v: k for k, v in D.PLURAL.items()}
    got, want = text.strip().split(" "), truth.split(" ")
    if len(want) != 5:
        raise ValueError(f"{truth!r} is not a caption of multimodal_data (5 words)")
    got = (got + [""] * 5)[:5]
    fields = [(got[0], want[0]), (got[1], want[1]),
              (plural.get(got[2], got[2]), plural.get(want[2], want[2])),
              (" ".join(got[3:]), " ".join(want[3:]))]
    return sum(a == b for a, b in fields) / len(fields)


def accuracy(model: LLaVA, tok: ChatTokenizer, examples: Sequence[D.Example]
             ) -> dict[str, float]:
    """Exact-match accuracy per kind of example; "caption_fields", the captions' mean
    `caption_fields`; and "questions": the mean over the question kinds present."""
    got = answers(model, tok, examples)
    per: dict[str, list[float]] = {}
    for e, a in zip(examples, got):
        per.setdefault(e.kind, []).append(float(a.strip() == e.answer))
        if e.kind == "caption":
            per.setdefault("caption_fields", []).append(caption_fields(a, e.answer))
    acc = {k: sum(v) / len(v) for k, v in per.items()}
    qs = [acc[k] for k in D.QUESTIONS if k in acc]
    if qs:
        acc["questions"] = sum(qs) / len(qs)
    return acc
