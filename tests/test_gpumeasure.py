"""gpumeasure, the prepared GPU measurement, run whole on the CPU: every record's fields, sane
numbers, refused dtypes, bad input as one line, and a budget too small to measure anything."""

import contextlib
import datetime
import gzip
import io
import json

import pytest

from trainbook.__main__ import main
from trainbook.bench import gpu_truth as G

HEADER = {"measurement", "command", "date_utc", "versions", "device", "size", "status", "reason",
          "budget", "result", "elapsed_s"}
NAMES = ["mamf-fp32", "mamf-bf16", "mamf-tf32", "mamf-fp8", "profile", "train", "memory",
         "fp8-linear"]
MEMORY_TOLERANCE = 0.10  # estimator vs MemTracker, as tests/test_memory.py holds it


def _run(argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["gpumeasure", *argv])
    return code, out.getvalue()


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """One whole run on the CPU, small size, 60 s budget (it takes a few seconds)."""
    out = tmp_path_factory.mktemp("gpu") / "cpu-here"
    code, stdout = _run(["--device", "cpu", "--size", "small", "--budget-s", "60",
                         "--out", str(out), "--json"])
    records = {n: json.loads((out / f"{n}.json").read_text()) for n in NAMES}
    return code, json.loads(stdout), out, records


def test_the_run_writes_one_record_per_measurement(measured):
    code, summary, out, records = measured
    assert code == 0
    assert [m["name"] for m in summary["measurements"]] == NAMES
    assert sorted(p.name for p in out.glob("*.json")) == sorted(f"{n}.json" for n in NAMES)
    assert summary["out"] == str(out) and summary["size"] == "small"
    for name, rec in records.items():
        assert HEADER <= set(rec), name
        assert rec["measurement"] == name and rec["size"] == "small"
        assert rec["command"].startswith("python -m trainbook gpumeasure --device cpu")
        date = datetime.datetime.fromisoformat(rec["date_utc"])
        assert date.utcoffset() == datetime.timedelta(0)
        v = rec["versions"]
        assert v["python"] and v["torch"] and "cuda" in v and "hip" in v
        assert v["trainbook_commit"] is None or len(v["trainbook_commit"]) == 40
        assert rec["device"]["type"] == "cpu" and rec["device"]["count"] == 1
        assert rec["device"]["name"]
        assert rec["status"] in ("measured", "refused"), (name, rec["reason"])


def test_mamf_measures_fp32_and_bf16_and_refuses_tf32_and_fp8(measured):
    records = measured[3]
    for d in ("fp32", "bf16"):
        r = records[f"mamf-{d}"]
        assert r["status"] == "measured" and r["result"]["dtype"] == d
        assert r["result"]["best_tflops"] > 0 and r["result"]["summary"]["measured"] >= 1
        assert r["budget"]["slice_s"] > 0
    for d in ("tf32", "fp8"):
        r = records[f"mamf-{d}"]
        assert r["status"] == "refused" and r["result"] is None
        assert f"{d} matmuls need a GPU" in r["reason"]
    r = records["fp8-linear"]  # the FP8 linear layer against bf16 (book/precision/fp8)
    assert r["status"] == "refused" and r["result"] is None
    assert "fp8 matmuls need a GPU" in r["reason"]


def test_trainer_tokens_per_s_mfu_and_memory(measured):
    t = measured[3]["train"]["result"]
    assert t["tokens_per_s"] > 0 and t["summary"]["steps"] >= 3
    # against the CPU's matmul peak measured at another moment: a busy machine moves it several
    # fold (1.5 failed under load), so only a units error (x1e3) is caught here
    assert 0 < t["mfu"] < 100
    assert all(h["loss"] > 0 for h in t["history"])
    mem = t["peak_memory"]
    assert mem["measured_bytes"] is None and "needs a GPU" in mem["why_null"]
    assert mem["estimated_bytes"] > 0 and mem["estimate"]["weights"] > 0


def test_profile_fractions_and_trace(measured):
    out, p = measured[2], measured[3]["profile"]["result"]
    f = p["fractions"]
    assert list(f) == list(G.CLASSES)
    assert abs(sum(f.values()) - 1) < 1e-6 and all(v >= 0 for v in f.values())
    assert f["matmul"] > 0 and f["attention"] > 0 and f["optimizer"] > 0
    assert f["communication"] == 0  # one process
    assert p["step_s_unprofiled"] > 0 and p["top_ops"]
    trace = json.loads(gzip.decompress((out / p["trace"]).read_bytes()))
    assert trace["traceEvents"]


def test_memory_estimator_against_memtracker(measured):
    m = measured[3]["memory"]["result"]
    assert "MemTracker" in m["how"]
    setups = m["setups"]
    assert len(setups) == 3 and all(s["status"] == "measured" for s in setups)
    assert {(s["micro_batch"], s["recompute"]) for s in setups} == {(8, "none"), (8, "full"),
                                                                    (4, "none")}
    for s in setups:
        assert s["measured_bytes"] > 0
        assert abs(s["estimated_bytes"] / s["measured_bytes"] - 1) < MEMORY_TOLERANCE, s


