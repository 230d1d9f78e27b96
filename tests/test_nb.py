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
