"""The training lifecycle: the stages from raw text to an evaluated model, the compute a plan
gives each, the success criteria a team writes before a run, and the data stage of the tiny
run through every stage this book implements (calibrate filters on trusted text, plant junk and
copies, filter, deduplicate, write the corpus the trainer reads).

Chapter: book/start/lifecycle.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from .. import configs, hardware
from ..compute import cost, flops
from . import dedup, quality

__all__ = ["STAGES", "Criteria", "Stage", "StageWork", "check_criteria", "calibrate_rules",
           "clean_corpus", "plan_compute", "rule_false_positives", "stage_table"]


@dataclass(frozen=True)
class Stage:
    """One stage of the lifecycle: what it takes, what it hands on, who does it, and the chapter
    that teaches it (None: a part still to come)."""

    name: str
    consumes: str
    produces: str
    owner: str
    chapter: str | None
    part: str


STAGES = (
    Stage("data", "raw documents (web, code, books, papers) and their licences",
          "filtered, deduplicated text, weighted into a mixture", "data team",
          "pretraining/data-tokenization", "Part 2"),
    Stage("tokenizer", "a sample of the mixture", "a vocabulary and merges: bytes per token",
          "data team", "pretraining/data-tokenization", "Part 2"),
    Stage("pretraining", "trillions of tokens: nearly all of the FLOPs", "a base model",
          "pretraining team and cluster operators", "pretraining/autoregressive", "Part 2"),
    Stage("mid-training and annealing", "the best data last, long documents, a learning rate "
          "decayed to its floor", "the final base model", "pretraining team",
          "pretraining/schedules", "Part 2"),
    Stage("supervised fine-tuning", "demonstrations: prompts with the responses wanted",
          "a model that follows instructions", "post-training team and annotators", None,
          "Part 7"),
    Stage("preference tuning and RL", "preference pairs, a reward model or verifiable rewards",
          "an aligned model, or a reasoner", "post-training team and annotators", None, "Part 7"),
    Stage("evaluation", "held-out text, benchmarks, human raters",
          "the go or no-go at every gate above", "evaluation team", "pretraining/loss",
          "Parts 2 and 7"),
)


def stage_table() -> pd.DataFrame:
    """STAGES as a table, one row per stage."""
    return pd.DataFrame([{"stage": s.name, "consumes": s.consumes, "produces": s.produces,
                          "who": s.owner, "where in this book": s.part} for s in STAGES]
                        ).set_index("stage")


# --- compute per stage ---------------------------------------------------------------------------

@dataclass(frozen=True)
class StageWork:
    """The tokens a stage processes and how: "train" (forward and backward of the model),
    "preference" (train, plus a frozen reference model's forward, as DPO runs it) or "forward"
    (scoring only, as evaluation does)."""

    tokens: float
    kind: str = "train"

    def __post_init__(self) -> None:
        if self.kind not in ("train", "preference", "forward"):
            raise ValueError(f"kind must be train, preference or forward, got {self.kind!r}")
        if not math.isfinite(self.tokens) or self.tokens < 0:
            raise ValueError(f"tokens must be a finite number >= 0, got {self.tokens}")


def plan_compute(model: str | configs.ModelConfig, stages: Mapping[str, StageWork],
                 seq_len: int, gpu: str = "h100-sxm", gpus: int = 1, mfu: float = 0.4,
                 dtype: str = "bf16") -> pd.DataFrame:
    """FLOPs, GPU-hours and days on `gpus` GPUs at `mfu` for each stage of a plan, with each
    stage's share of the total. A training token costs 6N + 12LHQT FLOPs (PaLM's count), a
    scored token one third of that, a preference token both."""
    if not stages:
        raise ValueError("plan_compute needs at least one stage")
    cfg = configs.resolve(model)
    per_train = flops.training_flops_per_token(cfg, seq_len)
    per_token = {"train": per_train, "forward": per_train / 3,
                 "preference": per_train * 4 / 3}
    peak = hardware.get(gpu).peak_flops(dtype)
    rows = []
    for name, work in stages.items():
        total = work.tokens * per_token[work.kind]
        seconds = cost.compute_seconds(total, gpus, peak, mfu)
        rows.append({"stage": name, "tokens": work.tokens, "kind": work.kind, "FLOPs": total,
                     "GPU-hours": seconds * gpus / 3600, "days": seconds / 86400})
    table = pd.DataFrame(rows).set_index("stage")
    table["share of FLOPs"] = table.FLOPs / table.FLOPs.sum()
    return table


# --- success criteria ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Criteria:
    """What a run must reach, written down before it starts. Quality: held-out bits per byte at
    most `max_bits_per_byte`; annealing ends at least `min_anneal_gain` bits per byte below a
    control that kept the constant learning rate for the same steps;
    at most `max_epochs` passes over the data. Machine: at least `min_mfu` of the peak and
    `min_tokens_per_s`, within `budget_s` seconds of wall time. `gates`: further held-out
    measures with their thresholds (name -> (measure <= threshold))."""

    max_bits_per_byte: float
    min_anneal_gain: float = 0.0
    max_epochs: float = 3.0
    min_mfu: float = 0.0
    min_tokens_per_s: float = 0.0
    budget_s: float = math.inf
    gates: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("max_bits_per_byte", "max_epochs", "budget_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.min_mfu <= 1:
            raise ValueError(f"min_mfu is a fraction of the peak in [0, 1], got {self.min_mfu}")
        if self.min_tokens_per_s < 0 or self.min_anneal_gain < 0:
            raise ValueError("min_tokens_per_s and min_anneal_gain must be >= 0")

    def rows(self) -> list[tuple[str, str, float, str]]:
        """(criterion, the measurement it reads, threshold, "max" or "min")."""
        out = [("held-out bits per byte", "bits_per_byte", self.max_bits_per_byte, "max"),
               ("annealing gain over the control, bits per byte", "anneal_gain",
                self.min_anneal_gain, "min"),
               ("epochs over the data", "epochs", self.max_epochs, "max"),
               ("MFU", "mfu", self.min_mfu, "min"),
               ("tokens/s", "tokens_per_s", self.min_tokens_per_s, "min"),
               ("wall time, s", "wall_s", self.budget_s, "max")]
        return out + [(name, name, limit, "max") for name, limit in self.gates.items()]


def check_criteria(criteria: Criteria, measured: Mapping[str, float]) -> pd.DataFrame:
    """One row per criterion: its threshold, the measurement and whether it holds. A missing
    measurement is an error, not a pass."""
    rows = []
    for label, key, limit, how in criteria.rows():
        if key not in measured:
            raise ValueError(f"no measurement {key!r} for criterion {label!r}; measured: "
                             f"{', '.join(sorted(measured))}")
        value = float(measured[key])
        ok = value <= limit if how == "max" else value >= limit
        rows.append({"criterion": label, "target": f"{'<=' if how == 'max' else '>='} {limit:g}",
                     "measured": value, "met": bool(ok)})
    return pd.DataFrame(rows).set_index("criterion")


# --- the data stage of the tiny run --------------------------------------------------------------

def rule_false_positives(trusted: Sequence[str]) -> pd.Series:
    """The share of `trusted` documents, known to be good, that each quality rule would drop."""
    if not trusted:
        raise ValueError("need trusted documents to measure false positives on")
    return pd.DataFrame([quality.rules(d) for d in trusted]).mean().rename("false positives")


def calibrate_rules(trusted: Sequence[str], max_false_positive: float = 0.01) -> list[str]:
    """The quality rules to apply to a source: those that drop at most `max_false_positive` of
    its trusted documents. Web-page rules misfire on other sources (a play's speeches are short
    and have few sentences), so each source gets the rules its good documents pass."""
    if not 0 <= max_false_positive < 1:
        raise ValueError(f"max_false_positive must be in [0, 1), got {max_false_positive}")
    fired = rule_false_positives(trusted)
    return [rule for rule, share in fired.items() if share <= max_false_positive]


def _plant(docs: list[str], junk: Mapping[str, list[str]], copies: int, replace: float,
           rng: np.random.Generator) -> tuple[list[str], list[str]]:
    """docs with junk inserted anywhere and, for `copies` long documents, an exact and a near
    copy (a `replace` fraction of its words swapped) inserted after the original, as a crawl
    meets a page again. Returns (docs, origin of each: "real", a junk kind, "exact copy" or
    "near copy")."""
    long_ids = [i for i, d in enumerate(docs) if len(d.split()) >= 40]
    vocabulary = sorted({w for i in long_ids for w in dedup.normalize(docs[i]).split()})
    placed = [(float(i), d, "real") for i, d in enumerate(docs)]
    for kind, kind_docs in junk.items():
        placed += [(rng.uniform(0, len(docs)), d, kind) for d in kind_docs]
    for i in rng.choice(long_ids, size=min(copies, len(long_ids)), replace=False):
        near = dedup.perturb(docs[i], replace, vocabulary, rng)
        placed += [(rng.uniform(i + 0.5, len(docs)), docs[i], "exact copy"),
                   (rng.uniform(i + 0.5, len(docs)), near, "near copy")]
    placed.sort(key=lambda p: p[0])
    return [p[1] for p in placed], [p[2] for p in placed]


def clean_corpus(text: str, out: str | Path, junk_per_kind: int = 10, copies: int = 50,
                 replace: float = 0.01, max_false_positive: float = 0.01, seed: int = 0
                 ) -> tuple[pd.DataFrame, list[str]]:
    """The data stage on a known corpus: split it into documents (speeches), plant junk
    documents and exact and near copies of real ones, drop what the calibrated rules flag,
    deduplicate (exact, then MinHash LSH), and write the kept documents to `out` (UTF-8, blank
    lines between documents) for the trainer's --corpus. Returns (what happened to each kind of
    document, the rules applied)."""
    if junk_per_kind < 0 or copies < 0 or not 0 < replace < 1:
        raise ValueError(f"need junk_per_kind >= 0, copies >= 0 and 0 < replace < 1, got "
                         f"{junk_per_kind}, {copies}, {replace}")
    rng = np.random.default_rng(seed)
    real = quality.speeches(text)
    rules = calibrate_rules(real, max_false_positive)
    junk = quality.junk_documents(real, junk_per_kind, seed) if junk_per_kind else {}
    docs, labels = _plant(real, junk, copies, replace, rng)
    flagged = [any(fired[r] for r in rules) for fired in map(quality.rules, docs)]
    passed = [i for i, f in enumerate(flagged) if not f]
    res = dedup.deduplicate([docs[i] for i in passed])
    kept = {passed[j] for j in res.keep}
    fate = ["kept" if i in kept else "filtered" if flagged[i] else "deduplicated"
            for i in range(len(docs))]
    Path(out).write_text("\n\n".join(docs[i] for i in sorted(kept)) + "\n", encoding="utf-8")
    report = pd.crosstab(pd.Series(labels, name="document"), pd.Series(fate, name="fate"))
    return report.reindex(columns=["kept", "filtered", "deduplicated"], fill_value=0), rules
