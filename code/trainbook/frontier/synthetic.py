"""Synthetic training data on the verifiable task: rejection sampling, self-instruct and
distillation, with the filters between generating and training.

Three ways a model makes its own training data, each on Part 7's arithmetic task:

- Rejection sampling (STaR, RFT, ReST-EM): sample k completions of each training prompt at a
  temperature, keep the ones the verifier accepts, fine-tune on them, repeat (`rejection_rounds`).
  The kept set is full of copies (a prompt the model solves k times out of k gives k identical
  examples), so `keep` removes exact duplicates and, with the book's MinHash machinery
  (`trainbook.pretrain.dedup`, word 1-gram shingles), near duplicates such as `07+58=65` and
  `58+07=65`. Without the verifier (`filter="none"`) the model trains on its own mistakes.
- Self-instruct: the base model, prompted with a few raw lines of the pool, writes new problems
  (`propose`); `self_instruct` parses them, drops the malformed ones, the ones in the test split
  (decontamination) and the duplicates of the pool or of each other, and labels the rest with
  the verifier's arithmetic, not with the model's own answer.
- Distillation: a larger teacher, trained here, answers training prompts (`teacher_labels`); a
  student fine-tuned on those answers learns the teacher's mistakes with its skill. Training the
  teacher takes about an hour on a CPU, so its answers are stored with provenance (`write_teacher`).

Chapter: book/frontier/synthetic-data
"""

from __future__ import annotations

import copy
import dataclasses
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..align import base, policy, sft, start, task
from ..align.task import ChatTokenizer, Problem
from ..bench.gpu_truth import header, read_record, write_record
from ..pretrain import dedup

FILTERS = ("verify", "none", "truth")
DEDUP = ("none", "exact", "near")
# Near duplicates: word 1-gram shingles ("07+58=65" -> {07, 58, 65}), 16 bands of 4 MinHashes
# and at least 80% of the signature equal; only sets this close are joined.
NEAR = {"n": 1, "bands": 16, "rows": 4, "min_similarity": 0.8}


@dataclass
class Samples:
    """k sampled completions per prompt: the problem each answers, its text, whether it ended
    with `<|eos|>` and the verifier's reward (0 for a completion that did not end)."""

    items: list[Problem]
    texts: list[str]
    ended: list[bool]
    rewards: list[float]

    def pass_at_1(self) -> float:
        """Share of samples the verifier accepts: pass@1 at the sampling temperature."""
        return sum(self.rewards) / len(self.rewards)

    def pass_at_k(self) -> float:
        """Share of distinct prompts with at least one accepted sample."""
        solved: dict[str, float] = {}
        for p, r in zip(self.items, self.rewards):
            solved[p.prompt] = max(solved.get(p.prompt, 0.0), r)
        return sum(solved.values()) / len(solved)


def rejection_sample(model: nn.Module, tok: ChatTokenizer, items: Sequence[Problem], k: int,
                     temperature: float = 1.0, generator: torch.Generator | None = None
                     ) -> Samples:
    """k completions of every item at `temperature`, each scored by the verifier."""
    task._whole("k", k, 1)
    if not items:
        raise ValueError("no items to sample for")
    every = [p for p in items for _ in range(k)]
    roll = policy.sample(model, tok, task.encode_prompts(tok, every),
                         max(len(p.answer) for p in items) + 2, temperature, False, generator)
    ended = [c[-1:] == [task.EOS] for c in roll.completions]
    rewards = [task.verify(p, t) if e else 0.0 for p, t, e in zip(every, roll.texts, ended)]
    return Samples(every, roll.texts, ended, rewards)


