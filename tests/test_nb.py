import pytest

from trainbook import nb, train


def test_size_policy():
    assert nb.pick_size({"TRAINBOOK_SIZE": "large"}) == "large"
    assert nb.pick_size({"TRAINBOOK_SIZE": "small"}) == "small"
    assert nb.pick_size({}) in nb.SIZES
    with pytest.raises(ValueError, match="TRAINBOOK_SIZE='huge'"):
        nb.pick_size({"TRAINBOOK_SIZE": "huge"})


def test_setup_prints_device_dtype_size(capsys, monkeypatch):
    monkeypatch.setenv("TRAINBOOK_SIZE", "small")
    ctx = nb.setup(seed=3)
    out = capsys.readouterr().out
    assert "device cpu" in out and "dtype fp32" in out and "size small" in out
    assert "bf16" in out and ctx.machine in out  # the CPU's bf16 class and measured speed
    assert ctx.matmul_dtype in ("fp32", "bf16")
    assert ctx.pick(1, 2) == 1


def test_show_source_shows_the_package_code(capsys):
    nb.show_source(train.lr_at)
    out = capsys.readouterr().out
    assert "def lr_at" in out
    with pytest.raises(ValueError, match="cannot show the source"):
        nb.show_source(42)


def test_glue_takes_numpy_and_torch_scalars():
    import numpy as np
    import torch
    for value in (3, np.float64(2.5), torch.tensor(1.5)):
        nb.glue("x", value)  # no error, and nothing returned to display


def test_gpu_dtypes_follow_the_compute_capability():
    """A T4 or V100 (Colab's defaults) has no tf32 or bf16: the large size must not ask for them."""
    from trainbook.nb import gpu_matmul_dtypes

    assert gpu_matmul_dtypes((7, 5)) == ("fp32", "fp16")  # T4
    assert gpu_matmul_dtypes((7, 0)) == ("fp32", "fp16")  # V100
    assert gpu_matmul_dtypes((8, 0)) == ("fp32", "fp16", "tf32", "bf16")  # A100
    assert "fp8" in gpu_matmul_dtypes((8, 9)) and "fp8" in gpu_matmul_dtypes((9, 0))  # L4, H100
    assert "fp8" not in gpu_matmul_dtypes((9, 0), hip=True)  # MI250-class ROCm reports 9.0
    ctx = nb.setup(quiet=True)
    assert "fp32" in ctx.matmul_dtypes and ctx.matmul_dtype in ctx.matmul_dtypes + ("bf16",)
