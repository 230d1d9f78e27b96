"""LoRA against full fine-tuning on Part 7's task: the same base model, problems, batches and
steps; task accuracy, forgetting and trainable parameters.

Each variant starts from the book's pretrained base model (`align.base.base_model`), which
answers sums in the raw form it was pretrained on (`07+58=65`) and has never seen a chat token.
Supervised fine-tuning (`align.sft.sft`: loss on the assistant's tokens, AdamW, warmup then a
constant rate) teaches it the chat format on the same problems and the same batches, and every
`every` steps `align.sft_study.score` measures the chat-form accuracy on held-out problems, the
raw-form accuracy (what the base model could do) and the held-out loss. Full fine-tuning trains
every parameter; LoRA trains adapters of rank r on every linear layer of the blocks (alpha = 2r)
and nothing else, so the embeddings and output rows of the five chat tokens, which the base model
never trained, stay at their random initialisation. The last variant adds those rows
(`lora.train_tokens`, peft's `trainable_token_indices`). The learning rates of full fine-tuning
and of LoRA are separate fields of the setup, both stored in the record.

A single run says little here: the adapters' random initialisation and the batch order move
the accuracy at a given step by tens of points, and a run's accuracy jumps between evaluations.
So each variant runs with several seeds (each seeds A's initialisation and the batch order; the
problems stay the same), and a run is summarised by the mean of its last `tail` evaluations.

`write_quality` runs one seed of every variant and stores it with its provenance
(`bench.gpu_truth`'s record header), every step's loss included, so that a test can re-run the
first steps and compare; `read_quality` reads the seeds' files back as one table.

Chapter: book/alignment/lora
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..bench.gpu_truth import header, read_record, write_record
from . import base, sft, sft_study, task
from . import lora as L

MEASUREMENT = "lora-quality"


@dataclass(frozen=True)
class QualitySetup:
    """What every variant shares, and the learning rates."""

    train_items: int = 8000
    test_items: int = 300
    steps: int = 1000
    batch_size: int = 32
    lr_full: float = 1e-3
    lr_lora: float = 1e-3
    ranks: tuple[int, ...] = (1, 4, 16)
    token_rank: int = 16  # the rank of the LoRA + chat-token rows variant (0: none)
    every: int = 100
    tail: int = 3  # a run's score: the mean of its last `tail` evaluations
    seeds: tuple[int, ...] = (0, 1, 2)

    def __post_init__(self):
        for name, least in (("ranks", 1), ("seeds", 0)):
            v = getattr(self, name)
            if not v or any(isinstance(r, bool) or not isinstance(r, int) or r < least
                            for r in v):
                raise ValueError(f"{name} must be whole numbers >= {least}, got {v!r}")
        task.check_fields(self, positive=("train_items", "test_items", "steps", "batch_size",
                                          "lr_full", "lr_lora", "every", "tail"),
                          non_negative=("token_rank",))

    def variants(self) -> list[tuple[str, int | None, bool]]:
        """(name, LoRA rank or None for full fine-tuning, train the chat tokens' rows)."""
        out = [("full", None, False)] + [(f"lora r={r}", r, False) for r in self.ranks]
        if self.token_rank:
            out.append((f"lora r={self.token_rank} + chat tokens", self.token_rank, True))
        return out

    def data(self) -> tuple[list[task.Problem], list[task.Problem]]:
        """The training and test problems (the same for every seed)."""
        return (task.make_problems(self.train_items, 2, 1, "train"),
                task.make_problems(self.test_items, 2, 0, "test"))


def prepare(rank: int | None, tokens: bool = False, seed: int = 0) -> torch.nn.Module:
    """A fresh base model, with LoRA of `rank` on every linear layer (alpha = 2 rank, A drawn
    with `seed`) unless rank is None, and the chat tokens' rows trainable if `tokens`."""
    model = base.base_model()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if rank is not None:
            L.apply_lora(model, L.ALL_LINEAR, r=rank, alpha=2 * rank)
    if tokens:
        L.train_tokens(model, list(range(len(task.SPECIAL))))
    return model


def config(setup: QualitySetup, rank: int | None, seed: int,
           steps: int | None = None) -> sft.SFTConfig:
    return sft.SFTConfig(steps=steps or setup.steps, batch_size=setup.batch_size,
                         lr=setup.lr_full if rank is None else setup.lr_lora, seed=seed)


def run_variant(setup: QualitySetup, name: str, rank: int | None, tokens: bool,
                seed: int) -> dict:
    """Fine-tune one variant with one seed and score it every `setup.every` steps: its counts,
    points (step, epochs, raw and chat accuracy, held-out loss), every step's loss, seconds."""
    tok = task.chat_tokenizer()
    train, test = setup.data()
    model = prepare(rank, tokens, seed)
    trainable, total = L.counts(model)
    cfg = config(setup, rank, seed)
    points = [{"step": 0, "epochs": 0.0, **sft_study.score(model, tok, test)}]

    def on_step(k: int) -> None:
        if k % setup.every == 0 or k == cfg.steps:
            points.append({"step": k, "epochs": sft_study.epochs(cfg, len(train)) * k / cfg.steps,
                           **sft_study.score(model, tok, test)})

    start = time.perf_counter()
    losses = sft.sft(model, tok, train, cfg, on_step)
    return {"method": name, "seed": seed, "rank": rank, "chat_tokens": tokens, "lr": cfg.lr,
            "trainable": trainable, "total": total, "points": points,
            "losses": [round(v, 5) for v in losses], "seconds": time.perf_counter() - start}


def first_losses(setup: QualitySetup, rank: int | None, tokens: bool, seed: int,
                 steps: int) -> list[float]:
    """The first `steps` losses of a run, again (what a stored record is checked by)."""
    tok = task.chat_tokenizer()
    train, _ = setup.data()
    return sft.sft(prepare(rank, tokens, seed), tok, train, config(setup, rank, seed, steps))


def write_quality(folder: str | Path, seed: int, setup: QualitySetup = QualitySetup()) -> Path:
    """Run every variant with one seed and store it as `lora-quality-seed<seed>.json` in
    `folder`, with the command, date, versions and machine."""
    if seed not in setup.seeds:
        raise ValueError(f"seed {seed} is not one of the setup's seeds {setup.seeds}")
    fields = ", ".join(f"{k}={v!r}" for k, v in asdict(setup).items())
    command = (f'python -c "from trainbook.align import lora_quality as Q; '
               f'Q.write_quality({str(folder)!r}, {seed}, Q.QualitySetup({fields}))"')
    rows = [run_variant(setup, *v, seed) for v in setup.variants()]
    record = header(MEASUREMENT, command, torch.device("cpu"), "small")
    record.update(setup=asdict(setup), seed=seed, base_sha256=base.shipped_record()["sha256"],
                  rows=rows)
    return write_record(folder, f"lora-quality-seed{seed}", record)


def read_quality(folder: str | Path) -> tuple[list[dict], QualitySetup]:
    """(records, setup) of every seed the setup names, from the files write_quality wrote."""
    records = [read_record(Path(folder) / f"lora-quality-seed{seed}.json", MEASUREMENT,
                           "lora_quality.write_quality") for seed in QualitySetup().seeds]
    s = dict(records[0]["setup"])
    s["ranks"], s["seeds"] = tuple(s["ranks"]), tuple(s["seeds"])
    setup = QualitySetup(**s)
    if sorted(r["seed"] for r in records) != sorted(setup.seeds) or \
            any(r["setup"] != records[0]["setup"] for r in records):
        raise ValueError(f"the records in {folder} are not one setup's seeds {setup.seeds}; "
                         "write them again with write_quality")
    return records, setup


def summary(records: list[dict], setup: QualitySetup) -> list[dict]:
    """One row per run: its counts and the mean of its last `tail` evaluations."""
    rows = []
    for rec in records:
        for r in rec["rows"]:
            last = r["points"][-setup.tail:]
            mean = {k: sum(p[k] for p in last) / len(last)
                    for k in ("chat accuracy", "raw accuracy", "held-out loss")}
            rows.append({"method": r["method"], "seed": r["seed"], "rank": r["rank"],
                         "trainable": r["trainable"], "total": r["total"], **mean,
                         "final chat accuracy": r["points"][-1]["chat accuracy"],
                         "seconds": r["seconds"]})
    return rows
