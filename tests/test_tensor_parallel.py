import dataclasses

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from trainbook import launch
from trainbook.parallel import harness, tp_comm, vocab_parallel
from trainbook.parallel import tensor_parallel as tp


def _key(row):
    return row["op"], row["phase"], row["where"]


def test_llama_every_kind_matches_reference_and_theory():
    s = harness.Setup()  # llama, 4 heads, 2 kv heads: GQA split over 2 ranks
    ref = harness.reference(s)
    variants = {k: tp.TensorParallelRun(kind=k) for k in tp.KINDS}
    variants["unshared"] = tp.TensorParallelRun(kind="dtensor", shared_input=False)
    ranks = launch.run(harness.sweep, 2, args=(s, variants), timeout_s=180)
    for r in ranks:
        for v, out in r.value.items():
            d = harness.max_differences(out.trace, ref)
            assert d["loss"] < 1e-5 and d["grad"] < 1e-6 and d["param"] < 1e-6, (v, d)
    outs = ranks[0].value
    cfg = s.model_config()
    for kind in ("scratch", "scratch_sp"):  # every collective counted, as theory says
        out, sp = outs[kind], kind.endswith("_sp")
        measured = {_key(r): (r["calls"], r["bytes"]) for r in out["counts"]}
        theory = {_key(r): (r["calls"], r["bytes"])
                  for r in tp.theory_counts(cfg, sp, s.global_batch, s.seq_len)}
        extra = measured.keys() - theory.keys()
        assert extra == ({("all_reduce", "backward", "grads")} if sp else set())
        assert {k: measured[k] for k in theory} == theory
        block = [r for r in out["counts"] if r["where"] == "block"]
        # per layer: 2 all-reduces forward + 2 backward; SP: an all-gather + reduce-scatter each
        assert sum(r["calls"] for r in block) == (8 if sp else 4) * cfg.n_layers
    # SP swaps each all-reduce for a reduce-scatter + all-gather pair of the same total volume
    by = lambda out, ops: sum(r["bytes"] for r in out["counts"] if r["where"] == "block" and r["op"] in ops)  # noqa
    scratch, scratch_sp = outs["scratch"], outs["scratch_sp"]
    ar, pairs = by(scratch, {"all_reduce"}), by(scratch_sp, {"all_gather", "reduce_scatter"})
    assert pairs == 2 * ar
    assert sum(tp_comm.wire_bytes(r["op"], r["bytes"], 2)
               for r in scratch["counts"] if r["where"] == "block") == \
        sum(tp_comm.wire_bytes(r["op"], r["bytes"], 2)
            for r in scratch_sp["counts"] if r["where"] == "block")
    seen = {k: out.calls["forward_backward"] for k, out in outs.items()}
    # DTensor issues the same collectives (shared q/k/v input); unshared pays one per Colwise layer
    assert seen["dtensor"] == seen["scratch"] == {"all_reduce": 13}
    # Comm misses nothing the dispatcher-level counter sees
    assert sum(r["calls"] for r in scratch["counts"]) == 13
    assert seen["dtensor_sp"]["all_gather"] == seen["scratch_sp"]["all_gather"] == 10
    # (q, k, v) 3 + (gate, up) 2 vs 2
    assert seen["unshared"]["all_reduce"] == 13 + 3 * cfg.n_layers
    # SP norm weights: scratch sums their gradients in backward; DTensor leaves them Partial and
    # reduces each one in the optimizer step
    assert not outs["scratch_sp"].calls["optimizer"]
    assert outs["dtensor_sp"].calls["optimizer"] == {"all_reduce": 2 * cfg.n_layers + 1}


def test_gpt2_tied_sequence_parallel_adamw_and_memory():
    s = harness.Setup(flavour="gpt2", n_kv_heads=4, optimizer="adamw")
    ref = harness.reference(s)
    variants = {"scratch_sp": tp.TensorParallelRun(kind="scratch_sp", measure_memory=True),
                "dtensor_sp": tp.TensorParallelRun(kind="dtensor_sp")}
    outs = launch.run(harness.sweep, 2, args=(s, variants), timeout_s=180)[0].value
    for name, out in outs.items():
        d = harness.max_differences(out.trace, ref)
        assert d["loss"] < 1e-5 and d["grad"] < 1e-6 and d["param"] < 1e-4, (name, d)
    est = tp.estimate_memory(s, 2, True)
    mem = outs["scratch_sp"].memory
    # V/tp embedding rows, replicated norms
    assert mem["weights"] == pytest.approx(est.weights, rel=0.02)
    assert mem["optimizer"] == pytest.approx(est.optimizer, rel=0.02)
    assert 0.7 < mem["peak"] / est.peak < 1.5