def kept_indices(items: Sequence[Problem], mode: str = "exact") -> list[int]:
    """Indices of the items that deduplication keeps, in order: without exact duplicates (same
    prompt and answer), and with mode 'near' without near duplicates either (MinHash over the
    words of `prompt=answer`, `NEAR`: `07+58=65` and `58+07=65` share all three); each group
    keeps its first item."""
    if mode not in DEDUP:
        raise ValueError(f"dedup must be one of {DEDUP}, got {mode!r}")
    if mode == "none":
        return list(range(len(items)))
    first: dict[Problem, int] = {}
    for i, p in enumerate(items):
        first.setdefault(p, i)
    unique = list(first.values())
    if mode == "exact" or len(unique) < 2:
        return unique
    texts = [task.raw_line(items[i]) for i in unique]
    kept = dedup.deduplicate(texts, NEAR["bands"], NEAR["rows"], NEAR["n"],
                             NEAR["min_similarity"]).keep
    return [unique[i] for i in kept]


def deduplicate(items: Sequence[Problem], mode: str = "exact") -> list[Problem]:
    """The items that `kept_indices` keeps."""
    return [items[i] for i in kept_indices(items, mode)]


def keep(samples: Samples, filter: str = "verify", dedup_mode: str = "exact"
         ) -> tuple[list[Problem], dict[str, int]]:
    """The training items made from samples: every completion that ended ('none') or only the
    verified ones ('verify'), then deduplicated; and how many survived each stage."""
    if filter not in FILTERS[:2]:
        raise ValueError(f"filter must be one of {FILTERS[:2]}, got {filter!r}")
    ended = [Problem(p.prompt, t.strip()) for p, t, e in
             zip(samples.items, samples.texts, samples.ended) if e and t.strip()]
    verified = [Problem(p.prompt, t.strip()) for p, t, r in
                zip(samples.items, samples.texts, samples.rewards) if r == 1.0]
    chosen = verified if filter == "verify" else ended
    out = deduplicate(chosen, dedup_mode)
    return out, {"sampled": len(samples.texts), "ended": len(ended), "verified": len(verified),
                 "exact_unique": len(set(chosen)), "kept": len(out)}


@dataclass(frozen=True)
class LoopConfig:
    """Rejection-sampling rounds: k samples of each pool prompt at `temperature`, the filters,
    then `steps` of SFT (batch_size, lr) on what was kept, `rounds` times. filter 'verify'
    keeps what the verifier accepts, 'none' every finished sample, 'truth' samples nothing and
    trains on the pool's true answers (the baseline at equal steps)."""

    rounds: int = 4
    k: int = 2
    temperature: float = 1.0
    steps: int = 60
    batch_size: int = 32
    lr: float = 1e-3
    filter: str = "verify"
    dedup: str = "exact"
    seed: int = 0

    def __post_init__(self):
        task.check_fields(self, positive=("rounds", "k", "temperature", "steps", "batch_size",
                                          "lr"), non_negative=("seed",))
        if self.filter not in FILTERS:
            raise ValueError(f"LoopConfig.filter must be one of {FILTERS}, got {self.filter!r}")
        if self.dedup not in DEDUP:
            raise ValueError(f"LoopConfig.dedup must be one of {DEDUP}, got {self.dedup!r}")


def rejection_rounds(model: nn.Module, tok: ChatTokenizer, pool: Sequence[Problem],
                     test: Sequence[Problem], cfg: LoopConfig = LoopConfig()) -> list[dict]:
    """Run the rounds on `model` in place; one row per round (round 0: the start) with the
    pool's pass@1 and pass@k (k = cfg.k) at the temperature, what the filters kept, and the
    greedy test accuracy after the round's fine-tuning."""
    if not pool or not test:
        raise ValueError("rejection_rounds needs a non-empty prompt pool and test set")
    rows = [{"round": 0, "test_accuracy": policy.accuracy(model, tok, test)}]
    g = torch.Generator().manual_seed(cfg.seed)
    for r in range(1, cfg.rounds + 1):
        t0 = time.perf_counter()
        if cfg.filter == "truth":
            items = deduplicate(pool, cfg.dedup)
            row = {"round": r, "kept": len(items)}
        else:
            samples = rejection_sample(model, tok, pool, cfg.k, cfg.temperature, g)
            items, counts = keep(samples, cfg.filter, cfg.dedup)
            row = {"round": r, "pass@1": samples.pass_at_1(), "pass@k": samples.pass_at_k(),
                   **counts}
        if items:  # nothing kept: the round trains on nothing and the model stays as it was
            sc = sft.SFTConfig(steps=cfg.steps, batch_size=cfg.batch_size, lr=cfg.lr,
                               warmup_steps=0, seed=cfg.seed + r)
            row["sft_loss"] = sft.sft(model, tok, items, sc)[-1]
        row["test_accuracy"] = policy.accuracy(model, tok, test)
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
    return rows


