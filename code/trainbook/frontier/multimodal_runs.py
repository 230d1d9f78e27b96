"""The chapter's LLaVA run at CPU size: a text-only language model, then stage 1, then stage 2,
with accuracy per kind of question after each; and its storage.

`run` does, for one seed: (0) pretrain the reference Transformer, text only, on the task's
examples with each image written out as its caption in words (`multimodal_data.as_text`): the
"LLM" knows the language and how to answer from a description, but has never seen an image;
(1) stage 1: a frozen random encoder, a fresh projector, the language model frozen, the
projector trained on captions; (2) stage 2: projector and language model trained on the
questions. Every stage is Part 7's fine-tuning loop (`align.sft.optimize`: AdamW, warmup,
batches drawn by a seeded generator). Accuracy on held-out scenes is measured before stage 1,
during it (with the caption and question losses) and after each stage, plus the text-only
model's accuracy when told the scene in words: the ceiling the language model brings.

`write_runs` stores several seeds (one process per seed with `workers`, each on one thread, as
one process would run them) with their provenance (command, date, versions, machine) and
`read_runs` reads them back; training is deterministic on a CPU, so the tests re-run a stored
prefix and find the same losses.

Chapter: book/frontier/multimodal
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..align import sft as S
from ..align.task import ChatTokenizer, Problem, chat_tokenizer, check_fields
from ..bench.gpu_truth import header, read_record, write_record
from ..configs import ModelConfig
from ..model import Transformer
from . import llava as L
from . import multimodal_data as D
from .vision import ViT, ViTConfig

MEASUREMENT = "multimodal-llava"


@dataclass(frozen=True)
class RunConfig:
    """Sizes and steps of one run (defaults: a few minutes per seed on one CPU thread)."""

    seed: int = 0
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 176
    vision_d: int = 64
    vision_layers: int = 2
    text_steps: int = 800
    stage1_steps: int = 600
    stage2_steps: int = 600
    batch_size: int = 32
    text_lr: float = 3e-3
    stage1_lr: float = 1e-2
    stage2_lr: float = 1e-3
    n_train: int = 4000  # training examples per stage
    n_test: int = 50  # test examples per kind
    eval_every: int = 100  # stage 1: losses and accuracy every this many steps

    def __post_init__(self):
        check_fields(self, positive=[f for f in self.__dataclass_fields__ if f != "seed"],
                     non_negative=["seed"])


def language_model(cfg: RunConfig, vocab_size: int) -> Transformer:
    """The reference Transformer (llama flavour) at the run's size, seeded by cfg.seed."""
    torch.manual_seed(cfg.seed)
    mc = ModelConfig("mm-lm", "llama", vocab_size, cfg.n_layers, cfg.d_model, cfg.n_heads,
                     d_ff=cfg.d_ff, max_seq_len=128)
    return Transformer(mc)


def build(cfg: RunConfig, lm: Transformer, tok: ChatTokenizer) -> L.LLaVA:
    """A frozen random encoder (seeded), a fresh projector and the language model."""
    torch.manual_seed(cfg.seed + 1)
    vision = ViT(ViTConfig(d_model=cfg.vision_d, n_layers=cfg.vision_layers,
                           d_ff=2 * cfg.vision_d))
    return L.LLaVA(vision, lm, D.image_id(tok)).eval()


def text_stage(lm: Transformer, tok: ChatTokenizer, cfg: RunConfig,
               train: Sequence[D.Example]) -> list[float]:
    """Stage 0: fine-tune the language model on the examples written as text."""
    items = [Problem(*D.as_text(e)) for e in train]
    return S.sft(lm, tok, items, S.SFTConfig(steps=cfg.text_steps, batch_size=cfg.batch_size,
                                             lr=cfg.text_lr, seed=cfg.seed))


def train_stage(model: L.LLaVA, tok: ChatTokenizer, stage: int, steps: int, lr: float,
                train: Sequence[D.Example], seed: int, batch_size: int,
                on_step: Callable[[int], None] | None = None) -> list[float]:
    """One LLaVA stage: freeze (`llava.set_stage`) and train on the examples."""
    L.set_stage(model, stage)
    cfg = S.SFTConfig(steps=steps, batch_size=batch_size, lr=lr, seed=seed)
    batches = S.draws(len(train), cfg)

    def loss_at(step: int) -> torch.Tensor:
        ids, mask, imgs = D.collate(tok, [train[i] for i in batches[step]],
                                    model.tokens_per_image)
        return L.batch_loss(model, ids, mask, imgs)

    return S.optimize(model, cfg, loss_at, on_step)


def _text_accuracy(lm: Transformer, tok: ChatTokenizer, test: Sequence[D.Example]
                   ) -> dict[str, float]:
    from ..align import policy

    out = {}
    for kind in dict.fromkeys(e.kind for e in test):
        items = [Problem(*D.as_text(e)) for e in test if e.kind == kind]
        out[kind] = policy.accuracy(lm, tok, items, max_new_tokens=24)
    return out


