"""Memory that is not tensors: NCCL and cuBLAS sizes as their sources define them, the optimizer
step's intermediates predicted and measured, and the per-device budget adding up."""

import inspect

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from trainbook import configs
from trainbook.bench import optimizer_memory as OM
from trainbook.compute import memory as M
from trainbook.compute import overheads as O

MiB, GiB = 2**20, 2**30


def test_nccl_constants_are_the_sources():
    assert O.NCCL_BUFFSIZE == 4194304  # NCCL docs: "The default is 4194304 (4 MiB)."
    assert O.NCCL_LL_BUFFSIZE == 512 * 1024
    assert O.NCCL_LL128_BUFFSIZE == 4_915_200


def test_nccl_buffer_bytes():
    one = 4 * MiB + 512 * 1024 + 4_915_200
    assert O.nccl_buffer_bytes(1) == one
    assert O.nccl_buffer_bytes(16, 2) == 32 * one
    assert O.nccl_buffer_bytes(1, protocols=("Simple",)) == 4 * MiB
    assert O.nccl_buffer_bytes(1, protocols=("Simple",), buffsize=MiB) == MiB
    assert O.nccl_buffer_bytes(1, protocols=("LL", "LL")) == 512 * 1024  # a set of protocols


@pytest.mark.parametrize("kw,match", [(dict(channels=0), "channels"),
                                      (dict(channels=2.0), "channels"),
                                      (dict(channels=True), "channels"),
                                      (dict(channels=1, peers=0), "peers"),
                                      (dict(channels=1, buffsize=0), "buffsize"),
                                      (dict(channels=1, protocols=("Tree",)), "protocols"),
                                      (dict(channels=1, protocols=()), "protocols")])
def test_nccl_buffer_bytes_rejects_bad_input(kw, match):
    with pytest.raises(ValueError, match=match):
        O.nccl_buffer_bytes(**kw)


def test_cublas_workspace_as_pytorch_sizes_it():
    assert O.parse_cublas_workspace_config(":4096:8") == 32 * MiB
    assert O.parse_cublas_workspace_config(":4096:2:16:8") == 8 * MiB + 128 * 1024
    assert O.cublas_workspace_bytes((9, 0)) == 32 * MiB  # Hopper
    assert O.cublas_workspace_bytes((10, 0), streams=2) == 64 * MiB  # Blackwell
    assert O.cublas_workspace_bytes((8, 0)) == 8 * MiB + 128 * 1024  # A100
    assert O.cublas_workspace_bytes((9, 0), config=":16:8") == 128 * 1024


@pytest.mark.parametrize("config", ["4096:8", ":a:8", "", ":4096", None, ":4096:8:"])
def test_cublas_workspace_config_rejects_malformed(config):
    with pytest.raises(ValueError, match="CUBLAS_WORKSPACE_CONFIG must look like"):
        O.parse_cublas_workspace_config(config)


@pytest.mark.parametrize("cap", [(9,), "9.0", (9, -1), [9, 0]])
def test_cublas_workspace_rejects_bad_capability(cap):
    with pytest.raises(ValueError, match="capability must be"):
        O.cublas_workspace_bytes(cap)


def test_optimizer_transient_bytes():
    sizes = [400, 100, 4000, 12]
    assert O.optimizer_transient_bytes(sizes, "for-loop") == 8000
    assert O.optimizer_transient_bytes(sizes, "foreach") == 4512
    assert O.optimizer_transient_bytes(sizes, "fused") == 0
    with pytest.raises(ValueError, match="implementation must be one of"):
        O.optimizer_transient_bytes(sizes, "apex")
    with pytest.raises(ValueError, match="empty"):
        O.optimizer_transient_bytes([], "foreach")
    with pytest.raises(ValueError, match="parameter bytes"):
        O.optimizer_transient_bytes([10, -1], "foreach")


@given(st.lists(st.integers(1, 10**12), min_size=1, max_size=50))
def test_optimizer_transient_order(sizes):
    loop, each = (O.optimizer_transient_bytes(sizes, i) for i in ("for-loop", "foreach"))
    assert 0 == O.optimizer_transient_bytes(sizes, "fused") < loop <= 2 * each
    assert each >= max(sizes)


def test_torch_documents_the_foreach_intermediates_and_defaults_to_the_for_loop_on_cpu():
    """The chapter quotes torch's docstring and relies on its default implementation choice."""
    from torch.optim.optimizer import _default_to_fused_or_foreach

    doc = " ".join(inspect.getdoc(torch.optim.AdamW).split())
    assert "the foreach implementation uses ~ sizeof(params) more peak memory" in doc
    assert _default_to_fused_or_foreach([torch.zeros(2)], False, False) == (False, False)


