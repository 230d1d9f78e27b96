"""The trainer composes native parallelism: every layout matches one process, on 4 gloo ranks.

Each composition runs `python -m trainbook train` under torchrun (4 CPU ranks, gloo) for 5
steps and is compared, step by step, with one process that sees the same global batch (the
loader shards one global batch by data-parallel rank, so batch_size x dp in one process is the
same set of sequences). Checkpoints written under one layout resume under another through DCP.
Every launch has a timeout.
"""

import json
import subprocess
import sys

import pytest

from trainbook import launch
from trainbook.train import TrainConfig, train

STEPS, BATCH, ACCUM = 5, 2, 2
COMMON = dict(model="tiny-llama", tokenizer="bytes", seq_len=32, steps=STEPS, warmup_steps=1,
              eval_batches=1, log_every=0, progress=False, device="cpu")
TOL = 1e-4  # fp32; TP reorders sums (all-reduces), FSDP reduce-scatters: not bit for bit


def flags(**kw) -> list[str]:
    out = []
    for k, v in kw.items():
        flag = "--" + k.replace("_", "-")
        out += [flag] if v is True else [f"--no-{flag[2:]}"] if v is False else [flag, str(v)]
    return out


def torchrun(tmp_path, name: str, nprocs: int = 4, **kw) -> dict:
    """Run the trainer under torchrun; the rank-0 summary and history from --json-out."""
    out = tmp_path / f"{name}.json"
    args = {**COMMON, "batch_size": BATCH, "grad_accum": ACCUM, **kw}
    launch.torchrun(["train", *flags(**args), "--json-out", out], nprocs, timeout_s=240,
                    cwd=tmp_path)
    return json.loads(out.read_text())


_references: dict = {}


def reference(dp: int, grad_accum: int = ACCUM) -> list[float]:
    """One process, the same global batch: BATCH x dp sequences per micro-batch."""
    key = (dp, grad_accum)
    if key not in _references:
        cfg = TrainConfig(**COMMON, batch_size=BATCH * dp, grad_accum=grad_accum)
        _references[key] = train(cfg).losses()
    return _references[key]


LAYOUTS = {  # name: (trainer options, dp)
    "fsdp": (dict(dp_shard=4), 4),
    "hsdp": (dict(dp_replicate=2, dp_shard=2), 4),
    "tp": (dict(tp=2, dp_replicate=2), 2),
    "fsdp_x_tp": (dict(dp_shard=2, tp=2), 2),
    "pp_x_fsdp": (dict(pp=2, dp_shard=2), 2),
    "pp_x_tp": (dict(pp=2, tp=2), 1),
    "fsdp_recompute_full": (dict(dp_shard=4, recompute="full"), 4),
    "fsdp_x_tp_selective": (dict(dp_shard=2, tp=2, recompute="selective"), 2),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_composition_matches_one_process(tmp_path, name):
    options, dp = LAYOUTS[name]
    got = [r["loss"] for r in torchrun(tmp_path, name, **options)["history"]]
    ref = reference(dp)
    diff = max(abs(a - b) for a, b in zip(got, ref, strict=True))
    print(f"{name}: 4 ranks, max |loss - one process| over {STEPS} steps = {diff:.2e}")
    assert diff < TOL, (got, ref)


def test_interleaved_pipeline_matches_one_process(tmp_path):
    got = [r["loss"] for r in torchrun(tmp_path, "interleaved", pp=2, dp_shard=2, grad_accum=4,
                                       pp_schedule="interleaved-1f1b")["history"]]
    ref = reference(2, grad_accum=4)
    assert max(abs(a - b) for a, b in zip(got, ref, strict=True)) < TOL


def test_checkpoint_resumes_under_another_layout(tmp_path):
    """Saved sharded under FSDP x TP after 3 steps, resumed under PP x FSDP: the last two
    steps are those of the uninterrupted run (DCP reshards by parameter name)."""
    ckpt = tmp_path / "ckpt"
    torchrun(tmp_path, "first", dp_shard=2, tp=2, ckpt_dir=ckpt, stop_after=3)
    saved = sorted(p.name for p in ckpt.iterdir() if p.name != ".lock")  # the guard's lock
    assert saved == ["RUN.json", "step-000003"]  # the folder's owner, and its one checkpoint
    assert (ckpt / "step-000003" / ".metadata").is_file()
    second = torchrun(tmp_path, "second", pp=2, dp_shard=2, ckpt_dir=ckpt, resume=True)
    got = [r["loss"] for r in second["history"]]
    ref = reference(2)
    assert len(got) == STEPS
    assert max(abs(a - b) for a, b in zip(got[3:], ref[3:], strict=True)) < TOL


def test_the_planners_best_layout_runs(tmp_path):
    """plan --json feeds train --layout: the layout, micro-batch and micro-batch count."""
    plan = subprocess.run([sys.executable, "-m", "trainbook", "plan", "--model", "tiny-llama",
                           "--gpus", "4", "--global-batch-tokens", str(32 * 8), "--seq-len", "32",
                           "--json"], capture_output=True, text=True, timeout=120, check=True)
    (tmp_path / "plan.json").write_text(plan.stdout)
    best = json.loads(plan.stdout)["layouts"][0]
    out = torchrun(tmp_path, "planned", layout=tmp_path / "plan.json")
    assert out["config"]["batch_size"] == best["micro_batch"]
    assert out["config"]["grad_accum"] == best["micro-batches"]
    assert out["history"][-1]["loss"] < out["history"][0]["loss"]


@pytest.mark.parametrize("options, message", [
    (dict(tp=2), "needs 2 ranks but 1 were started"),
    (dict(tp=3), "tp 3 does not divide 4 heads"),
    (dict(cp=2, dp_shard=2), "context parallelism in the trainer needs"),
    (dict(pp=2, pp_schedule="zbv"), "zbv schedule is in the pipeline chapter"),
    (dict(pp=2, model="tiny-gpt2"), "ties its embedding and head"),
    (dict(pp=2, grad_accum=1), "give --grad-accum >= 2"),
    (dict(dp_shard=2, dtype="fp16"), "use --dtype bf16 with FSDP, TP or PP"),
    (dict(recompute="some"), "recompute must be one of none, selective, full"),
    (dict(pp_schedule="looped"), "pp_schedule must be one of"),
    (dict(dp_shard=0), "dp_shard must be >= 1"),
    (dict(layout="/nonexistent/layout.json"), "layout file '/nonexistent/layout.json' does not"),
])
def test_bad_layouts_are_refused_before_any_work(options, message):
    kw = {**COMMON, "batch_size": BATCH, "grad_accum": ACCUM, **options}
    with pytest.raises(ValueError, match=message):
        train(TrainConfig(**kw))


def test_torchrun_reports_failures_and_bad_input(tmp_path):
    with pytest.raises(RuntimeError, match="needs 4 ranks but 2 were started"):
        launch.torchrun(["train", *flags(**COMMON), "--dp-shard", "4"], 2, timeout_s=120)
    with pytest.raises(ValueError, match="nprocs must be a positive integer"):
        launch.torchrun(["train"], 0)


def test_a_layout_file_without_a_layout_is_refused(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model": "x"}))
    with pytest.raises(ValueError, match="holds no layout"):
        train(TrainConfig(**COMMON, layout=str(bad)))
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read layout file"):
        train(TrainConfig(**COMMON, layout=str(bad)))