def run(cfg: RunConfig = RunConfig(), progress: bool = False) -> dict:
    """The whole recipe for one seed; returns the record (losses, evaluations, accuracies)."""
    if not isinstance(cfg, RunConfig):
        raise TypeError(f"run needs a RunConfig, got {type(cfg).__name__}")
    t0 = time.perf_counter()
    tok = chat_tokenizer()
    all_kinds = list(D.KINDS)
    train_text = D.make_examples(cfg.n_train, all_kinds, cfg.seed, "train")
    captions = D.make_examples(cfg.n_train, ["caption"], cfg.seed + 100, "train")
    questions = D.make_examples(cfg.n_train, list(D.QUESTIONS), cfg.seed + 200, "train")
    test = D.make_examples(cfg.n_test * len(all_kinds), all_kinds, cfg.seed, "test")
    probe_caps = [e for e in test if e.kind == "caption"]
    probe_qs = [e for e in test if e.kind != "caption"]

    lm = language_model(cfg, tok.vocab_size)
    text_losses = text_stage(lm, tok, cfg, train_text)
    text_acc = _text_accuracy(lm, tok, test)
    model = build(cfg, lm, tok)
    evals = [{"stage": 0, "step": 0, **L.accuracy(model, tok, test)}]
    shown = [next(e for e in test if e.kind == k) for k in all_kinds]
    samples: list[dict] = []

    def sample(stage: int) -> None:
        samples.extend({"stage": stage, "kind": e.kind, "truth": e.answer, "answer": a}
                       for e, a in zip(shown, L.answers(model, tok, shown)))

    sample(0)
    probes: list[dict] = []
    frozen: dict[str, list[str]] = {}

    def probe(stage: int, step: int) -> None:
        probes.append({"stage": stage, "step": step,
                       "caption_loss": L.examples_loss(model, tok, probe_caps),
                       "question_loss": L.examples_loss(model, tok, probe_qs)})

    def on_step1(k: int) -> None:
        if k % cfg.eval_every == 0:
            probe(1, k)
            if progress:
                print(f"stage 1 step {k}: {probes[-1]}")

    probe(1, 0)
    before = L.snapshot(model)
    s1 = train_stage(model, tok, 1, cfg.stage1_steps, cfg.stage1_lr, captions, cfg.seed,
                     cfg.batch_size, on_step1)
    frozen["stage1_changed"] = sorted({n.split(".")[0] for n in L.changed(model, before)})
    evals.append({"stage": 1, "step": cfg.stage1_steps, **L.accuracy(model, tok, test)})
    sample(1)
    before = L.snapshot(model)
    s2 = train_stage(model, tok, 2, cfg.stage2_steps, cfg.stage2_lr, questions, cfg.seed,
                     cfg.batch_size)
    frozen["stage2_changed"] = sorted({n.split(".")[0] for n in L.changed(model, before)})
    probe(2, cfg.stage2_steps)
    evals.append({"stage": 2, "step": cfg.stage2_steps, **L.accuracy(model, tok, test)})
    sample(2)
    return {"config": dataclasses.asdict(cfg), "text_losses": text_losses,
            "stage1_losses": s1, "stage2_losses": s2, "text_accuracy": text_acc,
            "evals": evals, "probes": probes, "samples": samples, **frozen,
            "seconds": round(time.perf_counter() - t0, 1)}


def write_runs(path: str | Path, seeds: Sequence[int] = (0, 1, 2), workers: int = 1,
               **overrides: object) -> Path:
    """Run the recipe for each seed (in `workers` processes) and store the records with their
    provenance."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a whole number >= 1, got {workers!r}")
    if not seeds or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in seeds):
        raise ValueError(f"seeds must be a non-empty list of whole numbers >= 0, got {seeds!r}")
    path = Path(path)
    if path.suffix != ".json":
        raise ValueError(f"path must end in .json, got {path}")
    cfgs = [RunConfig(**{**overrides, "seed": s}) for s in seeds]
    args = ", ".join(f"{k}={v!r}" for k, v in overrides.items())
    command = ("python -c \"from trainbook.frontier import multimodal_runs as R; "
               f"R.write_runs('{path}', seeds={list(seeds)!r}, workers={workers}"
               f"{', ' + args if args else ''})\"")
    record = header(MEASUREMENT, command, torch.device("cpu"), "small")
    record["threads"] = torch.get_num_threads()
    if workers == 1:
        record["runs"] = [run(c) for c in cfgs]
    else:  # each process runs one seed on one thread, as the single-process loop would
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as ex:
            record["runs"] = list(ex.map(run, cfgs))
    return write_record(path.parent, path.stem, record)


def read_runs(path: str | Path) -> dict:
    """A stored record of `write_runs`."""
    return read_record(path, MEASUREMENT, "multimodal_runs.write_runs")
