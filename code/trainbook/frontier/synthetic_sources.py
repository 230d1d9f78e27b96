"""What a source of synthetic data buys: the start policy fine-tuned at equal steps on a small
seed set alone, on the seeds with self-instruct's verified problems, on the seeds with as many
prompts labelled by the stored teacher (sequence-level distillation), and on the seeds with the
same prompts labelled correctly; scored on the test items, and on the test items the teacher
gets wrong, for how often the student gives the teacher's own wrong answer.

`data_sources` builds the four data sets (the base model proposes the self-instruct lines;
`synthetic.self_instruct` filters them, `synthetic.read_teacher` gives the teacher's labels);
`write_sources` fine-tunes on each, for several seeds, and stores the scores with provenance.

Chapter: book/frontier/synthetic-data
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..align import base, sft, start, task
from ..align.task import ChatTokenizer, Problem
from ..bench.gpu_truth import header, read_record, write_record
from . import synthetic as S

SOURCES = ("seeds only", "seeds + self-instruct", "seeds + teacher's answers",
           "seeds + true answers")


@dataclass(frozen=True)
class SourcesConfig:
    """The seed set (`n_seeds` training problems, seed 21), the base model's `proposals`
    self-instruct lines (`shots` pool lines as context), and the fine-tuning every source gets
    (the rejection-sampling rounds' recipe: `steps` at `lr`, batch `batch_size`)."""

    n_seeds: int = 64
    proposals: int = 512
    shots: int = 2
    steps: int = 60
    batch_size: int = 32
    lr: float = 1e-3
    test: int = 500

    def __post_init__(self):
        task.check_fields(self, positive=list(self.__dataclass_fields__))


def data_sources(lm: nn.Module, tok: ChatTokenizer, teacher: dict,
                 cfg: SourcesConfig = SourcesConfig()
                 ) -> tuple[dict[str, list[Problem]], dict[str, int]]:
    """The four data sets of `SOURCES` and self-instruct's filter counts. `lm` is the raw-text
    model that proposes problems; `teacher` a stored teacher record (`synthetic.read_teacher`).
    The teacher-labelled and truly labelled sets share their prompts and match self-instruct's
    size."""
    if not isinstance(cfg, SourcesConfig):
        raise ValueError(f"cfg must be a SourcesConfig, got {type(cfg).__name__}")
    if not isinstance(teacher, dict) or "labels" not in teacher:
        raise ValueError("teacher must be a stored teacher record (synthetic.read_teacher)")
    seeds = task.make_problems(cfg.n_seeds, 2, seed=21)
    lines = S.propose(lm, tok, cfg.proposals, seeds, shots=cfg.shots,
                      generator=torch.Generator().manual_seed(0))
    invented, counts = S.self_instruct(lines, 2, seeds)
    truth = {p.prompt: p.answer for p in task.all_problems(2, "train")}
    labelled = [Problem(p, a) for p, a in teacher["labels"] if a][:len(invented)]
    if len(labelled) < len(invented):
        raise ValueError(f"the teacher record labels {len(labelled)} prompts, fewer than the "
                         f"{len(invented)} self-instruct problems; write one with more prompts")
    correct = [Problem(p.prompt, truth[p.prompt]) for p in labelled]
    return dict(zip(SOURCES, (seeds, seeds + invented, seeds + labelled, seeds + correct))), counts


def score_sources(answers: dict[str, list[str | None]], test: Sequence[Problem],
                  teacher_test: dict[str, str | None]) -> dict[str, dict[str, float]]:
    """For each source's test answers (`synthetic.fine_tune_on`): the accuracy, and the share of
    the test items the teacher answers wrongly (a finished, wrong answer) on which the student
    gives the teacher's answer."""
    if not test or any(len(a) != len(test) for a in answers.values()):
        raise ValueError("give every source's answers to the same, non-empty test items")
    missing = [p.prompt for p in test if p.prompt not in teacher_test]
    if missing:
        raise ValueError(f"the teacher's answers lack {len(missing)} test items, e.g. "
                         f"{missing[0]!r}; use the test items the teacher record holds")
    wrong = [i for i, p in enumerate(test) if teacher_test[p.prompt] not in (None, p.answer)]
    out = {}
    for name, ans in answers.items():
        right = sum(a == p.answer for a, p in zip(ans, test)) / len(test)
        copied = sum(ans[i] == teacher_test[test[i].prompt] for i in wrong) / max(1, len(wrong))
        out[name] = {"test_accuracy": right, "copies_teacher": copied}
    return out


def write_sources(path: str | Path, start_folder: str | Path, teacher_path: str | Path,
                  cfg: SourcesConfig = SourcesConfig(), seeds: Sequence[int] = (0, 1, 2)
                  ) -> Path:
    """Fine-tune the stored start policy on each source with each fine-tuning seed; store one
    row per (seed, source) with provenance."""
    if not isinstance(cfg, SourcesConfig):
        raise ValueError(f"cfg must be a SourcesConfig, got {type(cfg).__name__}")
    if not seeds or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in seeds):
        raise ValueError(f"seeds must be a non-empty list of whole numbers >= 0, got {seeds!r}")
    if Path(path).suffix != ".json":
        raise ValueError(f"write the record to a .json file, not {str(path)!r}")
    t0, tok = time.perf_counter(), task.chat_tokenizer()
    teacher = S.read_teacher(teacher_path)
    sources, counts = data_sources(base.base_model(), tok, teacher, cfg)
    policy0 = start.load_start(start_folder)
    test = task.make_problems(cfg.test, 2, seed=0, split="test")
    rows = []
    for seed in seeds:
        sc = sft.SFTConfig(steps=cfg.steps, batch_size=cfg.batch_size, lr=cfg.lr,
                           warmup_steps=0, seed=seed)
        out = S.fine_tune_on(policy0, tok, sources, test, sc)
        for name, score in score_sources(out, test, dict(teacher["test"])).items():
            rows.append({"seed": seed, "source": name, **score})
    args = ", ".join(f"{k}={v!r}" for k, v in dataclasses.asdict(cfg).items()
                     if v != getattr(SourcesConfig(), k))
    command = ('python -c "from trainbook.frontier import synthetic_sources as D; '
               f"D.write_sources('{path}', '{start_folder}', '{teacher_path}', "
               f'D.SourcesConfig({args}), seeds={list(seeds)})"')
    record = header("synthetic-sources", command, torch.device("cpu"), "small")
    record.update(config=dataclasses.asdict(cfg), seeds=list(seeds), self_instruct=counts,
                  sizes={k: len(v) for k, v in sources.items()}, rows=rows,
                  seconds=time.perf_counter() - t0)
    path = Path(path)
    return write_record(path.parent, path.stem, record)


def read_sources(path: str | Path) -> dict:
    """A stored data-source comparison (`write_sources`)."""
    return read_record(path, "synthetic-sources", "synthetic_sources.write_sources")
