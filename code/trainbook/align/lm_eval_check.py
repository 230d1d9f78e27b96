"""The evaluation chapter's scores against lm-evaluation-harness itself, on the same model and
items: the exported folder is evaluated by `lm_eval.simple_evaluate` (model "hf", on CPU, in
fp32, offline) with task definitions written here, and each number is compared with ours.

`write_tasks` writes local tasks, each a YAML file beside its JSON-lines data (absolute paths;
`dataset_path: json` reads them with `datasets`, nothing is downloaded): multiple-choice tasks
(`output_type: multiple_choice`: the item's context, its choices and the gold index, with
`target_delimiter: ""` because the raw form `07+58=` continues without a space; metrics acc,
acc_norm, acc_bytes) and a held-out text task (`loglikelihood_rolling`: word and byte
perplexity, bits per byte). `run` evaluates a model folder on them and returns lm-eval's metrics
with its per-item log-likelihoods; `compare` lines them up with `evaluation.multiple_choice`
and `evaluation.heldout` on the reference model. `check` does all of it for the book's base
model on test items, and `write_check` stores its result with provenance, so that the chapter
can show lm-eval's numbers without spending its time budget on lm-eval's start-up.

Chapter: book/alignment/evaluation
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from ..bench.gpu_truth import header, read_record, write_record
from . import base, hf_io, task
from . import evaluation as E

MC_TASK, EOL_TASK, TEXT_TASK = "trainbook_arith_mc", "trainbook_arith_mc_eol", \
    "trainbook_arith_text"
MC_METRICS = tuple(E.LM_EVAL_NORMALISED)  # acc, acc_norm, acc_bytes
TEXT_METRICS = {"word_perplexity": "weighted_perplexity", "byte_perplexity": "weighted_perplexity",
                "bits_per_byte": "bits_per_byte"}  # metric -> lm-eval's aggregation
FILTER = "none"  # lm-eval's key suffix: "acc,none" is acc after the default (no) filter
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
MEASUREMENT, RECORD = "align-lm-eval", "lm-eval-check"


@dataclasses.dataclass(frozen=True)
class CheckItems:
    """Which test items the check scores: n items of the test split (seed), n_choices each."""

    n: int = 100
    seed: int = 1
    n_choices: int = 4

    def __post_init__(self):
        task.check_fields(self, positive=("n", "n_choices"), non_negative=("seed",))

    def problems(self) -> list[task.Problem]:
        return task.make_problems(self.n, 2, self.seed, "test")

    def tasks(self) -> tuple[dict[str, list[E.MCItem]], list[str]]:
        """The MC item sets (choices bare, and ended by the newline the corpus puts after an
        answer) and the held-out texts (the items' raw lines)."""
        p = self.problems()
        mc = {MC_TASK: E.arithmetic_mc(p, self.n_choices, self.seed),
              EOL_TASK: E.arithmetic_mc(p, self.n_choices, self.seed, end="\n")}
        return mc, [task.raw_line(x) + "\n" for x in p]


def _yaml_metrics(names: dict[str, str]) -> str:
    lines = []
    for m, agg in names.items():
        better = "false" if "perplexity" in m or "bits" in m else "true"
        lines.append(f"  - metric: {m}\n    aggregation: {agg}\n    higher_is_better: {better}\n")
    return "".join(lines)


def write_tasks(folder: str | Path, mc: dict[str, Sequence[E.MCItem]],
                texts: Sequence[str]) -> dict[str, Path]:
    """One YAML (and its JSON-lines data) per MC item set, and one for the held-out texts,
    in `folder`; returns {task name: yaml path}."""
    if not mc or not all(items and all(isinstance(i, E.MCItem) for i in items)
                         for items in mc.values()):
        raise ValueError("mc must map task names to non-empty lists of MCItem")
    if not texts or not all(isinstance(t, str) and t for t in texts):
        raise ValueError("texts must be a non-empty list of non-empty strings")
    folder = Path(folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)

    def head(name: str, rows: list[dict], kind: str) -> str:
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return (f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                f"    test: {json.dumps(str(data))}\ntest_split: test\noutput_type: {kind}\n")

    paths = {}
    for name, items in mc.items():
        rows = [{"context": i.context, "choices": list(i.choices), "gold": i.gold}
                for i in items]
        paths[name] = folder / f"{name}.yaml"
        paths[name].write_text(
            head(name, rows, "multiple_choice") + "doc_to_text: context\ndoc_to_choice: "
            "choices\ndoc_to_target: gold\ntarget_delimiter: \"\"\nmetric_list:\n" +
            _yaml_metrics({m: "mean" for m in MC_METRICS}))
    paths[TEXT_TASK] = folder / f"{TEXT_TASK}.yaml"
    paths[TEXT_TASK].write_text(
        head(TEXT_TASK, [{"text": t} for t in texts], "loglikelihood_rolling") +
        "doc_to_text: \"\"\ndoc_to_target: text\nmetric_list:\n" + _yaml_metrics(TEXT_METRICS))
    return paths


def run(model_dir: str | Path, task_dir: str | Path, tasks: Sequence[str],
        batch_size: int = 32) -> dict:
    """lm_eval.simple_evaluate on the folder's model (hf, CPU, fp32, offline) with local tasks:
    {task: {"metrics": {name: value}, "lls": per item: one log-likelihood per choice (MC) or
    the document's (text)}}."""
    model_dir, task_dir = Path(model_dir), Path(task_dir)
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"{model_dir} has no config.json: export the model first (export-hf)")
    missing = [t for t in tasks if not (task_dir / f"{t}.yaml").is_file()]
    if not tasks or missing:
        raise ValueError(f"{task_dir} lacks task definitions {missing or '(none asked)'}: "
                         "write them with write_tasks")
    os.environ.update(OFFLINE)  # before lm_eval imports datasets and transformers
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(task_dir), include_defaults=False)
    out = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={model_dir},dtype=float32", device="cpu",
        tasks=list(tasks), task_manager=manager, batch_size=batch_size, log_samples=True)
    res = {}
    for t in tasks:
        samples = sorted(out["samples"][t], key=lambda s: s["doc_id"])
        lls = [[float(r[0]) if isinstance(r, (list, tuple)) else float(r)
                for r in s["filtered_resps"]] for s in samples]
        res[t] = {"metrics": {k.split(",")[0]: v for k, v in out["results"][t].items()
                              if k.endswith("," + FILTER)}, "lls": lls}
    return res


