"""The numerics chapter's code (trainbook.precision.numerics, .stable, .reproducibility): sums
against their textbook bounds, the bf16 count that stalls at 256, torch.sum's accumulator, a
matmul's accumulator and DeepSeek-V3's promotion, softmax and norms that cannot overflow, and
what does and does not repeat bit for bit; the stored accumulator sweep against a fresh run."""

import json
import math
from pathlib import Path

import pytest
import torch

from trainbook import formats as F
from trainbook.model import RMSNorm
from trainbook.precision import numerics as N
from trainbook.precision import reproducibility as R
from trainbook.precision import stable as S
from trainbook.train import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
SWEEP = ROOT / "book" / "precision" / "data" / "numerics-accumulation.json"


def test_a_running_count_stalls_at_two_to_the_mantissa_plus_one():
    assert N.stall_point("bf16") == 256.0
    assert N.stall_point("fp16") == 2048.0
    assert N.stall_point("fp8_e4m3") == 16.0
    assert N.stall_point(F.FORMATS["bf16"]) == 256.0  # through quantize: the same
    counts = N.running_sum(torch.ones(1, 3000), "bf16", record=[255, 256, 257, 3000])
    assert counts[0].tolist() == [255.0, 256.0, 256.0, 256.0]


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_native_low_precision_sums_round_once_per_addition(fmt):
    """torch's bf16/fp16 additions equal exact additions rounded to the format (fp32 holds
    more than 2p + 2 bits), so the fast native path and the quantize path agree bit for bit."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 700, generator=g) * torch.logspace(-6, 3, 700)
    f = F.FORMATS[fmt]
    assert torch.equal(N.running_sum(x, fmt, [1, 100, 700]), N.running_sum(x, f, [1, 100, 700]))
    assert torch.equal(N.pairwise_sum(x, fmt), N.pairwise_sum(x, f))
    assert torch.equal(N.kahan_sum(x, fmt), N.kahan_sum(x, f))


def test_sum_errors_order_and_bounds():
    rows = N.sum_errors([16, 256, 4096], "bf16", trials=4)
    err = {(r["n"], r["method"]): r for r in rows}
    big = {m: err[(4096, m)]["error"] for m in N.METHODS}
    assert big["naive"] > 10 * big["pairwise"] > 10 * big["kahan"] / 2
    assert big["kahan"] < 2 * N.unit_roundoff("bf16")
    assert big["fp32 accumulator"] <= N.unit_roundoff("bf16")  # one final rounding
    for r in rows:
        if r["method"] != "naive" or r["n"] * N.unit_roundoff("bf16") < 1:
            assert r["worst"] <= r["bound"], r
    assert err[(4096, "naive")]["error"] > 0.5  # stalled far below the sum


def test_error_bounds_are_highams():
    u = 2.0**-8
    b = N.error_bounds(1024, "bf16")
    assert b["naive"] == 1023 * u and b["pairwise"] == 10 * u
    assert b["kahan"] == 2 * u + 1024 * u * u
    with pytest.raises(ValueError, match="n must be >= 1"):
        N.error_bounds(0, "bf16")


def test_torch_sum_of_bf16_on_one_thread_is_the_exact_sum_rounded_once():
    rows = N.torch_sum_check([10, 1000, 100_000], threads=1, trials=5)
    assert all(r["correctly rounded"] == 1.0 for r in rows)
    assert all(r["worst error (bf16 spacings)"] <= 0.5 for r in rows)
    before = torch.get_num_threads()
    N.torch_sum_check([100], threads=2, trials=1)
    assert torch.get_num_threads() == before


def test_accumulators_in_a_matmul():
    g = torch.Generator().manual_seed(0)
    a = F.quantize(torch.randn(8, 512, generator=g, dtype=torch.float64), "bf16")
    b = F.quantize(torch.randn(512, 8, generator=g, dtype=torch.float64), "bf16")
    exact = a @ b
    rel = lambda c: ((c - exact).norm() / exact.norm()).item()  # noqa: E731
    assert rel(N.accumulate(a, b, "fp32")) < 1e-6
    assert rel(N.accumulate(a, b, "bf16")) > 1e-3
    chopped = rel(N.accumulate(a, b, N.E8M13, truncate=True))
    chunked = rel(N.accumulate(a, b, N.E8M13, truncate=True, chunk=32))
    promoted = rel(N.accumulate(a, b, N.E8M13, truncate=True, chunk=32, promote_every=128))
    assert chopped > chunked > promoted
    pos = a.abs() @ b.abs()  # chopping is biased: it only ever shrinks a positive sum
    assert (N.accumulate(a.abs(), b.abs(), N.E8M13, truncate=True) <= pos).all()


@pytest.mark.records
def test_stored_accumulation_sweep_matches_a_fresh_run():
    stored = json.loads(SWEEP.read_text())
    assert stored["kind"] == "numerics-accumulation"
    for key in ("command", "date", "torch", "device_name"):
        assert stored[key]
    assert "write_accumulation_sweep" in stored["command"]
    rows = {(r["inputs"], r["accumulator"], r["k"], r["seed"]): r["relative error"]
            for r in stored["rows"]}
    assert len(rows) == len(stored["ks"]) * len(stored["seeds"]) * \
        (len(N.BF16_ACCUMULATORS) + len(N.ACCUMULATORS))
    for r in N.accumulation_sweep(ks=[64, 256], seeds=[0]):
        assert rows[(r["inputs"], r["accumulator"], r["k"], r["seed"])] == \
            pytest.approx(r["relative error"], rel=1e-9)
    k = max(stored["ks"])
    mean = lambda inp, acc: sum(rows[(inp, acc, k, s)] for s in stored["seeds"]) / \
        len(stored["seeds"])  # noqa: E731
    assert mean("bf16", "bf16") > 1e4 * mean("bf16", "fp32")
    promoted = "14 bits, chopped, 32 at a time, promoted every 128"
    assert mean("fp8_e4m3", promoted) < mean("fp8_e4m3",
                                             "14 bits, chopped, 32 products at a time") / 10


def test_softmax_overflows_in_fp16_past_ln_65504_unless_the_max_is_subtracted():
    assert S.exp_overflow("fp16") == pytest.approx(math.log(65504))
    rows = {r["largest logit"]: r for r in S.softmax_table([11.0, 11.1, 100.0], "fp16")}
    assert rows[11.0]["naive finite"] and not rows[11.1]["naive finite"]
    assert all(r["stable finite"] and r["stable max error"] < 1e-3 for r in rows.values())
    bf = {r["largest logit"]: r for r in S.softmax_table([88.0, 89.0], "bf16")}
    assert bf[88.0]["naive finite"] and not bf[89.0]["naive finite"]


def test_attention_logits_scale_and_rounding():
    s = S.logit_scale(128, n=8192)
    assert s["std raw"] == pytest.approx(math.sqrt(128), rel=0.1)
    assert s["std scaled"] == pytest.approx(1.0, rel=0.1)
    assert s["entropy raw"] < 0.5 * s["entropy scaled"]
    rows = S.logit_rounding_error([1, 10, 30])
    errs = [r["max relative change of p"] for r in rows]
    assert errs[0] < errs[1] < errs[2]
    assert all(r["max relative change of p"] <= r["bound exp(2 max|s| u) - 1"] for r in rows)


def test_rms_norm_in_fp16_collapses_where_the_reference_norm_does_not():
    x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(0))
    x[0, 0] = 300.0  # one activation above 256: its square overflows fp16
    y16 = S.rms_norm_in(x, "fp16")
    assert (y16[0] == 0).all() and torch.isfinite(y16).all()  # silently zero, not NaN
    ref = S.rms_norm_in(x.double(), "fp32").double()
    model = RMSNorm(1024, 1e-5)(x.half()).double()
    assert ((model - ref).abs().max() / ref.abs().max()).item() < 1e-2


def test_one_pass_variance_cancels():
    x = 1000 + torch.randn(4096, generator=torch.Generator().manual_seed(0))
    v = S.variances(x, "fp32")
    assert v["error one pass"] > 1e-2 and v["error two pass"] < 1e-5
    assert v["error torch.var"] < 1e-5


def test_addition_is_not_associative_but_a_run_repeats():
    o = R.addition_orders()
    assert o["fp64 (0.1 + 0.2) + 0.3"] != o["fp64 0.1 + (0.2 + 0.3)"]
    assert o["fp32 (0.1 + 0.2) + 1.3"] != o["fp32 0.1 + (0.2 + 1.3)"]
    assert R.permuted_sums(n=50_000, orders=8)["distinct results"] > 1
    cfg = TrainConfig(steps=3, warmup_steps=1, tokenizer="bytes", batch_size=4, seq_len=32,
                      d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=64,
                      progress=False, log_every=0, eval_batches=1, device="cpu")
    first, second = R.run_to_run(cfg)
    assert first == second and len(first) == 3


def test_invariance_measurements_restore_state():
    before = torch.get_num_threads()
    rows = R.batch_invariance(batches=(1, 4), k=64, n=64)
    assert rows[0]["bitwise equal"] and rows[0]["max |difference|"] == 0
    m = R.model_batch_invariance(batches=(1, 2), seq_len=16)
    assert m[0]["bitwise equal"] and len(m) == 2
    t = R.thread_invariance(counts=(1, 2), n=1 << 16)
    assert {r["computation"] for r in t} >= {"model loss", "model logits"}
    assert torch.get_num_threads() == before
    det = R.deterministic_mode()
    assert det["enabled"] and all(math.isnan(v) for v in det["torch.empty(4)"])
    assert det["torch.empty(2, int64)"] == [2**63 - 1] * 2
    assert not torch.are_deterministic_algorithms_enabled()


def test_bad_input_says_what_to_do():
    with pytest.raises(ValueError, match=r"\(trials, n\)"):
        N.running_sum(torch.ones(5), "bf16")
    with pytest.raises(ValueError, match="record counts"):
        N.running_sum(torch.ones(1, 5), "bf16", record=[6])
    with pytest.raises(ValueError, match="unknown number format"):
        N.pairwise_sum(torch.ones(1, 5), "fp7")
    with pytest.raises(ValueError, match="chunk must divide"):
        N.accumulate(torch.ones(2, 10), torch.ones(10, 2), "fp32", chunk=3)
    with pytest.raises(ValueError, match="multiple of chunk"):
        N.accumulate(torch.ones(2, 8), torch.ones(8, 2), "fp32", chunk=4, promote_every=6)
    with pytest.raises(ValueError, match=r"\(m, k\) @ \(k, n\)"):
        N.accumulate(torch.ones(2, 8), torch.ones(4, 2), "fp32")
    with pytest.raises(ValueError, match="did not stall"):
        N.stall_point("fp32", limit=10)
    with pytest.raises(ValueError, match="threads >= 1"):
        N.torch_sum_check([10], threads=0)
    with pytest.raises(ValueError, match="dtype must be one of"):
        S.softmax_table([1.0], "fp8")
    with pytest.raises(ValueError, match="one row"):
        S.variances(torch.ones(2, 2))
    with pytest.raises(ValueError, match="runs must be >= 2"):
        R.run_to_run(TrainConfig(), runs=1)
    with pytest.raises(ValueError, match="two or more thread counts"):
        R.thread_invariance(counts=(1,))
    with pytest.raises(ValueError, match="batch sizes"):
        R.batch_invariance(batches=(0,))