ROUND_VARIANTS = (("verify", "exact"), ("verify", "none"), ("verify", "near"),
                  ("none", "exact"), ("truth", "none"))


def write_rounds(path: str | Path, start_folder: str | Path, cfg: LoopConfig = LoopConfig(),
                 variants: Sequence[tuple[str, str]] = ROUND_VARIANTS, pool: int = 2048,
                 test: int = 500, seeds: Sequence[int] = (0,)) -> Path:
    """`rejection_rounds` from the stored start policy in `start_folder`
    (`trainbook.align.start`) for each (filter, dedup) variant and seed, on `pool` training
    prompts (seed 12) and `test` test items (seed 0); stored with provenance."""
    task._whole("pool", pool, 1)
    task._whole("test", test, 1)
    if not seeds or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in seeds):
        raise ValueError(f"seeds must be a non-empty list of whole numbers >= 0, got {seeds!r}")
    runs = [dataclasses.replace(cfg, filter=f, dedup=d) for f, d in variants]  # checks them
    first = start.load_start(start_folder)
    tok, t0 = task.chat_tokenizer(), time.perf_counter()
    items = task.make_problems(pool, 2, seed=12)
    tests = task.make_problems(test, 2, seed=0, split="test")
    rows = []
    for seed in seeds:
        for run in runs:
            model = copy.deepcopy(first)
            for row in rejection_rounds(model, tok, items, tests,
                                        dataclasses.replace(run, seed=seed)):
                rows.append({"filter": run.filter, "dedup": run.dedup, "seed": seed, **row})
    args = ", ".join(f"{k}={v!r}" for k, v in dataclasses.asdict(cfg).items()
                     if v != getattr(LoopConfig(), k))
    command = ('python -c "from trainbook.frontier import synthetic as S; S.write_rounds('
               f"'{path}', '{start_folder}', S.LoopConfig({args}), pool={pool}, test={test}, "
               f'seeds={list(seeds)})"')
    record = header("synthetic-rounds", command, torch.device("cpu"), "small")
    record.update(config=dataclasses.asdict(cfg), variants=[list(v) for v in variants],
                  pool=pool, test=test, seeds=list(seeds), start=str(start_folder), rows=rows,
                  seconds=time.perf_counter() - t0)
    path = Path(path)
    return write_record(path.parent, path.stem, record)


def read_rounds(path: str | Path) -> dict:
    """A stored rejection-sampling study (`write_rounds`)."""
    return read_record(path, "synthetic-rounds", "synthetic.write_rounds")


def answers(model: nn.Module, tok: ChatTokenizer, items: Sequence[Problem]) -> list[str | None]:
    """The model's greedy answer to each item (None where it did not end with `<|eos|>`)."""
    if not items:
        raise ValueError("no items to answer")
    roll = policy.sample(model, tok, task.encode_prompts(tok, items),
                         max(len(p.answer) for p in items) + 2, greedy=True)
    return [t.strip() if c[-1:] == [task.EOS] else None
            for c, t in zip(roll.completions, roll.texts)]