def ours(model: torch.nn.Module, tok: task.ChatTokenizer, mc: dict[str, Sequence[E.MCItem]],
         texts: Sequence[str]) -> dict:
    """The same numbers from `evaluation`, in `run`'s layout."""
    out = {}
    for name, items in mc.items():
        r = E.multiple_choice(model, tok, items)
        out[name] = {"metrics": r.summary(), "lls": r.lls}
    h = E.heldout(model, tok, texts, task.BOS)
    lls, _ = E.continuation_logprobs(model, [[task.BOS]] * len(texts),
                                     [tok.encode(t) for t in texts])
    out[TEXT_TASK] = {"metrics": {m: h[m] for m in TEXT_METRICS}, "lls": [[x] for x in lls]}
    return out


# Two fp32 forward passes of the same weights (ours and transformers', each with the machine's
# own kernels) give a choice's or a document's log-likelihood to within a few hundred float32
# epsilons of its size: measured worst 9.3e-6 of max(1, |ll|) over 900 items, for the AVX-512,
# AVX2 and default kernel sets of one Zen 4 against lm-eval's run on a Xeon. 5x that is the bound.
LL_RELATIVE_TOLERANCE = 5e-5
SUM_SLACK = 1e-12  # relative: the same numbers summed in another order


def _likelihood_tolerance(metric: str, value: float, total_ll: float, total_diff: float) -> float:
    """How far a held-out metric can move when the documents' total log-likelihood L moves by
    `total_diff` (the sum of the per-document differences actually measured): perplexities are
    exp(-L/W) for a count W (words, bytes), so they move by a factor exp(total_diff ln(ppl)/|L|);
    bits per byte is -L/(B ln 2), so it moves by total_diff/|L| of itself."""
    share = total_diff / abs(total_ll) if total_ll else float("inf")
    if metric == "bits_per_byte":
        return abs(value) * (share + SUM_SLACK)
    return abs(value) * (math.expm1(share * math.log(value)) + SUM_SLACK)