@settings(deadline=None, max_examples=40)
@given(n=st.integers(1, 12), shards=st.sampled_from([1, 2, 4, 8]), width=st.integers(1, 5),
       scale=st.floats(0.1, 30.0), seed=st.integers(0, 2**16))
def test_vocab_parallel_cross_entropy_equals_full(n, shards, width, scale, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, shards * width, generator=g, dtype=torch.float64) * scale
    targets = torch.randint(0, shards * width, (n,), generator=g)
    got = vocab_parallel.emulate_vocab_parallel_cross_entropy(logits.float(), targets, shards)
    assert got.item() == pytest.approx(F.cross_entropy(logits, targets).item(), rel=1e-5, abs=1e-5)


def test_distributed_vocab_parallel_loss_and_gradient():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(24, 256, generator=g) * 5
    targets = torch.randint(0, 256, (24,), generator=g)
    full = logits.clone().requires_grad_()
    F.cross_entropy(full, targets).backward()
    ranks = launch.run(vocab_parallel.cross_entropy_rank, 2, args=(logits, targets), timeout_s=60)
    for r in ranks:
        assert r.value[0] == pytest.approx(F.cross_entropy(logits, targets).item(), rel=1e-6)
    grad = torch.cat([r.value[1] for r in ranks], dim=-1)
    assert (grad - full.grad).abs().max() < 1e-7


def test_bad_input():
    cfg = harness.Setup().model_config()  # 4 heads, 2 kv heads, d_ff 128, vocab 256
    with pytest.raises(ValueError, match="tp 3 does not divide the 4 attention heads"):
        tp.check_divisible(cfg, 3)
    with pytest.raises(ValueError, match="tp 4 does not divide the 2 key/value heads"):
        tp.check_divisible(cfg, 4)
    wide = dataclasses.replace(cfg, n_kv_heads=4)
    with pytest.raises(ValueError, match="tp 4 does not divide the 130 MLP hidden size"):
        tp.check_divisible(dataclasses.replace(wide, d_ff=130), 4)
    with pytest.raises(ValueError, match="tp 4 does not divide the 250 vocabulary size"):
        tp.check_divisible(dataclasses.replace(wide, vocab_size=250), 4)
    with pytest.raises(ValueError, match="does not divide seq_len 31"):
        tp.check_divisible(cfg, 2, seq_len=31, sp=True)
    tp.check_divisible(cfg, 2, seq_len=31, sp=False)  # plain TP does not split the sequence
    with pytest.raises(ValueError, match="V divisible by tp 3"):
        vocab_parallel.emulate_vocab_parallel_cross_entropy(
            torch.zeros(2, 8), torch.zeros(2, dtype=torch.long), 3)
    with pytest.raises(ValueError, match="needs a process group"):
        harness.run(harness.Setup(), tp.TensorParallelRun())
    with pytest.raises(ValueError, match="kind must be one of"):
        tp.TensorParallelRun(kind="zero")
    with pytest.raises(RuntimeError, match="tp 2 does not divide seq_len 31"):
        launch.run(harness.run, 2, timeout_s=60, args=(
            harness.Setup(seq_len=31), tp.TensorParallelRun(kind="scratch_sp")))


def test_wire_bytes_is_the_bus_factor():
    from trainbook.bench.collectives import bus_factor
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        assert tp_comm.wire_bytes(op, 1000.0, 8) == bus_factor(op, 8) * 1000.0
    assert tp_comm.wire_bytes("all_reduce", 1000.0, 4) == 1500.0
    with pytest.raises(ValueError, match="unknown collective"):
        tp_comm.wire_bytes("allreduce", 1000.0, 4)