def fine_tune_on(model: nn.Module, tok: ChatTokenizer, sources: dict[str, Sequence[Problem]],
                 test: Sequence[Problem], cfg: sft.SFTConfig) -> dict[str, list[str | None]]:
    """For each named data source, a copy of `model` fine-tuned on it with `cfg`: its greedy
    answers to the test items (`answers`). Same start, same steps, same seed: the sources
    differ only in their data."""
    if not sources or any(not items for items in sources.values()):
        raise ValueError("give at least one data source, and no empty one")
    out = {}
    for name, items in sources.items():
        tuned = copy.deepcopy(model)
        sft.sft(tuned, tok, items, cfg)
        out[name] = answers(tuned, tok, test)
    return out


# ---- self-instruct --------------------------------------------------------------------------

def propose(lm: nn.Module, tok: ChatTokenizer, n: int, pool: Sequence[Problem], shots: int = 4,
            temperature: float = 1.0, generator: torch.Generator | None = None) -> list[str]:
    """n new lines from a raw-text model, each continuing a few-shot context of `shots` raw
    lines drawn from the pool (Self-Instruct's prompt, in the form the base model knows)."""
    task._whole("n", n, 1)
    task._whole("shots", shots, 1)
    if len(pool) < shots:
        raise ValueError(f"the pool has {len(pool)} items, fewer than shots={shots}")
    g = generator or torch.Generator().manual_seed(0)
    picks = [torch.randperm(len(pool), generator=g)[:shots].tolist() for _ in range(n)]
    contexts = [tok.encode("\n" + "".join(task.raw_line(pool[i]) + "\n" for i in pick))
                for pick in picks]
    newline = tok.encode("\n")[0]
    width = max(len(task.raw_line(p)) for p in pool) + 2
    longest = max(len(c) for c in contexts) + width
    limit = getattr(getattr(lm, "cfg", None), "max_seq_len", None)
    if limit is not None and longest > limit:
        raise ValueError(f"shots={shots} makes contexts of up to {longest} tokens with the "
                         f"answer, past the model's {limit} positions; use fewer shots")
    roll = policy.sample(lm, tok, contexts, width, temperature, False, g, stop_id=newline)
    return [t.strip() for t in roll.texts]


def self_instruct(lines: Sequence[str], digits: int, pool: Sequence[Problem] = (),
                  dedup_mode: str = "near") -> tuple[list[Problem], dict[str, int]]:
    """Problems from generated raw lines `a+b=c`: well-formed at this width, not in the test
    split, not a duplicate of the pool or of an earlier line ('exact': the same prompt;
    'near': also the same operands in the other order); labelled by the verifier's sum.
    The counts say what each filter removed, and how often the model's own answer was right."""
    task._whole("digits", digits, 1)
    if dedup_mode not in DEDUP:
        raise ValueError(f"dedup must be one of {DEDUP}, got {dedup_mode!r}")
    form = re.compile(rf"(\d{{{digits}}})\+(\d{{{digits}}})=(\d*)")
    counts = dict.fromkeys(("generated", "malformed", "test_split", "duplicate", "kept",
                            "model_right"), 0)
    labelled = []
    for line in lines:
        counts["generated"] += 1
        m = form.fullmatch(line.strip())
        if not m:
            counts["malformed"] += 1
            continue
        a, b = int(m[1]), int(m[2])
        item = task.problem(a, b, digits)
        counts["model_right"] += int(task.verify(item, m[3]))
        if task.split_of(a, b) == "test":
            counts["test_split"] += 1
            continue
        labelled.append(item)
    pool = list(pool)
    fresh = [i - len(pool) for i in kept_indices(pool + labelled, dedup_mode) if i >= len(pool)]
    out = [labelled[i] for i in fresh]
    counts["duplicate"] = len(labelled) - len(out)
    counts["kept"] = len(out)
    return out, counts


# ---- distillation ---------------------------------------------------------------------------

