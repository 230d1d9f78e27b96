"""Reproducibility: what changes a result between runs, batch sizes, thread counts and machines.

Floating-point addition is not associative, so any change in the order of a sum can change its
last bits: a different kernel for a different shape (a matrix-vector product for one row, a
tiled matrix-matrix product for 64), a different split of a reduction across threads, another
GPU's tiling or split-K, another all-reduce algorithm. None of that is randomness: the same
program on the same machine and inputs repeats bit for bit. `batch_invariance` and
`thread_invariance` measure, on this CPU, whether one row's result depends on the rest of the
batch and whether results depend on the thread count; `run_to_run` trains twice with the same
seed and compares losses; `deterministic_mode` shows what torch.use_deterministic_algorithms
does on a CPU (on a GPU it also refuses non-deterministic kernels and, for cuBLAS, needs
CUBLAS_WORKSPACE_CONFIG).

Chapter: book/precision/numerics.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .. import configs
from ..launch import threads
from ..model import Transformer
from ..train import TrainConfig, train


def addition_orders() -> dict[str, float]:
    """(a + b) + c against a + (b + c): 0.1, 0.2, 0.3 in fp64 (Python floats), 0.1, 0.2, 1.3
    in fp32 (in fp32, 0.1, 0.2, 0.3 happen to give the same result both ways)."""
    t = [torch.tensor(v, dtype=torch.float32) for v in (0.1, 0.2, 1.3)]
    return {"fp64 (0.1 + 0.2) + 0.3": (0.1 + 0.2) + 0.3,
            "fp64 0.1 + (0.2 + 0.3)": 0.1 + (0.2 + 0.3),
            "fp32 (0.1 + 0.2) + 1.3": ((t[0] + t[1]) + t[2]).item(),
            "fp32 0.1 + (0.2 + 1.3)": (t[0] + (t[1] + t[2])).item()}


def permuted_sums(n: int = 100_000, orders: int = 20, seed: int = 0) -> dict[str, float]:
    """torch.sum of the same n fp32 values in `orders` random orders: how many distinct
    results, and their spread relative to the exact (fp64) sum."""
    if n < 2 or orders < 2:
        raise ValueError(f"need n >= 2 and orders >= 2, got {n}, {orders}")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    sums = torch.stack([x[torch.randperm(n, generator=g)].sum() for _ in range(orders)])
    exact = x.double().sum().item()
    return {"n": n, "orders": orders, "distinct results": len(set(sums.tolist())),
            "spread / |exact|": (sums.max() - sums.min()).item() / abs(exact)}


def _with_threads(n: int, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
    with threads(n):
        return fn()


def batch_invariance(batches: Sequence[int] = (1, 2, 8, 64), k: int = 1024, n: int = 1024,
                     seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32,
                     n_threads: int = 1) -> list[dict]:
    """Row 0 of x @ W computed in batches of each size (the same first row, other rows
    random), against the batch of one: bitwise equal or not, and the largest difference.
    On a GPU (device="cuda", dtype=torch.bfloat16) it measures the GPU's kernels; on a CPU it
    runs on `n_threads` threads."""
    if not batches or min(batches) < 1:
        raise ValueError(f"batch sizes must be >= 1, got {list(batches)}")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(max(batches), k, generator=g).to(device, dtype)
    w = torch.randn(k, n, generator=g).to(device, dtype)
    rows = []
    with threads(n_threads):
        alone = x[:1] @ w
        for b in batches:
            row = (x[:b] @ w)[:1]
            rows.append({"batch": b, "bitwise equal": torch.equal(row, alone),
                         "max |difference|": (row - alone).abs().max().item()})
    return rows


def model_batch_invariance(batches: Sequence[int] = (1, 4, 16), seq_len: int = 64,
                           model: str = "tiny-llama", seed: int = 0,
                           n_threads: int = 1) -> list[dict]:
    """The reference model's logits for sequence 0, in batches of each size, against the batch
    of one (eval mode, no gradient, on `n_threads` threads)."""
    if not batches or min(batches) < 1 or seq_len < 1:
        raise ValueError(f"need batch sizes >= 1 and seq_len >= 1, got {list(batches)}, "
                         f"{seq_len}")
    cfg = configs.get(model)
    torch.manual_seed(seed)
    net = Transformer(cfg).eval()
    idx = torch.randint(0, cfg.vocab_size, (max(batches), seq_len),
                        generator=torch.Generator().manual_seed(seed))
    with torch.no_grad(), threads(n_threads):
        alone = net(idx[:1])[0]
        rows = []
        for b in batches:
            got = net(idx[:b])[0][:1]
            rows.append({"batch": b, "tokens in the batch": b * seq_len,
                         "bitwise equal": torch.equal(got, alone),
                         "max |difference|": (got - alone).abs().max().item()})
    return rows


def thread_invariance(counts: Sequence[int] = (1, 2), n: int = 1 << 20,
                      seed: int = 0) -> list[dict]:
    """Results computed with each thread count against the first: torch.sum of n fp32 and of n
    bf16 values, an fp32 matmul, and the reference model's logits and loss (forward)."""
    if len(counts) < 2 or min(counts) < 1:
        raise ValueError(f"give two or more thread counts >= 1, got {list(counts)}")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    a, b = torch.randn(256, 512, generator=g), torch.randn(512, 256, generator=g)
    cfg = configs.get("tiny-llama")
    torch.manual_seed(seed)
    net = Transformer(cfg).eval()
    idx = torch.randint(0, cfg.vocab_size, (8, 65), generator=g)

    def model_out():
        with torch.no_grad():
            logits, loss = net(idx[:, :-1], idx[:, 1:])
        return logits, loss

    tasks: dict[str, Callable[[], torch.Tensor]] = {
        f"torch.sum, {n:,} fp32": lambda: x.sum(),
        f"torch.sum, {n:,} bf16": lambda: x.bfloat16().sum(),
        "fp32 matmul (256 x 512) @ (512 x 256)": lambda: a @ b,
        "model logits": lambda: model_out()[0],
        "model loss": lambda: model_out()[1],
    }
    rows = []
    for name, fn in tasks.items():
        results = [_with_threads(t, fn) for t in counts]
        for t, r in zip(counts[1:], results[1:]):
            rows.append({"computation": name, "threads": f"{counts[0]} vs {t}",
                         "bitwise equal": torch.equal(r, results[0]),
                         "max |difference|": (r.double() - results[0].double()).abs().max()
                         .item()})
    return rows


def run_to_run(cfg: TrainConfig, runs: int = 2, n_threads: int = 1) -> list[list[float]]:
    """Train `runs` times with the same configuration (and so the same seed) on `n_threads`
    threads; the per-step losses of each run (equal lists: the run repeats bit for bit)."""
    if runs < 2:
        raise ValueError(f"runs must be >= 2 to compare, got {runs}")
    return [_with_threads(n_threads, lambda: torch.tensor(train(cfg).losses())).tolist()
            for _ in range(runs)]


def deterministic_mode() -> dict[str, object]:
    """What torch.use_deterministic_algorithms(True) changes on a CPU: uninitialised memory
    (torch.empty) is filled with NaN for floats and the largest value for integers, so a read
    of it cannot go unnoticed (torch.utils.deterministic.fill_uninitialized_memory). The
    setting is restored afterwards."""
    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        floats = torch.empty(4)
        ints = torch.empty(2, dtype=torch.int64)
        return {"enabled": torch.are_deterministic_algorithms_enabled(),
                "torch.empty(4)": floats.tolist(), "torch.empty(2, int64)": ints.tolist(),
                "fill_uninitialized_memory":
                    torch.utils.deterministic.fill_uninitialized_memory}
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)
