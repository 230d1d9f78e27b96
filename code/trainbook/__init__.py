"""trainbook: the package behind the executable LLM training handbook.

Chapter: book/how-to-use.
"""

from __future__ import annotations

import logging as _logging
import os as _os

__version__ = "0.1.0"

# Set to 1 to force the slow low-precision CPU path (trainbook.bench.lowp explains why). It is
# applied on import, so every process that imports trainbook obeys it: pytest, notebook kernels,
# torchrun ranks, commands. oneDNN off sends CPU bf16/fp16 matmuls to PyTorch's generic fallback,
# as on a CPU without native bf16; fp32 matmuls go through BLAS and keep their speed.
SLOW_LOWP_ENV = "TRAINBOOK_SLOW_LOWP"

if _os.environ.get(SLOW_LOWP_ENV, "").strip() not in ("", "0"):
    import torch as _torch

    _torch.backends.mkldnn.enabled = False

# bitsandbytes (imported by transformers' optimisation utilities) looks on CPUs with AVX512-BF16
# for a 4-bit kernel on the Hugging Face Hub through the optional `kernels` package, and logs a
# warning to stderr when it is absent. The book never downloads at run time, so the built-in
# fallback is the intended path; the warning would fail the book build (stderr is an error).
_logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(_logging.ERROR)