def compare(mine: dict, theirs: dict) -> list[dict]:
    """One row per task and metric: ours, lm-eval's, the difference and the tolerance it must
    stay within; and per task the largest difference of a single log-likelihood, relative to
    max(1, |ll|). Accuracies must agree exactly (their standard errors to rounding); held-out
    metrics within what the measured per-document differences allow (`_likelihood_tolerance`),
    so the check holds on any CPU and still fails on a real disagreement."""
    rows = []
    for t, got in theirs.items():
        ours_ll = [a for x in mine[t]["lls"] for a in x]
        lm_ll = [b for y in got["lls"] for b in y]
        if len(ours_ll) != len(lm_ll):
            raise ValueError(f"task {t}: {len(ours_ll)} log-likelihoods of ours against "
                             f"{len(lm_ll)} of lm-eval's; score the same items")
        total_diff = sum(abs(a - b) for a, b in zip(ours_ll, lm_ll))
        for m, v in got["metrics"].items():
            if m not in mine[t]["metrics"]:
                continue
            if m in TEXT_METRICS:
                tol = _likelihood_tolerance(m, v, sum(lm_ll), total_diff)
            else:  # acc*: counts over the same items; *_stderr: the same counts' formula
                tol = SUM_SLACK * abs(v) if m.endswith("_stderr") else 0.0
            rows.append({"task": t, "metric": m, "ours": mine[t]["metrics"][m],
                         "lm_eval": v, "difference": mine[t]["metrics"][m] - v,
                         "tolerance": tol})
        rows.append({"task": t, "metric": "max |ll difference| / max(1, |ll|)", "ours": None,
                     "lm_eval": None,
                     "difference": max(abs(a - b) / max(1.0, abs(b))
                                       for a, b in zip(ours_ll, lm_ll)),
                     "tolerance": LL_RELATIVE_TOLERANCE})
    return rows


def disagreements(rows: list[dict]) -> list[dict]:
    """The rows of `compare` outside their tolerance: none, when lm-eval and ours agree."""
    return [r for r in rows if not abs(r["difference"]) <= r["tolerance"]]


def check_record(stored: dict, fresh: dict) -> list[str]:
    """`records check lm-eval-check`: a fresh lm-eval run on the same items and weights against
    the stored one, by `compare`'s rules (accuracies exactly, likelihoods within what the
    per-item differences allow), so it holds across CPUs."""
    if (stored["items"], stored["base_sha256"]) != (fresh["items"], fresh["base_sha256"]):
        return ["/items: the fresh run scored other items or weights than the stored one"]

    def numbers(run: dict) -> dict:
        return {t: {"metrics": {m: v for m, v in r["metrics"].items()
                                if isinstance(v, (int, float))}, "lls": r["lls"]}
                for t, r in run.items()}

    return [f"/lm_eval/{r['task']}/{r['metric']}: differs by {r['difference']:.3g}, beyond "
            f"{r['tolerance']:.3g}"
            for r in disagreements(compare(numbers(fresh["lm_eval"]), numbers(stored["lm_eval"])))]


def check(items: CheckItems = CheckItems(), model: torch.nn.Module | None = None,
          batch_size: int = 32) -> dict:
    """Export `model` (default: the book's base model) with the chat tokenizer, run lm-eval on
    the check's tasks and our scorer on the same items: {"lm_eval": ..., "ours": ...}."""
    if not isinstance(items, CheckItems):
        raise ValueError(f"items must be a CheckItems, got {type(items).__name__}")
    model = base.base_model() if model is None else model
    tok = task.chat_tokenizer()
    mc, texts = items.tasks()
    with tempfile.TemporaryDirectory() as tmp:
        hf_io.export(model, Path(tmp) / "model", tok)
        write_tasks(Path(tmp) / "tasks", mc, texts)
        theirs = run(Path(tmp) / "model", Path(tmp) / "tasks", [*mc, TEXT_TASK], batch_size)
    return {"lm_eval": theirs, "ours": ours(model, tok, mc, texts)}


def write_check(folder: str | Path, items: CheckItems = CheckItems()) -> Path:
    """Run `check` on the shipped base model and store lm-eval's side with provenance."""
    import lm_eval
    import transformers

    result = check(items)
    args = ", ".join(f"{k}={v!r}" for k, v in dataclasses.asdict(items).items()
                     if v != getattr(CheckItems(), k))
    cmd = (f'python -c "from trainbook.align import lm_eval_check as C; '
           f'C.write_check({str(folder)!r}, C.CheckItems({args}))"')
    record = header(MEASUREMENT, cmd, torch.device("cpu"), "small")
    record.update(items=dataclasses.asdict(items), base_sha256=base.shipped_record()["sha256"],
                  lm_eval_version=lm_eval.__version__,
                  transformers_version=transformers.__version__, model_args="dtype=float32",
                  lm_eval=result["lm_eval"])
    Path(folder).mkdir(parents=True, exist_ok=True)
    return write_record(folder, RECORD, record)


def read_check(folder: str | Path) -> dict:
    """The stored check (`write_check` writes it)."""
    return read_record(Path(folder) / f"{RECORD}.json", MEASUREMENT,
                       "trainbook.align.lm_eval_check.write_check")