@dataclass(frozen=True)
class TeacherRecipe:
    """The teacher: a reference model pretrained by the base recipe's trainer on the raw text
    for `steps` steps, then fine-tuned on `sft_items` ground-truth chat examples for
    `sft_steps`. The defaults (the stored teacher's) make it about 2.8 times the base model's
    parameters (1.87 M against 0.67 M); the base recipe's own sizes load the shipped weights."""

    d_model: int = 192
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 512
    steps: int = 1000
    sft_items: int = 5000
    sft_steps: int = 800
    seed: int = 0

    def __post_init__(self):
        task.check_fields(self, positive=[f for f in self.__dataclass_fields__ if f != "seed"],
                          non_negative=["seed"])

    def base_recipe(self) -> base.BaseRecipe:
        return base.BaseRecipe(d_model=self.d_model, n_layers=self.n_layers,
                               n_heads=self.n_heads, d_ff=self.d_ff, steps=self.steps,
                               seed=self.seed)


def train_teacher(recipe: TeacherRecipe = TeacherRecipe()) -> tuple[nn.Module, list[Problem]]:
    """The teacher model and the ground-truth items it was fine-tuned on."""
    if not isinstance(recipe, TeacherRecipe):
        raise ValueError(f"recipe must be a TeacherRecipe, got {type(recipe).__name__}")
    tok, digits = task.chat_tokenizer(), recipe.base_recipe().digits
    model = base.base_model(recipe.base_recipe())
    items = task.make_problems(recipe.sft_items, digits, seed=recipe.seed + 1000)
    sft.sft(model, tok, items, sft.SFTConfig(steps=recipe.sft_steps, seed=recipe.seed))
    return model.eval(), items


def teacher_labels(teacher: nn.Module, tok: ChatTokenizer, items: Sequence[Problem]
                   ) -> list[Problem]:
    """The items with the teacher's greedy answers in place of the true ones (an item the
    teacher does not finish with `<|eos|>` is dropped): sequence-level distillation data."""
    return [Problem(p.prompt, a) for p, a in zip(items, answers(teacher, tok, items)) if a]


def write_teacher(path: str | Path, recipe: TeacherRecipe = TeacherRecipe(), prompts: int = 2000,
                  test: int = 500) -> Path:
    """Train the teacher and store its answers to `prompts` training prompts (none of them in
    its own fine-tuning set) and to the first `test` test items of seed 0, with provenance."""
    task._whole("prompts", prompts, 1)
    task._whole("test", test, 1)
    t0 = time.perf_counter()
    teacher, seen = train_teacher(recipe)
    tok, digits = task.chat_tokenizer(), recipe.base_recipe().digits
    used = {p.prompt for p in seen}
    pool = [p for p in task.all_problems(digits, "train") if p.prompt not in used]
    g = torch.Generator().manual_seed(recipe.seed)
    items = [pool[i] for i in torch.randperm(len(pool), generator=g)[:prompts].tolist()]
    tests = task.make_problems(test, digits, 0, "test")
    args = ", ".join(f"{k}={v!r}" for k, v in dataclasses.asdict(recipe).items()
                     if v != getattr(TeacherRecipe(), k))
    command = ('python -c "from trainbook.frontier import synthetic as S; S.write_teacher('
               f"'{path}', S.TeacherRecipe({args}), prompts={prompts}, test={test})\"")
    record = header("synthetic-teacher", command, torch.device("cpu"), "small")
    record.update(recipe=dataclasses.asdict(recipe),
                  parameters=sum(p.numel() for p in teacher.parameters()),
                  labels=[[p.prompt, a] for p, a in zip(items, answers(teacher, tok, items))],
                  test=[[p.prompt, a] for p, a in zip(tests, answers(teacher, tok, tests))],
                  seconds=time.perf_counter() - t0)
    path = Path(path)
    return write_record(path.parent, path.stem, record)


def read_teacher(path: str | Path) -> dict:
    """A stored teacher record (`write_teacher`)."""
    return read_record(path, "synthetic-teacher", "synthetic.write_teacher")