@pytest.fixture(scope="module")
def measured():
    cfg = configs.get("tiny-llama").with_(vocab_size=512, d_model=64, n_layers=2, n_heads=4,
                                          n_kv_heads=2, d_ff=128)
    return {r["implementation"]: r for r in OM.compare(cfg)}


def test_measured_transient_matches_the_prediction(measured):
    each = measured["foreach"]
    assert each["transient"] == each["predicted"] == each["param_bytes"]
    assert each["fraction"] == 1.0
    loop = measured["for-loop"]
    # MemTracker counts storage in 512-byte blocks: a scalar temporary shows as one block
    assert abs(loop["transient"] - loop["predicted"]) <= 1024
    assert loop["predicted"] == 2 * loop["largest_param_bytes"]
    if OM.fused_supported("cpu"):
        assert measured["fused"]["transient"] == 0


def test_param_bytes_are_the_models_parameters_and_their_shards():
    from trainbook.model import Transformer

    cfg = configs.get("tiny-llama")
    real = [4 * p.numel() for p in Transformer(cfg).parameters()]
    assert OM.param_bytes(cfg) == real
    assert OM.param_bytes(cfg, bytes_per_element=2) == [b // 2 for b in real]
    shards = OM.param_bytes(cfg, 8)
    assert all(s * 8 >= r for s, r in zip(shards, real)) and sum(shards) < sum(real) / 7
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="shards"):
            OM.param_bytes(cfg, bad)
    with pytest.raises(ValueError, match="ModelConfig"):
        OM.param_bytes("tiny-llama")


def test_make_adamw_rejects_unknown_implementation():
    p = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="implementation must be one of"):
        OM.make_adamw(p, "apex")
    assert OM.make_adamw(p, "foreach").defaults["foreach"] is True


def test_step_transient_rejects_a_non_config():
    with pytest.raises(ValueError, match="ModelConfig"):
        OM.step_transient("tiny-llama", "foreach")
    with pytest.raises(ValueError, match="implementations must be some of"):
        OM.compare(configs.get("tiny-llama"), ("apex",))


@pytest.fixture(scope="module")
def l8_zero3():
    return M.estimate(M.MemoryInputs(model=configs.get("llama-3-8b"), dp=8, zero=3,
                                     seq_len=8192))


def test_optimizer_phase_peak(l8_zero3):
    b = l8_zero3
    assert O.optimizer_phase_peak(b, 0) == b.peak
    huge = 100 * GiB
    assert O.optimizer_phase_peak(b, huge) == b.weights + b.grads + b.optimizer + huge
    with pytest.raises(ValueError, match="transient must be >= 0"):
        O.optimizer_phase_peak(b, -1)


def test_budget_adds_up(l8_zero3):
    rows = {r["item"]: r["GiB"] for r in O.budget(l8_zero3, "h100-sxm", headroom=0.1)}
    assert rows["capacity"] == pytest.approx(81559 / 1024)
    assert rows["tensor peak"] == pytest.approx(l8_zero3.peak / GiB)
    b = l8_zero3
    assert rows["optimizer phase"] == pytest.approx((b.weights + b.grads + b.optimizer) / GiB)
    big = O.budget(b, headroom=0.1, optimizer_transient=100 * GiB)
    assert {r["item"]: r["GiB"] for r in big}["tensor peak"] == pytest.approx(
        rows["optimizer phase"] + 100)
    assert rows["estimator margin"] == pytest.approx(M.ESTIMATE_MARGIN * rows["tensor peak"])
    fixed = rows["CUDA context"] + rows["NCCL buffers"] + rows["cuBLAS workspaces"]
    assert rows["fixed reserve"] == pytest.approx(fixed)
    assert rows["CUDA context"] == pytest.approx(O.CUDA_CONTEXT_TYPICAL_MIB[1] / 1024)
    assert rows["planner headroom"] == pytest.approx(0.1 * rows["capacity"])
    assert rows["headroom left for fragmentation"] == pytest.approx(
        rows["planner headroom"] - fixed)
    assert rows["free after all"] == pytest.approx(
        rows["capacity"] - rows["tensor peak"] - rows["estimator margin"] - fixed)


@pytest.mark.parametrize("kw,match", [(dict(headroom=1.0), "fractions"),
                                      (dict(headroom=0.1, margin=-0.1), "fractions"),
                                      (dict(headroom=0.1, context_mib=-1), "context_mib"),
                                      (dict(headroom=0.1, communicators=-1), "communicators"),
                                      (dict(headroom=0.1, gpu="h1000"), "unknown accelerator")])
def test_budget_rejects_bad_input(l8_zero3, kw, match):
    with pytest.raises(ValueError, match=match):
        O.budget(l8_zero3, **kw)


def test_fits_uses_the_estimate_margin_by_default():
    """The chapter glues ESTIMATE_MARGIN as the margin fits() applies."""
    assert inspect.signature(M.fits).parameters["margin"].default == M.ESTIMATE_MARGIN