def test_a_tiny_budget_skips_with_reasons(tmp_path):
    code, stdout = _run(["--device", "cpu", "--budget-s", "0.5", "--out", str(tmp_path),
                         "--json"])
    assert code == 0
    rows = {r["name"]: r for r in json.loads(stdout)["measurements"]}
    assert list(rows) == NAMES
    for name in NAMES:
        rec = json.loads((tmp_path / f"{name}.json").read_text())
        assert HEADER <= set(rec) and rec["result"] is None
        if name in ("mamf-tf32", "mamf-fp8", "fp8-linear"):
            assert rec["status"] == "refused"
        else:
            assert rec["status"] == "skipped" and "budget" in rec["reason"], rec["reason"]
        assert rows[name]["status"] == rec["status"]


@pytest.mark.parametrize("argv, message", [
    (["--device", "tpu"], "unknown device 'tpu'"),
    (["--budget-s", "-5"], "--budget-s must be a positive number of seconds, got -5"),
    (["--budget-s", "nan"], "--budget-s must be a positive number"),
    (["--size", "huge"], "unknown size 'huge': use small or large"),
])
def test_bad_input_is_one_line_and_no_work(argv, message, tmp_path, capsys):
    out = tmp_path / "never"
    assert main(["gpumeasure", "--device", "cpu", *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err
    assert err.count("\n") == 1
    assert not out.exists()


def test_out_must_be_a_folder(tmp_path, capsys):
    f = tmp_path / "file.json"
    f.write_text("{}")
    assert main(["gpumeasure", "--device", "cpu", "--out", str(f)]) == 2
    assert "is a file; give a folder" in capsys.readouterr().err


def test_budget_slices_follow_weights_and_pass_on_what_is_left():
    now = [0.0]
    b = G.Budget(100, {"a": 1, "b": 1, "c": 2}, clock=lambda: now[0])
    assert b.take("a") == pytest.approx(25)
    now[0] = 5.0  # a used 5 of its 25 s: b and c share the 95 left
    assert b.take("b") == pytest.approx(95 / 3)
    now[0] = 200.0
    assert b.take("c") == 0 and b.left() == 0
    with pytest.raises(ValueError, match="--budget-s must be > 0"):
        G.Budget(0, {"a": 1})


@pytest.mark.parametrize("name, cls", [
    ("aten::mm", "matmul"), ("autograd::engine::evaluate_function: MmBackward0", "matmul"),
    ("aten::addmm", "matmul"), ("aten::_scaled_mm", "matmul"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", "attention"),
    ("aten::_efficient_attention_forward", "attention"),
    ("aten::rms_norm", "norm/elementwise"), ("aten::mul_", "norm/elementwise"),
    ("aten::silu_backward", "norm/elementwise"), ("aten::_log_softmax", "norm/elementwise"),
    ("Optimizer.step#AdamW.step", "optimizer"), ("aten::_foreach_lerp_", "optimizer"),
    ("nccl:all_reduce", "communication"), ("c10d::allreduce_", "communication"),
    ("aten::broadcast_tensors", "other"), ("aten::view", "other"), ("aten::embedding", "other"),
])
def test_operator_classes(name, cls):
    assert G.classify(name) == cls


def test_device_slug_is_a_folder_name():
    import torch

    slug = G.device_slug(torch.device("cpu"))
    assert slug.startswith("cpu-") and slug == slug.lower() and "/" not in slug and " " not in slug


def _event(name, us, parent=None, device=False):
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    return SimpleNamespace(name=name, cpu_parent=parent, is_async=False,
                           device_type=DeviceType.CUDA if device else DeviceType.CPU,
                           self_device_time_total=us, self_cpu_time_total=1.0)


def test_gpu_profile_counts_kernel_time_by_launching_operator():
    """The GPU path, with made-up events: kernel time is filed under the host operator that
    launched it (the kernels' own events are not counted twice), views inherit their parent's
    class, and everything inside the optimizer step is optimizer."""
    step = _event("Optimizer.step#AdamW.step", 0.0)
    linear = _event("aten::linear", 0.0)
    events = [linear, _event("aten::mm", 600.0, linear), _event("aten::t", 0.0, linear),
              _event("aten::_efficient_attention_forward", 200.0),
              _event("aten::add", 50.0), _event("aten::_foreach_mul_", 100.0, step),
              _event("aten::mul_", 50.0, step), _event("sm90_xmma_gemm_bf16", 600.0, device=True)]
    fractions, busy, top = G.class_fractions(events, use_device=True)
    assert busy == pytest.approx(1e-3)
    assert fractions == pytest.approx({"matmul": 0.6, "attention": 0.2, "norm/elementwise": 0.05,
                                       "optimizer": 0.15, "communication": 0.0, "other": 0.0})
    assert top[0]["name"] == "aten::mm"
    with pytest.raises(ValueError, match="no operator time"):
        G.class_fractions([_event("aten::mm", 0.0)], use_device=True)


@pytest.mark.parametrize("gib, micro_batch, layers", [(80, 8, 16), (40, 4, 16), (24, 1, 16),
                                                      (16, 2, 8)])
def test_the_large_gpu_size_fits_the_device(gib, micro_batch, layers, monkeypatch):
    """Sized by the estimator within 60% of the GPU's memory: fewer sequences, then fewer layers."""
    from types import SimpleNamespace

    import torch

    from trainbook.commands import gpumeasure

    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: SimpleNamespace(total_memory=gib * 2**30))
    plan = gpumeasure._plan("large", torch.device("cuda", 0))
    assert (plan["micro_batch"], plan["model"].n_layers) == (micro_batch, layers)
    assert plan["dtype"] == "bf16" and plan["seq_len"] == 2048
    est = G.estimate(plan["model"], micro_batch, 2048, "bf16").peak
    assert est <= 0.6 * gib * 2**30
