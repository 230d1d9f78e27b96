"""Notebook helpers: the standard setup, the size policy, showing package source, plot style.

Size policy: every chapter runs "small" on a CPU (and in CI) and "large" on a GPU. The
environment variable TRAINBOOK_SIZE=small|large overrides the choice. On a CPU, `setup()` also
measures whether bf16 is native or emulated here (about 150x slower than fp32 when emulated;
TRAINBOOK_SLOW_LOWP=1 forces the slow path) and says so: `ctx.matmul_dtype` is the dtype that
throughput cells should measure in, and `ctx.lowp_emulated` tells cells to keep low-precision
work small.

Chapter: book/how-to-use.
"""

from __future__ import annotations

import inspect
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

SIZES = ("small", "large")
_T = TypeVar("_T")


def pick_size(env: dict | None = None) -> str:
    """'large' on a GPU, 'small' otherwise, unless TRAINBOOK_SIZE says which."""
    env = os.environ if env is None else env
    size = env.get("TRAINBOOK_SIZE", "").strip().lower()
    if size and size not in SIZES:
        raise ValueError(f"TRAINBOOK_SIZE={size!r} is not one of {SIZES}")
    return size or ("large" if torch.cuda.is_available() else "small")


@dataclass(frozen=True)
class Context:
    """What `setup()` decided: where the chapter runs and at which size."""

    device: str
    size: str
    dtype: str
    seed: int
    matmul_dtype: str = "fp32"  # the fastest matmul dtype here (measured on a CPU)
    lowp_emulated: bool = False  # bf16/fp16 run through a slow emulation on this CPU
    machine: str = ""  # what setup() found: GPU name, or CPU threads and its bf16 class
    matmul_dtypes: tuple[str, ...] = ("fp32",)  # what this device multiplies in (no emulation)

    def pick(self, small: _T, large: _T) -> _T:
        """The small or the large variant of a setting, by the size policy."""
        return small if self.size == "small" else large


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np
        np.random.seed(seed)
    except ImportError:  # numpy is optional for the package core
        pass


def gpu_matmul_dtypes(capability: tuple[int, int], hip: bool = False) -> tuple[str, ...]:
    """The matmul dtypes a GPU of this compute capability runs natively: fp16 tensor cores from
    Volta (7.0), tf32 and bf16 from Ampere (8.0), fp8 from Ada/Hopper (8.9). A T4 (7.5) or V100
    (7.0) has neither tf32 nor bf16: asking for them fails or emulates. ROCm: MI200/MI300 have
    all but fp8 below gfx942, which reports 9.4."""
    out = ["fp32"]
    if hip or capability >= (7, 0):
        out.append("fp16")
    if hip or capability >= (8, 0):
        out += ["tf32", "bf16"]
    if capability >= (8, 9) and not (hip and capability < (9, 4)):
        out.append("fp8")
    return tuple(out)


def setup(seed: int = 0, quiet: bool = False) -> Context:
    """Seed everything, choose the size, apply the plot style, print device/dtype/size."""
    seed_everything(seed)
    size = pick_size()
    if torch.cuda.is_available():
        device = "cuda"
        try:  # a T4 "supports" bf16 only by emulation: use fp16 there
            native_bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
        except TypeError:  # torch < 2.3 has no including_emulation
            native_bf16 = torch.cuda.is_bf16_supported()
        dtype = "bf16" if native_bf16 else "fp16"
        where = torch.cuda.get_device_name(0)
        matmul_dtype, emulated = dtype, False
        dtypes = gpu_matmul_dtypes(torch.cuda.get_device_capability(0),
                                   hip=torch.version.hip is not None)
    else:
        from .bench import lowp

        device, dtype = "cpu", "fp32"
        lp = lowp.probe()
        matmul_dtype, emulated = lp.fastest, lp.emulated("bf16")
        where = f"CPU, {torch.get_num_threads()} threads, {lp.describe()}"
        dtypes = ("fp32",) if emulated else ("fp32", "bf16", "fp16")
    plot_style()
    if not quiet:
        print(f"trainbook: device {device} ({where}), dtype {dtype}, size {size}, "
              f"seed {seed}, torch {torch.__version__}")
        if emulated:
            print("trainbook: bf16/fp16 are emulated on this CPU: low-precision cells use small "
                  f"shapes, and throughput cells measure in {matmul_dtype}")
    return Context(device, size, dtype, seed, matmul_dtype, emulated, where, dtypes)


def show_source(obj: Callable[..., object]) -> None:
    """Display the package's own source of a function or class (never a second copy)."""
    try:
        src = inspect.getsource(obj)
    except (TypeError, OSError) as e:
        raise ValueError(f"cannot show the source of {obj!r}: {e}") from None
    title = f"{getattr(inspect.getmodule(obj), '__name__', '?')}.{obj.__qualname__}"
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display
    except ImportError:
        get_ipython = lambda: None  # noqa: E731
    if get_ipython() is None:  # a plain Python process: print it
        print(f"# {title}\n{src}")
    else:
        display(Markdown(f"`{title}`\n\n```python\n{src}```"))


def glue(name: str, value: Any, display: bool = False) -> None:
    """myst-nb glue when building the book; a no-op elsewhere (Colab needs no myst-nb).

    numpy and torch scalars become Python numbers, so `{glue:text}`name:.2f`` can format them.
    """
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        value = value.item()
    try:
        from myst_nb import glue as _glue
    except ImportError:
        return
    _glue(name, value, display=display)


def plot_style() -> None:
    """One plot style for the book: readable at page width, grid on, no top/right spines."""
    try:
        import matplotlib as mpl
    except ImportError:
        return
    mpl.rcParams.update({
        "figure.figsize": (7, 3.6), "figure.dpi": 110, "axes.grid": True, "grid.alpha": 0.3,
        "axes.spines.top": False, "axes.spines.right": False, "font.size": 10,
        "legend.frameon": False,
    })
