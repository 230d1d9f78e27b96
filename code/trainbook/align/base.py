"""The base model every Part 7 chapter starts from: the reference Transformer pretrained by the
book's trainer on raw arithmetic text.

`pretrain` writes the task's pretraining text (`task.pretraining_text`: `07+58=65` per line) and
the chat tokenizer to a temporary folder and runs `trainbook.train.train` on them, the same
trainer and options as every other part (`train_config` is that configuration). The base model
has learnt the sums from raw text and has never seen a chat token: asked in the raw form
(`raw_accuracy`) it answers, asked in the chat format it does not know to stop, which is what
supervised fine-tuning teaches.

Pretraining the default recipe takes a few minutes on a laptop CPU, longer than a chapter may
take, so its result ships with the package (`weights/base.safetensors`, about 3 MB, with
`weights/base.json`: the recipe, the SHA-256 of the weights, the command, date, versions and the
accuracy measured when it was written). `write_shipped` rebuilds both; `base_model` loads the
shipped weights when asked for that recipe (after checking the digest) and otherwise pretrains,
once per recipe and process.

Chapter: book/alignment/evaluation
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..bench.gpu_truth import header, read_record, write_record
from ..model import Transformer
from ..train.config import TrainConfig, model_config
from . import policy, task

if TYPE_CHECKING:
    from ..train import TrainResult

WEIGHTS = Path(__file__).with_name("weights")
EVAL_ITEMS = 500  # test items the shipped record's accuracy is measured on (seed 0)


@dataclass(frozen=True)
class BaseRecipe:
    """What the base model is and how long it pretrains (defaults: a few seconds on a CPU)."""

    digits: int = 2
    lines: int = 20_000  # pretraining items (raw lines) in the corpus
    d_model: int = 128
    n_layers: int = 3
    n_heads: int = 4
    d_ff: int = 352
    seq_len: int = 64
    batch_size: int = 32
    steps: int = 1500
    lr: float = 3e-3
    seed: int = 0

    def __post_init__(self):
        task.check_fields(self, positive=[f for f in self.__dataclass_fields__ if f != "seed"],
                          non_negative=["seed"])


def train_config(recipe: BaseRecipe, corpus: str, tokenizer: str) -> TrainConfig:
    """The trainer's configuration for the base model (`python -m trainbook train` takes the
    same fields as options)."""
    return TrainConfig(model="tiny-llama", d_model=recipe.d_model, n_layers=recipe.n_layers,
                       n_heads=recipe.n_heads, n_kv_heads=recipe.n_heads, d_ff=recipe.d_ff,
                       tokenizer=tokenizer, corpus=corpus, seq_len=recipe.seq_len,
                       batch_size=recipe.batch_size, steps=recipe.steps, lr=recipe.lr,
                       warmup_steps=min(20, recipe.steps // 10), seed=recipe.seed, device="cpu",
                       log_every=0, eval_batches=2, progress=False)


def pretrain(recipe: BaseRecipe = BaseRecipe()) -> TrainResult:
    """Run the trainer on the raw arithmetic corpus; returns its `TrainResult`."""
    from ..train import train

    if not isinstance(recipe, BaseRecipe):
        raise ValueError(f"recipe must be a BaseRecipe, got {type(recipe).__name__}")
    with tempfile.TemporaryDirectory() as tmp:
        corpus, tok = Path(tmp) / "arithmetic.txt", Path(tmp) / "tokenizer.json"
        corpus.write_text(task.pretraining_text(recipe.lines, recipe.digits, recipe.seed))
        task.chat_tokenizer().hf.save(str(tok))
        return train(train_config(recipe, str(corpus), str(tok)))


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def write_shipped(recipe: BaseRecipe = BaseRecipe(), folder: str | Path = WEIGHTS) -> Path:
    """Pretrain `recipe` and store the weights (safetensors, fp32) and their record."""
    from safetensors.torch import save_file

    result = pretrain(recipe)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    weights = folder / "base.safetensors"
    state = {k: v.contiguous() for k, v in result.model.state_dict().items()}
    save_file(state, str(weights))
    tok = task.chat_tokenizer()
    test = task.make_problems(EVAL_ITEMS, recipe.digits, 0, "test")
    args = ", ".join(f"{k}={v!r}" for k, v in dataclasses.asdict(recipe).items()
                     if v != getattr(BaseRecipe(), k))
    command = ('python -c "from trainbook.align import base; '
               f'base.write_shipped(base.BaseRecipe({args}))"')
    record = header("align-base", command, torch.device("cpu"), "small")
    record.update(recipe=dataclasses.asdict(recipe), sha256=sha256(weights),
                  parameters=sum(v.numel() for v in state.values()),
                  final_loss=result.losses()[-1], val_loss=result.val_loss,
                  raw_accuracy=raw_accuracy(result.model, tok, test),
                  chat_accuracy=policy.accuracy(result.model, tok, test))
    return write_record(folder, "base", record)


def shipped_record(folder: str | Path = WEIGHTS) -> dict:
    """The record of the shipped base model (`write_shipped` writes it)."""
    return read_record(Path(folder) / "base.json", "align-base", "base.write_shipped")


def load_shipped(folder: str | Path = WEIGHTS) -> Transformer:
    """The shipped base model, after checking its weights against the record's SHA-256."""
    from safetensors.torch import load_file

    record, weights = shipped_record(folder), Path(folder) / "base.safetensors"
    if not weights.is_file() or sha256(weights) != record["sha256"]:
        raise ValueError(f"{weights} is missing or does not match the SHA-256 in base.json; "
                         "rebuild both with base.write_shipped()")
    recipe = BaseRecipe(**record["recipe"])
    cfg = train_config(recipe, "unused", "bytes")
    model = Transformer(model_config(cfg, task.VOCAB_SIZE))
    model.load_state_dict(load_file(str(weights)))
    return model.eval()


@lru_cache(maxsize=4)
def _trained(recipe: BaseRecipe) -> Transformer:
    if (WEIGHTS / "base.json").is_file() and BaseRecipe(**shipped_record()["recipe"]) == recipe:
        return load_shipped()  # a digest mismatch raises: never train silently instead
    return pretrain(recipe).model.eval()


def base_model(recipe: BaseRecipe = BaseRecipe()) -> Transformer:
    """A fresh copy of the base model: the shipped weights for the shipped recipe, otherwise
    pretrained (once per recipe and process)."""
    return copy.deepcopy(_trained(recipe))


def raw_accuracy(model: nn.Module, tok: task.ChatTokenizer, items: list[task.Problem]) -> float:
    """Greedy exact-match accuracy in the pretraining form: prompt `07+58=`, answer up to the
    newline, after a newline as in the corpus. How a base model is scored before it knows the
    chat format."""
    if not items:
        raise ValueError("no items to score")
    newline = tok.encode("\n")[0]
    prompts = [tok.encode("\n" + p.prompt + "=") for p in items]  # a line start, as in the corpus
    roll = policy.sample(model, tok, prompts, max(len(p.answer) for p in items) + 2,
                         greedy=True, stop_id=newline)
    return sum(task.verify(p, t) for p, t in zip(items, roll.texts)) / len(items)
