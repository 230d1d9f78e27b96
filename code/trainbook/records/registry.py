"""Every stored result of the book, declared once: its files, the chapter that reads them, the
function and arguments that regenerate them, and what a fresh run must reproduce.

How an argument is written:
- `out` names the writer's output argument; `out_kind` says whether it takes the record's file
  or the folder the files go in (`records` points it at a temporary folder for `check`);
- a string starting with `book/` or `data/` is a path in the repository, resolved against its
  root, so a regeneration reads the stored inputs wherever it runs from;
- `build` maps an argument to a callable applied to its value first (a dataclass built from a
  dict, a model loaded from a folder);
- `argv` entries run a command (`python -m trainbook ...` or a script) instead of a function,
  with `{out}` replaced by the output path.

`kind` is what "reproduces" means for the record (trainbook.records.KINDS); `tolerance` bounds
relative and absolute differences across machine classes for deterministic records; `check`
names a function(stored, fresh) -> list of problems that replaces the value-by-value comparison
with the properties the chapter asserts (for chaotic runs and measurements).

Chapter: book/how-to-use (stored results).
"""

from __future__ import annotations

from dataclasses import dataclass, field

KINDS = {
    "deterministic": "same machine class: every value equal; another class: every value within "
                     "the stated tolerance",
    "chaotic": "a run the last bits decide (diverging, mostly clipped, long sampling): only what "
               "the chapter asserts, checked by the record's `check`; without one, the "
               "structure (the tests marked `records` compare a fresh run's first steps)",
    "measurement": "timings or process behaviour of the machine at hand: the structure, and what "
                   "the chapter asserts, checked by the record's `check`",
    "input": "a shipped sample or document, not a result: nothing regenerates it",
}


@dataclass(frozen=True)
class Record:
    """One stored result (see the module docstring)."""

    name: str
    files: tuple[str, ...]
    chapter: str
    kind: str
    writer: str | None = None  # "package.module:function"; None with argv or for inputs
    args: dict = field(default_factory=dict)
    out: str = "path"
    out_kind: str = "file"
    build: dict = field(default_factory=dict)
    argv: tuple[str, ...] = ()
    tolerance: tuple[float, float] = (0.0, 0.0)  # (relative, absolute) across machine classes
    check: str | None = None
    ignore: tuple[str, ...] = ()  # keys whose values may differ run to run (timings)
    minutes: float | None = None  # about how long a regeneration takes on a 2-core CPU
    reproduce: str = ""


A = "book/alignment/data"
F = "book/frontier/data"
QUALITY = {"train_items": 8000, "test_items": 300, "steps": 1000, "batch_size": 32,
           "lr_full": 0.001, "lr_lora": 0.001, "ranks": (1, 4, 16), "token_rank": 16,
           "every": 100, "tail": 3, "seeds": (0, 1, 2)}
MOE_NAMES = ["dense, d_ff 128", "dense, d_ff 512", "MoE 8 x 64, top-2", "MoE 16 x 64, top-2",
             "MoE 16 x 32, top-4", "MoE 1 shared + 15 x 32, top-3"]
TRAINING = ("a training run: deterministic on one machine class; on another, fp32 kernels "
            "round differently, so values agree to the stated tolerance")
SAMPLING = ("policies that sample their own data: a different last bit changes a sample and "
            "everything after it; a regeneration is compared on its structure, and its tests "
            "compare a fresh run's first steps and the chapter's conclusions")
TIMING = "timings of this machine: the structure and the chapter's conclusions"


def _seeded(name: str, seed: int, **kw) -> Record:
    return Record(name=f"{name}-seed{seed}", files=(f"{A}/{name}-seed{seed}.json",), **kw)


