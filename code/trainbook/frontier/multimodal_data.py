"""The chapter's image-text data, generated here: shapes, colours, counts and positions.

Each scene is a 16 x 16 RGB image drawn with torch (no image library): 1 to 3 copies of one
shape (square, cross, bar; 3 x 3 pixels) in one colour (red, green, blue, yellow) in one
quadrant (top/bottom, left/right), on a dark background with a little pixel noise. A quadrant
holds four 4 x 4 cells; each object takes one cell, shifted by 0 or 1 pixel, so a shape does not
always sit on the 4 x 4 patch grid. A scene yields:

- a caption, `<image>describe` -> `2 red squares top left` (LLaVA's stage 1 data);
- questions, one kind at a time (LLaVA's stage 2 data): `colour?`, `shape?`, `how many?`,
  `where?`, and over two images, `same colour?` (`yes`/`no`, half each).

`<image>` marks where an image's tokens go. `encode` replaces each with `tokens_per_image`
copies of a placeholder id (a byte no text here uses) in the chat format of Part 7
(`align.task.ChatTokenizer.chat_ids`: loss on the answer only); `collate` right-pads a batch of
examples with any number of images each (none, one, two: interleaved image-text batching) and
stacks their images in the order their placeholders appear, row by row, which is the order the
model scatters image features into the placeholders. `as_text` writes an example with each
image replaced by its caption in words: what a text-only language model can be taught.
Train and test scenes come from different seeds.

Chapter: book/frontier/multimodal
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..align.policy import pad
from ..align.task import ChatTokenizer

SIZE = 16  # pixels per side
CELL = 4  # a quadrant is 2 x 2 cells of CELL x CELL pixels
COLOURS = {"red": (1.0, 0.1, 0.1), "green": (0.1, 0.9, 0.1), "blue": (0.15, 0.3, 1.0),
           "yellow": (1.0, 0.9, 0.1)}
SHAPES = {"square": ["###", "###", "###"], "cross": [".#.", "###", ".#."],
          "bar": ["...", "###", "..."]}
PLURAL = {"square": "squares", "cross": "crosses", "bar": "bars"}
QUADRANTS = ("top left", "top right", "bottom left", "bottom right")
COUNTS = (1, 2, 3)
IMAGE = "<image>"
PLACEHOLDER = "\x00"  # the byte whose id stands for an image token (no prompt text has it)
KINDS = ("caption", "colour", "shape", "count", "where", "same")
QUESTIONS = ("colour", "shape", "count", "where", "same")
PROMPTS = {"caption": "<image>describe", "colour": "<image>colour?", "shape": "<image>shape?",
           "count": "<image>how many?", "where": "<image>where?",
           "same": "<image><image>same colour?"}
NOISE = 0.05  # std of the Gaussian pixel noise


@dataclass(frozen=True)
class Scene:
    """What an image shows, and where exactly each object was drawn (cell, shift)."""

    colour: str
    shape: str
    count: int
    quadrant: str
    cells: tuple[tuple[int, int, int, int], ...]  # (cell row, cell column, dy, dx) per object

    def caption(self) -> str:
        noun = self.shape if self.count == 1 else PLURAL[self.shape]
        return f"{self.count} {self.colour} {noun} {self.quadrant}"


@dataclass(frozen=True)
class Example:
    """One training or test item: a prompt with `<image>` marks, its images, the answer."""

    kind: str
    prompt: str
    answer: str
    images: torch.Tensor  # (n_images, 3, SIZE, SIZE)
    scenes: tuple[Scene, ...]


def chance(kind: str) -> float:
    """Accuracy of guessing uniformly (every answer of a kind is equally likely here)."""
    sizes = {"caption": len(COLOURS) * len(SHAPES) * len(COUNTS) * len(QUADRANTS),
             "colour": len(COLOURS), "shape": len(SHAPES), "count": len(COUNTS),
             "where": len(QUADRANTS), "same": 2}
    if kind not in sizes:
        raise ValueError(f"kind {kind!r} is unknown; use one of {', '.join(KINDS)}")
    return 1.0 / sizes[kind]


def random_scene(rng: random.Random, colour: str | None = None) -> Scene:
    """A scene drawn uniformly (or with the given colour)."""
    colour = colour or rng.choice(list(COLOURS))
    if colour not in COLOURS:
        raise ValueError(f"colour {colour!r} is unknown; use one of {', '.join(COLOURS)}")
    count = rng.choice(COUNTS)
    cells = rng.sample([(r, c) for r in range(2) for c in range(2)], count)
    return Scene(colour, rng.choice(list(SHAPES)), count, rng.choice(QUADRANTS),
                 tuple((r, c, rng.randint(0, 1), rng.randint(0, 1)) for r, c in sorted(cells)))


def draw(scene: Scene, generator: torch.Generator | None = None) -> torch.Tensor:
    """The scene as a (3, SIZE, SIZE) float image in [0, 1]."""
    if not isinstance(scene, Scene):
        raise TypeError(f"draw needs a Scene, got {type(scene).__name__}")
    img = torch.zeros(3, SIZE, SIZE)
    top = 0 if scene.quadrant.startswith("top") else SIZE // 2
    left = 0 if scene.quadrant.endswith("left") else SIZE // 2
    mask = torch.tensor([[ch == "#" for ch in row] for row in SHAPES[scene.shape]])
    colour = torch.tensor(COLOURS[scene.colour])[:, None, None]
    for r, c, dy, dx in scene.cells:
        y, x = top + r * CELL + dy, left + c * CELL + dx
        patch = img[:, y:y + 3, x:x + 3]
        img[:, y:y + 3, x:x + 3] = torch.where(mask, colour, patch)
    img = img + NOISE * torch.randn(img.shape, generator=generator)
    return img.clamp(0.0, 1.0)


def _answer(kind: str, scenes: Sequence[Scene]) -> str:
    s = scenes[0]
    return {"caption": s.caption(), "colour": s.colour, "shape": s.shape, "count": str(s.count),
            "where": s.quadrant,
            "same": "yes" if len(scenes) > 1 and scenes[1].colour == s.colour else "no"}[kind]


def make_examples(n: int, kinds: Sequence[str], seed: int = 0, split: str = "train"
                  ) -> list[Example]:
    """n examples, their kinds cycling through `kinds`; scenes from a generator seeded by
    (seed, split), so train and test scenes differ."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a whole number >= 1, got {n!r}")
    bad = [k for k in kinds if k not in KINDS]
    if not kinds or bad:
        raise ValueError(f"kinds {list(kinds)!r} must be a non-empty list of {', '.join(KINDS)}")
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    rng = random.Random(f"multimodal-{seed}-{split}")
    g = torch.Generator().manual_seed(zlib_seed(seed, split))
    out = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        scenes = [random_scene(rng)]
        if kind == "same":  # half the pairs share the colour
            first = scenes[0].colour
            other = first if rng.random() < 0.5 else rng.choice([c for c in COLOURS if c != first])
            scenes.append(random_scene(rng, other))
        images = torch.stack([draw(s, g) for s in scenes])
        out.append(Example(kind, PROMPTS[kind], _answer(kind, scenes), images, tuple(scenes)))
    return out


