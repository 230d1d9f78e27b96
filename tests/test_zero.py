import pytest
import torch

from trainbook import launch
from trainbook.parallel import harness, zero

TORCH = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])

# The memory experiment: a model whose states (16 bytes per parameter with fp32 AdamW) dwarf the
# activations of one sequence per rank, so the stages' differences are visible.
MEM = harness.Setup(d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=768, seq_len=32,
                    global_batch=2, steps=1, optimizer="adamw")
GPT2 = harness.Setup(flavour="gpt2", n_kv_heads=4, optimizer="adamw", steps=2)  # tied embeddings
MEM_KINDS = ("ddp", "zero1", "zero2", "zero3", "zero_redundancy_optimizer", "fsdp2")
VARIANTS = {k: zero.ZeroRun(kind=k) for k in zero.KINDS} | {
    "fsdp2 no reshard": zero.ZeroRun(kind="fsdp2", reshard_after_forward=False),
    "fsdp2 reshard to 2": zero.ZeroRun(kind="fsdp2", reshard_after_forward=2),
    "fsdp2 bf16": zero.ZeroRun(kind="fsdp2", mixed_precision=True)}


@pytest.fixture(scope="module")
def trained():
    s = harness.Setup()
    ranks = launch.run(harness.sweep, 2, args=(s, VARIANTS), timeout_s=240)
    return s, harness.reference(s), ranks


@pytest.fixture(scope="module")
def memory():
    variants = {k: zero.ZeroRun(kind=k, measure_memory=True) for k in MEM_KINDS}
    variants |= {"gpt2 zero3": zero.ZeroRun(kind="zero3", setup=GPT2),
                 "workspace": zero.workspace_probe(2**16)}
    return launch.run(harness.sweep, 2, args=(MEM, variants), timeout_s=240)


def test_every_kind_matches_single_process(trained):
    s, ref, ranks = trained
    for r in ranks:
        for v, out in r.value.items():
            d = harness.max_differences(out.trace, ref)
            if v == "fsdp2 bf16":
                # bf16 parameters in forward and backward: 8 significant bits, so gradients
                # differ by ~1e-3 relative; fp32 reduction and an fp32 master copy keep the
                # parameters within a few 1e-5 after three SGD steps
                assert d["loss"] < 1e-3 and d["grad"] < 1e-2 and d["param"] < 1e-4, (v, d)
            else:  # SGD: exact up to the order of fp32 additions
                assert d["loss"] < 1e-5 and d["grad"] < 1e-6 and d["param"] < 1e-6, (v, d)


def test_adamw_and_tied_gpt2_match_within_fp32_tolerance(memory):
    ref = harness.reference(MEM)
    runs = memory[0].value  # trained with AdamW
    for out, r in ((runs["zero1"], ref), (runs["zero3"], ref),
                   (runs["gpt2 zero3"], harness.reference(GPT2))):
        d = harness.max_differences(out.trace, r)
        # Adam divides by sqrt(v) ~ |g| early on, so a parameter whose gradient is ~1e-6 moves by
        # lr x (relative gradient error): gradients must be exact, parameters only close (lr 1e-2)
        assert d["grad"] < 1e-6 and d["param"] < 1e-3, d


def test_communication_volume_2psi_vs_3psi(trained):
    s, _, ranks = trained
    psi = 4 * sum(p.numel() for p in harness.build_model(s).parameters())  # fp32 bytes, even units
    out = {name: zero.paper_bytes(o) for name, o in ranks[0].value.items()}
    for kind in ("zero1", "zero2", "zero3"):
        c, seen = ranks[0].value[kind]["counters"], out[kind]
        # the stages' own counters and the dispatcher-level counter agree, byte for byte
        assert c["reduce_scatter"] == seen["reduce_scatter"] == psi
        assert c["all_gather"] == seen["all_gather"] == (2 if kind == "zero3" else 1) * psi
        assert seen.get("all_reduce", 0) == 0
    # DDP: one all-reduce = 2 Psi (plus its small buffer broadcasts); ZeroRedundancyOptimizer
    # adds a broadcast of every parameter after the step: 3 Psi
    assert out["ddp"]["all_reduce"] == 2 * psi
    assert out["ddp"].get("broadcast", 0) < 0.01 * psi
    zro = out["zero_redundancy_optimizer"]
    assert zro["all_reduce"] == 2 * psi and psi <= zro["broadcast"] < 1.01 * psi
    # FSDP2 keeps the root gathered; re-sharding the blocks after forward costs a second
    # all-gather of every block in backward; bf16 parameters halve the all-gathers
    root = 4 * sum(p.numel() for n, p in harness.build_model(s).named_parameters()
                   if not n.startswith("blocks."))
    fsdp, keep, mp = out["fsdp2"], out["fsdp2 no reshard"], out["fsdp2 bf16"]
    assert keep["all_gather"] == psi
    assert fsdp["all_gather"] == 2 * psi - root
    assert mp["all_gather"] == (2 * psi - root) / 2
    assert fsdp["reduce_scatter"] == keep["reduce_scatter"] == psi
    assert zero.calls_per_step(ranks[0].value["fsdp2"], "all_gather") == 1 + 2 * s.n_layers
    assert zero.wire_bytes(psi, 2) == psi / 2