RECORDS: tuple[Record, ...] = (
    # ---- Part 1: compute
    Record("benchtrain-cpu", ("book/compute/data/benchtrain-cpu.json",), "book/compute/throughput",
           "measurement",
           argv=("python", "-m", "trainbook", "benchtrain", "--models", "tiny-gpt2", "tiny-llama",
                 "small-gpt2", "small-llama", "--batch", "8", "--seq-len", "128", "--steps", "3",
                 "--repeats", "10", "--warmup", "2", "--device", "auto", "--threads", "1",
                 "--output", "{out}"), minutes=3, reproduce=TIMING),
    # ---- Part 3: precision
    Record("numerics-accumulation", ("book/precision/data/numerics-accumulation.json",),
           "book/precision/numerics", "deterministic",
           "trainbook.precision.numerics:write_accumulation_sweep", tolerance=(1e-9, 0.0),
           minutes=1, reproduce="float64 emulation of each accumulator: the same relative "
           "errors on any CPU to 1e-9"),
    Record("mixed-training", ("book/precision/data/mixed-training.json",),
           "book/precision/mixed-precision", "deterministic",
           "trainbook.precision.lowp_training:write_stored", {"name": "mixed-training"},
           out="folder", out_kind="folder", tolerance=(1e-3, 1e-4), minutes=10,
           reproduce=TRAINING),
    Record("mixed-lowp-weights", ("book/precision/data/mixed-lowp-weights.json",),
           "book/precision/mixed-precision", "deterministic",
           "trainbook.precision.lowp_training:write_stored", {"name": "mixed-lowp-weights"},
           out="folder", out_kind="folder", tolerance=(1e-3, 1e-4), minutes=10,
           reproduce=TRAINING),
    Record("fp8-training", ("book/precision/data/fp8-training.json",), "book/precision/fp8",
           "deterministic", "trainbook.precision.fp8_training:write_stored", out="folder",
           out_kind="folder", tolerance=(1e-3, 1e-4), minutes=10, reproduce=TRAINING),
    # ---- Part 4: stability
    Record("clipping-divergence", ("book/stability/data/clipping-divergence.json",),
           "book/stability/clipping", "chaotic",
           "trainbook.stability.clipping_runs:write_divergence_sweep",
           check="trainbook.stability.clipping_runs:check_sweep", minutes=3,
           reproduce="smooth runs (no jump, under half the steps clipped): the last loss to "
           "0.01; diverging runs: NaN, at the same step to 3; chaotic runs (mostly clipped or "
           "jumping): no NaN, and the last loss within 2 standard deviations of the stored "
           "seeds' range"),
    Record("spikes-sweep", ("book/stability/data/spikes-sweep.json",),
           "book/stability/loss-spikes", "chaotic",
           "trainbook.stability.instability:write_sweep",
           {"variants": ["baseline", "qk-norm", "z-loss", "beta2 0.999", "warmup x4",
                         "embed scale"], "lrs": [0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0],
            "every": 5, "d_model": 64, "n_heads": 2, "n_kv_heads": 2, "d_ff": 176,
            "batch_size": 16, "steps": 300, "warmup_steps": 20},
           tolerance=(0.05, 0.02), minutes=15,
           reproduce="runs at learning rates up to 1.0, many diverging: values to 5%"),
    Record("spikes-detector", ("book/stability/data/spikes-detector.json",),
           "book/stability/loss-spikes", "deterministic",
           "trainbook.stability.spikes:write_detector",
           {"seeds": [0, 1, 2, 3, 4, 5, 6, 7], "first": 150, "last": 160, "kind": "random",
            "per_step": 1, "steps": 300}, tolerance=(1e-3, 1e-3), minutes=8,
           reproduce=TRAINING),
    # ---- Part 6: failures
    Record("exact-resume-campaign", ("book/failures/data/exact-resume-campaign.json",),
           "book/failures/exact-resume", "measurement", "trainbook.failures.resume:write_campaign",
           {"n_kills": 20, "nprocs": (1, 2), "seed": 0}, minutes=20,
           reproduce="where kills land is timing; every resumed run equals the uninterrupted "
           "one bit for bit on the machine that runs both"),
    Record("fault-tolerance-goodput", ("book/failures/data/fault-tolerance-goodput.json",),
           "book/failures/fault-tolerance", "measurement", "trainbook.failures.goodput:write_sweep",
           {"steps": 300, "intervals": [10, 20, 40, 80, 160], "mtbf_s": 15.0, "seeds": [0, 1, 2]},
           minutes=7, reproduce=TIMING),
    Record("fault-tolerance-restarts", ("book/failures/data/fault-tolerance-restarts.json",),
           "book/failures/fault-tolerance", "measurement",
           "trainbook.failures.fault_tolerance:write_record", {"trials": 3, "steps": 30},
           minutes=10, reproduce=TIMING),
    Record("fault-tolerance-torchft", ("book/failures/data/fault-tolerance-torchft.json",),
           "book/failures/fault-tolerance", "measurement",
           "trainbook.failures.torchft_demo:write_record", minutes=1, reproduce=TIMING),
    Record("hangs-stacks", ("book/failures/data/hangs-stacks.json",), "book/failures/hangs",
           "measurement", "trainbook.failures.stacks:write_record", minutes=1,
           reproduce="the stacks py-spy and the guard dump from a hung 2-rank job"),
    Record("health-cpu", ("book/failures/data/health-cpu.json",), "book/failures/health",
           "measurement", "trainbook.failures.rank_faults:write_record",
           {"delays": [0.0, 0.01, 0.025, 0.05, 0.1], "steps": 40}, minutes=2,
           reproduce="a healthy node passes; the planted slow rank is the one flagged"),
    Record("health-gpu-samples", ("book/failures/data/health-gpu-samples.json",),
           "book/failures/health", "input",
           reproduce="nvidia-smi and kernel-log output samples the parsers are tested on"),
    Record("slurm-requeue", ("book/failures/data/slurm-requeue.json",), "book/failures/slurm",
           "measurement", "trainbook.failures.slurm_requeue:write_record", {"steps": None},
           minutes=3, reproduce="needs the local SLURM controller (tests/test_slurm.py starts "
           "it); every requeued attempt resumes bit for bit"),
    # ---- Part 7: alignment (inputs read from the stored start, in the repository)
    Record("dpo-start", (f"{A}/dpo-start.json", f"{A}/dpo-start.safetensors"),
           "book/alignment/dpo", "deterministic", "trainbook.align.start:write_start",
           {"name": "dpo-start"}, out="folder", out_kind="folder", tolerance=(1e-3, 1e-4),
           minutes=5, reproduce=TRAINING),
    Record("dpo-study", (f"{A}/dpo-study.json",), "book/alignment/dpo", "chaotic",
           "trainbook.align.dpo_study:write_study", minutes=30, reproduce=SAMPLING),
    *(Record(f"grpo-{part}", (f"{A}/grpo-{part}.json",), "book/alignment/grpo", "chaotic",
             "trainbook.align.grpo_study:write_part", {"part": part}, out="folder",
             out_kind="folder", minutes=30, reproduce=SAMPLING)
      for part in ("dapo", "kl", "length", "r1")),
    Record("lm-eval-check", (f"{A}/lm-eval-check.json",), "book/alignment/evaluation",
           "deterministic", "trainbook.align.lm_eval_check:write_check", out="folder",
           out_kind="folder", check="trainbook.align.lm_eval_check:check_record", minutes=1,
           reproduce="accuracies exactly; log-likelihoods to 5e-5 of their size and held-out "
                     "metrics to what those differences allow (lm_eval_check.compare)"),
    *(_seeded("lora-quality", s, chapter="book/alignment/lora", kind="deterministic",
              writer="trainbook.align.lora_quality:write_quality",
              args={"seed": s, "setup": QUALITY}, out="folder", out_kind="folder",
              build={"setup": "trainbook.align.lora_quality:QualitySetup"},
              tolerance=(0.02, 0.02), minutes=15, reproduce=TRAINING) for s in (0, 1, 2)),
    Record("ppo-runs", (f"{A}/ppo-runs.json",), "book/alignment/ppo", "chaotic",
           "trainbook.align.ppo_study:write_runs", {"start_folder": A, "reward_folder": A},
           out="folder", out_kind="folder", minutes=40, reproduce=SAMPLING),
    Record("rm-reward", (f"{A}/rm-reward.json", f"{A}/rm-reward.safetensors"),
           "book/alignment/reward-models", "deterministic",
           "trainbook.align.reward_study:write_reward_model", {"start_folder": A},
           out="folder", out_kind="folder", tolerance=(1e-3, 1e-3), ignore=("train_seconds",),
           minutes=10, reproduce=TRAINING),
    Record("rm-overopt", (f"{A}/rm-overopt.json",), "book/alignment/reward-models", "chaotic",
           "trainbook.align.reward_study:write_overopt", {"start_folder": A, "reward_folder": A},
           out="folder", out_kind="folder", minutes=15, reproduce=SAMPLING),
    *(_seeded("sft-study", s, chapter="book/alignment/sft", kind="deterministic",
              writer="trainbook.align.sft_study:write_study",
              args={"lrs": [0.0001, 0.0003, 0.001, 0.003], "seed": s, "cfg": {"steps": 1000},
                    "n_train": 8000, "n_test": 500, "every": 100},
              out="out_dir", out_kind="folder", build={"cfg": "trainbook.align.sft:SFTConfig"},
              tolerance=(0.02, 0.02), minutes=20, reproduce=TRAINING) for s in (0, 1)),
    # ---- Part 8: frontier
    Record("moe-capacity", (f"{F}/moe-capacity.json",), "book/frontier/moe", "deterministic",
           "trainbook.frontier.moe_studies:write_study", {"study": "capacity", "seeds": [0, 1]},
           tolerance=(0.02, 0.02), minutes=10, reproduce=TRAINING),
    Record("moe-collapse", (f"{F}/moe-collapse.json",), "book/frontier/moe", "deterministic",
           "trainbook.frontier.moe_studies:write_study",
           {"study": "collapse", "seeds": [0, 1, 2]}, tolerance=(0.02, 0.02), minutes=10,
           reproduce=TRAINING),
    Record("moe-compare", (f"{F}/moe-compare.json",), "book/frontier/moe", "deterministic",
           "trainbook.frontier.moe_studies:write_study",
           {"study": "compare", "seeds": [0], "steps": 3000, "eval_every": 250,
            "eval_batches": 8}, tolerance=(0.02, 0.02), minutes=40, reproduce=TRAINING),
    Record("moe-compare-seeds", (f"{F}/moe-compare-seeds.json",), "book/frontier/moe",
           "deterministic", "trainbook.frontier.moe_studies:write_study",
           {"study": "compare", "names": MOE_NAMES, "seeds": [1, 2], "steps": 3000,
            "eval_every": 250, "eval_batches": 8}, tolerance=(0.02, 0.02), minutes=80,
           reproduce=TRAINING),
    Record("moe-upcycle", (f"{F}/moe-upcycle.json",), "book/frontier/moe", "deterministic",
           "trainbook.frontier.moe_studies:write_study",
           {"study": "upcycle", "dense_steps": 600, "moe_steps": 600, "seeds": [0],
            "eval_every": 100, "eval_batches": 8}, tolerance=(0.02, 0.02), minutes=10,
           reproduce=TRAINING),
    Record("multimodal-llava", (f"{F}/multimodal-llava.json",), "book/frontier/multimodal",
           "deterministic", "trainbook.frontier.multimodal_runs:write_runs",
           {"seeds": [0, 1, 2], "workers": 3}, tolerance=(0.02, 0.02), ignore=("seconds",),
           minutes=30, reproduce=TRAINING),
    Record("synthetic-collapse", (f"{F}/synthetic-collapse.json",), "book/frontier/synthetic-data",
           "chaotic", argv=("python", "-m", "trainbook", "collapse", "--modes",
                            "replace,mix,accumulate", "--real-fraction", "0.5", "--out", "{out}"),
           ignore=("seconds",), minutes=10, reproduce=SAMPLING),
    Record("synthetic-collapse-t1", (f"{F}/synthetic-collapse-t1.json",),
           "book/frontier/synthetic-data", "chaotic",
           argv=("python", "-m", "trainbook", "collapse", "--temperature", "1.0", "--modes",
                 "replace,mix,accumulate", "--real-fraction", "0.5", "--out", "{out}"),
           ignore=("seconds",), minutes=10, reproduce=SAMPLING),
    Record("synthetic-teacher", (f"{F}/synthetic-teacher.json",), "book/frontier/synthetic-data",
           "chaotic", "trainbook.frontier.synthetic:write_teacher",
           {"recipe": {}, "prompts": 2000, "test": 500},
           build={"recipe": "trainbook.frontier.synthetic:TeacherRecipe"}, ignore=("seconds",),
           minutes=60, reproduce=SAMPLING),
    Record("synthetic-rounds", (f"{F}/synthetic-rounds.json",), "book/frontier/synthetic-data",
           "chaotic", "trainbook.frontier.synthetic:write_rounds",
           {"start_folder": A, "cfg": {}, "pool": 2048, "test": 500, "seeds": [0, 1]},
           build={"cfg": "trainbook.frontier.synthetic:LoopConfig"}, ignore=("seconds",),
           minutes=60, reproduce=SAMPLING),
    Record("synthetic-sources", (f"{F}/synthetic-sources.json",), "book/frontier/synthetic-data",
           "chaotic", "trainbook.frontier.synthetic_sources:write_sources",
           {"start_folder": A, "teacher_path": f"{F}/synthetic-teacher.json", "cfg": {},
            "seeds": [0, 1, 2]},
           build={"cfg": "trainbook.frontier.synthetic_sources:SourcesConfig"},
           ignore=("seconds",), minutes=2, reproduce=SAMPLING),
    # ---- data/: the repository's own measurements
    Record("gpu-readme", ("data/gpu/README.md",), "book/compute/throughput", "input",
           reproduce="documentation of the GPU records `python -m trainbook gpumeasure` writes"),
    *(Record(f"torch-floor-{v}", (f"data/torch-floor/torch-{v}.json",), "book/how-to-use",
             "measurement", argv=("bash", "tools/torch_floor.sh", v, "{out}"), minutes=40,
             reproduce="which tests pass on an older torch: the counts, on any machine")
      for v in ("2.9.1", "2.12.1")),
)
