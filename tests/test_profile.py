"""The step profiler: every operator class is reachable from a real event name, bad names are
rejected, and a profiled step of the reference model has matmul, attention, optimizer and loss
time whose shares sum to 1, with a readable trace and nothing written to stderr."""

import gzip
import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from trainbook import configs
from trainbook.bench import profile as P
from trainbook.bench.memory_measure import random_batch
from trainbook.model import Transformer

EXAMPLES = {
    "matmul": ["aten::mm", "aten::addmm", "aten::bmm", "aten::linear",
               "autograd::engine::evaluate_function: MmBackward0"],
    "attention": ["aten::_scaled_dot_product_flash_attention_for_cpu",
                  "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
                  "aten::_scaled_dot_product_efficient_attention"],
    "elementwise": ["aten::mul", "aten::add_", "aten::rsqrt", "aten::silu",
                    "aten::silu_backward", "aten::pow", "aten::mean"],
    "optimizer": ["Optimizer.step#AdamW.step", "Optimizer.zero_grad#AdamW.zero_grad",
                  "aten::_foreach_mul_", "aten::_foreach_norm", "aten::_fused_adamw_"],
    "loss": ["aten::cross_entropy_loss", "aten::nll_loss_forward", "aten::_log_softmax",
             "aten::_log_softmax_backward_data",
             "autograd::engine::evaluate_function: NllLossBackward0"],
    "communication": ["nccl:all_reduce", "c10d::allreduce_", "record_param_comms"],
    "copies/other": ["aten::copy_", "aten::_to_copy", "aten::cat", "aten::embedding",
                     "aten::embedding_dense_backward", "aten::empty", "aten::view",
                     "some_custom_range"],
}


def test_the_examples_cover_every_class():
    assert set(EXAMPLES) == set(P.CLASSES)


@pytest.mark.parametrize("cls,name", [(c, n) for c, ns in EXAMPLES.items() for n in ns])
def test_classify(cls, name):
    assert P.classify(name) == cls


@pytest.mark.parametrize("bad", ["", "   ", None, 3, b"aten::mm"])
def test_classify_rejects_what_is_not_an_event_name(bad):
    with pytest.raises(ValueError, match="op_name must be a profiler event name"):
        P.classify(bad)


@given(st.text(min_size=1).filter(str.strip))
def test_classify_always_answers_with_a_class(name):
    assert P.classify(name) in P.CLASSES


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    cfg = configs.get("tiny-llama").with_(vocab_size=256, d_model=64, n_layers=2, n_heads=4,
                                          n_kv_heads=2, d_ff=128, max_seq_len=32)
    torch.manual_seed(0)
    model = Transformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = random_batch(cfg, 2, 32, 0)
    path = tmp_path_factory.mktemp("trace") / "step.json.gz"
    return P.profile_step(model, opt, x, y, steps=2, warmup=1, trace_path=path)


def test_profile_shares_sum_to_one_and_every_part_of_the_step_shows(profiled):
    table, _ = profiled
    assert list(table.index) == list(P.CLASSES)
    assert table["share"].sum() == pytest.approx(1.0)
    assert (table["share"] >= 0).all()
    for cls in ("matmul", "attention", "optimizer", "loss", "elementwise"):
        assert table.loc[cls, "seconds per step"] > 0, cls
    assert table.loc["communication", "seconds per step"] == 0  # one process
    a = table.attrs
    assert a["steps"] == 2 and a["busy_s_per_step"] == pytest.approx(
        table["seconds per step"].sum())
    assert a["busy_s_per_step"] <= a["step_s_profiled"] * 1.05  # ops run inside the steps
    assert a["top_ops"] and {r["class"] for r in a["top_ops"]} <= set(P.CLASSES)


def test_profile_writes_a_chrome_trace(profiled):
    _, path = profiled
    with gzip.open(path, "rt") as f:
        trace = json.load(f)
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "aten::mm" in names and any(str(n).startswith("Optimizer.step#") for n in names)


def test_profile_default_trace_path_is_outside_the_repository():
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    assert repo not in P.default_trace_path().parents


def test_profile_keeps_stderr_clean(capfd, tmp_path):
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 4)

    def step(m, o, x, y):
        m(x).sum().backward()
        o.step()
        o.zero_grad()

    P.profile_step(model, opt, x, x, step=step, steps=1, warmup=1, trace_path=tmp_path / "t.json")
    assert capfd.readouterr().err == ""  # kineto's "USDT: ... profiler_start" lines held back


@pytest.mark.parametrize("kw,match", [(dict(steps=0), "steps and warmup"),
                                      (dict(warmup=0), "steps and warmup"),
                                      (dict(steps=1.5), "steps and warmup")])
def test_profile_step_rejects_bad_counts(kw, match):
    model = torch.nn.Linear(2, 2)
    x = torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match=match):
        P.profile_step(model, torch.optim.SGD(model.parameters(), lr=0.1), x, x, **kw)


def test_profile_step_rejects_mismatched_batches():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="one shape"):
        P.profile_step(model, torch.optim.SGD(model.parameters(), lr=0.1),
                       torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long))