def test_zero_redundancy_optimizer_shards_whole_parameters(trained):
    s, _, ranks = trained
    sizes = [r.value["zero_redundancy_optimizer"]["shard_numel"] for r in ranks]
    total = sum(p.numel() for p in harness.build_model(s).parameters())
    assert sum(sizes) == total and sizes[0] != sizes[1]  # uneven: whole tensors per rank


def test_memory_ordering_and_estimator(memory):
    block = 4 * sum(p.numel() for p in harness.build_model(MEM).blocks[0].parameters())
    for r in memory:
        peak = {k: r.value[k].memory["peak"] for k in MEM_KINDS}
        assert peak["ddp"] > peak["zero1"] > peak["zero2"] > peak["zero3"]
        assert peak["zero_redundancy_optimizer"] < peak["ddp"] and peak["fsdp2"] < peak["zero1"]
        for kind in MEM_KINDS:
            est = zero.estimate_rank(MEM, kind).peak
            # the estimator is idealised: it holds no working space for reducing one unit's
            # gradients, which a real step needs: the unit's flat gradient, gloo's copy of it
            # inside reduce-scatter (measured below) and the output shard; and DDP's gradient
            # buckets outlive the step, so its activations meet all its gradients (~1 block
            # here). So the measurement lies above the estimate by at most three fp32 gradients
            # of one block.
            # torch 2.12's FSDP2 holds one more block-sized buffer (measured: 3.2 blocks over;
            # data/torch-floor/): the floor version gets one block more
            slack = 4 if kind == "fsdp2" and TORCH < (2, 13) else 3
            assert 0 <= peak[kind] - est <= slack * block, (kind, peak[kind], est, block)
        workspace = r.value["workspace"]
        assert workspace["reduce_scatter"] == pytest.approx(1.0)  # gloo copies the input
        assert workspace["all_gather"] == pytest.approx(0.0)


def test_bad_input():
    s = harness.Setup()
    with pytest.raises(ValueError, match="ZeRO stage must be 1, 2 or 3"):
        zero.ZeRO(harness.build_model(s), 4, None)
    with pytest.raises(ValueError, match="needs a process group"):
        zero.ZeRO(harness.build_model(s), 2, None)
    with pytest.raises(ValueError, match="kind 'zero4' is unknown"):
        zero.estimate_rank(s, "zero4")
    with pytest.raises(ValueError, match="kind 'ddp2' is unknown"):
        zero.ZeroRun(kind="ddp2")
    with pytest.raises(ValueError, match="mixed_precision applies to kind 'fsdp2' only"):
        zero.ZeroRun(kind="zero3", mixed_precision=True)
    with pytest.raises(ValueError, match="ZeroRun runs inside a process group"):
        harness.run(s, zero.ZeroRun())
    with pytest.raises(ValueError, match="not divisible by 3 ranks"):
        zero.estimate_rank(s, "zero1", world=3)
    with pytest.raises(ValueError, match="reshard_after_forward applies to kind 'fsdp2' only"):
        zero.ZeroRun(kind="zero2", reshard_after_forward=False)


def test_wire_bytes_is_the_all_gather_bus_factor():
    assert zero.wire_bytes(1000.0, 4) == 750.0
    assert zero.wire_bytes(1000.0, 1) == 0.0
    with pytest.raises(ValueError, match="n must be a whole number >= 1"):
        zero.wire_bytes(1000.0, 0)