def zlib_seed(seed: int, split: str) -> int:
    """A stable integer seed for the pixel noise of (seed, split)."""
    return zlib.crc32(f"{seed}-{split}".encode())


def as_text(example: Example) -> tuple[str, str]:
    """(prompt, answer) with each image replaced by its caption in brackets: the example a
    text-only model can read."""
    if not isinstance(example, Example):
        raise TypeError(f"as_text needs an Example, got {type(example).__name__}")
    prompt = example.prompt
    for s in example.scenes:
        prompt = prompt.replace(IMAGE, f"[{s.caption()}]", 1)
    return prompt, example.answer


def image_id(tok: ChatTokenizer) -> int:
    """The token id that marks an image token: the placeholder byte's id."""
    ids = tok.encode(PLACEHOLDER)
    if len(ids) != 1:
        raise ValueError("the tokenizer does not map the placeholder byte to one token")
    return ids[0]


def encode(tok: ChatTokenizer, example: Example, tokens_per_image: int
           ) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of an example in the chat format, each `<image>` expanded to
    `tokens_per_image` placeholder ids; the mask is 1 on the answer and its `<|eos|>`."""
    if isinstance(tokens_per_image, bool) or not isinstance(tokens_per_image, int) or \
            tokens_per_image < 1:
        raise ValueError(f"tokens_per_image must be a whole number >= 1, got "
                         f"{tokens_per_image!r}")
    if PLACEHOLDER in example.prompt or PLACEHOLDER in example.answer:
        raise ValueError("the text contains the image placeholder byte \\x00; remove it")
    n_marks = example.prompt.count(IMAGE)
    if n_marks != len(example.images):
        raise ValueError(f"the prompt has {n_marks} {IMAGE} marks for {len(example.images)} "
                         "images; give one mark per image")
    prompt = example.prompt.replace(IMAGE, PLACEHOLDER * tokens_per_image)
    return tok.chat_ids(prompt, example.answer)


def collate(tok: ChatTokenizer, examples: Sequence[Example], tokens_per_image: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Interleaved batch: (ids (B, T) right-padded, loss mask (B, T), images (total images, 3,
    SIZE, SIZE) in the order of their placeholders, row by row; None if no example has one)."""
    if not examples:
        raise ValueError("collate needs at least one example")
    enc = [encode(tok, e, tokens_per_image) for e in examples]
    ids, mask = pad([i for i, _ in enc], [m for _, m in enc])
    imgs = [e.images for e in examples if len(e.images)]
    return ids, mask, torch.cat(imgs) if imgs else None
