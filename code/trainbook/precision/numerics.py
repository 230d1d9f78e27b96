"""Accumulation: how a sum loses what it adds, and the four ways to keep it.

Every matmul, reduction, norm and gradient all-reduce is a long sum. In a floating-point format
with unit roundoff u (half its eps), each addition rounds: fl(a + b) = (a + b)(1 + d), |d| <= u.
Added one after another into an accumulator of the same format (`running_sum`, "naive"), the
errors pile up to at most (n - 1) u sum|x_i| (Higham 2002, Section 4.2), and once the
accumulator is 2^(m+1) times larger than what it adds, the addends round away entirely: a bf16
count stalls at 256, an fp16 one at 2048. Pairwise summation adds in a tree (error bound
ceil(log2 n) u sum|x_i|), Kahan's compensated summation carries each addition's rounding error
into the next (2u + O(n u^2), Section 4.3), and a wider accumulator (fp32 for bf16 inputs, as
tensor cores and PyTorch's reductions do) shrinks u itself. `sum_errors` measures the four
against n next to those bounds; `torch_sum_check` measures what `torch.sum` does with bf16 on
this CPU; `accumulate` emulates a matmul's accumulator of any precision, rounding or chopping,
with DeepSeek-V3's promotion of partial sums to fp32 every 128 products.

Sums in bf16 and fp16 (given by name) run in the dtype itself: torch rounds every bf16/fp16
addition correctly (it adds in fp32, and fp32 has at least 2p + 2 bits for p = 8 and p = 11, so
rounding twice equals rounding once). Other accumulator formats go through
`trainbook.formats.quantize`.

Chapter: book/precision/numerics.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch

from .. import formats as F
from ..bench.matmul import metadata
from ..launch import threads as n_threads

METHODS = ("naive", "pairwise", "kahan", "fp32 accumulator")
NATIVE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def unit_roundoff(fmt: str | F.FloatFormat) -> float:
    """u = eps / 2 = 2^-(m+1): the largest relative error of one rounding to nearest."""
    return F.get(fmt).eps / 2


def _rounder(fmt: str | F.FloatFormat, truncate: bool = False):
    """x (float64) -> x rounded to fmt, in float64."""
    f = F.get(fmt)
    return lambda x: F.quantize(x, f, overflow="saturate", truncate=truncate)


def _check_values(x: torch.Tensor) -> torch.Tensor:
    if not torch.is_floating_point(x) or x.dim() != 2 or x.shape[1] < 1:
        raise ValueError(f"x must be a floating-point (trials, n) tensor with n >= 1, got "
                         f"{x.dtype} of shape {tuple(x.shape)}")
    return x


def running_sum(x: torch.Tensor, fmt: str | F.FloatFormat,
                record: Sequence[int] | None = None) -> torch.Tensor:
    """Sum each row of x (trials, n) left to right in an accumulator of `fmt`, every addend and
    every partial sum rounded to fmt. Returns (trials, len(record)) partial sums after the
    first n_j values for each n_j of `record` (default: [n]), as float64."""
    x = _check_values(x)
    record = sorted(record or [x.shape[1]])
    if record[0] < 1 or record[-1] > x.shape[1]:
        raise ValueError(f"record counts must be in [1, {x.shape[1]}], got {record}")
    out = []
    if fmt in NATIVE:
        xs = x.to(NATIVE[fmt])
        acc = torch.zeros(x.shape[0], dtype=xs.dtype)
        add = lambda a, b: a + b  # noqa: E731 (torch rounds each addition to the dtype)
    else:
        rnd = _rounder(fmt)
        xs = rnd(x.double())
        acc = torch.zeros(x.shape[0], dtype=torch.float64)
        add = lambda a, b: rnd(a + b)  # noqa: E731
    want = set(record)
    for i in range(record[-1]):
        acc = add(acc, xs[:, i])
        if i + 1 in want:
            out.append(acc.double())
    return torch.stack(out, dim=1)


def pairwise_sum(x: torch.Tensor, fmt: str | F.FloatFormat) -> torch.Tensor:
    """Sum each row of x (trials, n) as a balanced tree, each partial sum rounded to fmt:
    log2 n levels of additions, so a value passes through at most ceil(log2 n) roundings."""
    x = _check_values(x)
    if fmt in NATIVE:
        xs = x.to(NATIVE[fmt])
        add = lambda a, b: a + b  # noqa: E731
    else:
        rnd = _rounder(fmt)
        xs = rnd(x.double())
        add = lambda a, b: rnd(a + b)  # noqa: E731
    while xs.shape[1] > 1:
        if xs.shape[1] % 2:
            xs = torch.cat([xs, torch.zeros_like(xs[:, :1])], dim=1)
        xs = add(xs[:, 0::2], xs[:, 1::2])
    return xs[:, 0].double()


def kahan_sum(x: torch.Tensor, fmt: str | F.FloatFormat) -> torch.Tensor:
    """Kahan's compensated summation, every operation in fmt: c holds the rounding error of
    the last addition (what (t - s) - y recovers exactly in binary floating point) and is
    subtracted from the next addend, so the error stays near 2u whatever n is."""
    x = _check_values(x)
    if fmt in NATIVE:
        xs = x.to(NATIVE[fmt])
        r = lambda v: v  # noqa: E731
    else:
        rnd = _rounder(fmt)
        xs, r = rnd(x.double()), rnd
    s = torch.zeros_like(xs[:, 0])
    c = torch.zeros_like(s)
    for i in range(xs.shape[1]):
        y = r(xs[:, i] - c)
        t = r(s + y)
        c = r(r(t - s) - y)
        s = t
    return s.double()


def fp32_accumulated_sum(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Addends rounded to fmt, added left to right in an fp32 accumulator, the result rounded to
    fmt once at the end: what a reduction or a tensor core with an fp32 accumulator does."""
    x = _check_values(x)
    xs = F.quantize(x.double(), fmt).float()
    acc = torch.zeros(x.shape[0], dtype=torch.float32)
    for i in range(xs.shape[1]):
        acc = acc + xs[:, i]
    return F.quantize(acc.double(), fmt)


def error_bounds(n: int, fmt: str) -> dict[str, float]:
    """First-order worst-case bounds on |computed - exact| / sum|x_i| (Higham 2002, Chapter 4):
    left to right (n - 1) u, pairwise ceil(log2 n) u, Kahan 2u + n u^2; with an fp32
    accumulator, (n - 1) u_fp32 plus the final rounding to fmt, u."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    u, u32 = unit_roundoff(fmt), unit_roundoff("fp32")
    return {"naive": (n - 1) * u, "pairwise": math.ceil(math.log2(n)) * u if n > 1 else 0.0,
            "kahan": 2 * u + n * u * u, "fp32 accumulator": (n - 1) * u32 + u}


def sum_errors(ns: Sequence[int], fmt: str = "bf16", trials: int = 8, seed: int = 0,
               low: float = 0.0, high: float = 1.0) -> list[dict]:
    """|computed - exact| / sum|x_i| for each method and each n, on `trials` rows of n values
    drawn uniformly from [low, high) and rounded to fmt (the exact sum of the rounded values
    in float64): the mean and the worst over trials, beside the bound of `error_bounds`."""
    ns = sorted(set(ns))
    if not ns or ns[0] < 1 or trials < 1:
        raise ValueError(f"need n >= 1 and trials >= 1, got ns={ns}, trials={trials}")
    g = torch.Generator().manual_seed(seed)
    x = F.quantize(low + (high - low) * torch.rand(trials, ns[-1], generator=g,
                                                   dtype=torch.float64), fmt)
    naive = running_sum(x, fmt, record=ns)
    rows = []
    for j, n in enumerate(ns):
        xn = x[:, :n]
        exact, size = xn.sum(1), xn.abs().sum(1)
        got = {"naive": naive[:, j], "pairwise": pairwise_sum(xn, fmt),
               "kahan": kahan_sum(xn, fmt), "fp32 accumulator": fp32_accumulated_sum(xn, fmt)}
        bounds = error_bounds(n, fmt)
        for method in METHODS:
            err = (got[method] - exact).abs() / size
            rows.append({"n": n, "method": method, "error": err.mean().item(),
                         "worst": err.max().item(), "bound": bounds[method]})
    return rows


def stall_point(fmt: str | F.FloatFormat, step: float = 1.0, limit: int = 1 << 20) -> float:
    """Where a running sum of `step`s in fmt stops growing: the first total t with
    fl(t + step) == t (for 1.0: 2^(m+1), 256 in bf16 and 2048 in fp16)."""
    if step <= 0 or limit < 1:
        raise ValueError(f"need step > 0 and limit >= 1, got {step}, {limit}")
    dt = NATIVE.get(fmt) if isinstance(fmt, str) else None
    rnd = (lambda v: v) if dt else _rounder(fmt)
    s = torch.zeros((), dtype=dt or torch.float64)
    one = rnd(torch.tensor(step, dtype=dt or torch.float64))
    for _ in range(limit):
        nxt = rnd(s + one)
        if nxt == s:
            return s.item()
        s = nxt
    raise ValueError(f"the sum of {step} in {fmt} did not stall within {limit} additions")


def torch_sum_check(ns: Sequence[int], threads: int = 1, trials: int = 10,
                    seed: int = 0) -> list[dict]:
    """What torch.sum of a bf16 tensor returns on this CPU with `threads` threads: for each n,
    over `trials` Gaussian vectors, how often it equals the exact sum rounded once to bf16 (an
    fp32 accumulator would nearly always), and the worst error in units of bf16's spacing at
    the result. The thread count is restored afterwards."""
    if threads < 1 or trials < 1 or not ns or min(ns) < 1:
        raise ValueError(f"need threads >= 1, trials >= 1 and sizes >= 1, got {threads}, "
                         f"{trials}, {list(ns)}")
    g = torch.Generator().manual_seed(seed)
    rows = []
    with n_threads(threads):
        for n in ns:
            same, worst = 0, 0.0
            for _ in range(trials):
                x = torch.randn(n, generator=g).bfloat16()
                got = x.sum().double()
                exact = x.double().sum()
                same += int(got == F.quantize(exact.reshape(1), "bf16")[0])
                gap = F.quantize(exact.abs().reshape(1), "bf16")[0].clamp(min=1e-30)
                worst = max(worst, ((got - exact).abs() / (gap * 2.0 ** -7)).item())
            rows.append({"n": n, "threads": threads, "correctly rounded": same / trials,
                         "worst error (bf16 spacings)": worst})
    return rows


def fp32_sum_methods(n: int = 1 << 22, seed: int = 0) -> dict[str, float]:
    """Relative errors of summing n uniform [0, 1) fp32 values: left to right in fp32
    (numpy.cumsum, sequential by definition), numpy.sum (pairwise, as numpy documents) and
    torch.sum (whatever this build does), against the fp64 sum."""
    import numpy as np

    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    x = torch.rand(n, generator=torch.Generator().manual_seed(seed))
    xn = x.numpy()
    exact = float(np.sum(xn, dtype=np.float64))
    return {"n": n,
            "left to right (numpy.cumsum)": abs(float(np.cumsum(xn, dtype=np.float32)[-1])
                                                - exact) / exact,
            "numpy.sum (pairwise)": abs(float(np.sum(xn)) - exact) / exact,
            "torch.sum": abs(x.sum().item() - exact) / exact,
            "(n - 1) u": (n - 1) * unit_roundoff("fp32")}


def bf16_matmul_check(m: int = 16, k: int = 4096, n: int = 16, seed: int = 0) -> dict[str, float]:
    """torch's own bf16 matmul on this machine against the exact product of the same bf16
    inputs rounded once to bf16: the largest difference in units of bf16's spacing at each
    result. Below one, the sum was accumulated in a wider format and rounded at the end; a bf16
    accumulator (`accumulate(..., "bf16")`) is off by many spacings at this k."""
    if min(m, k, n) < 1:
        raise ValueError(f"matrix dimensions must be >= 1, got {m}, {k}, {n}")
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g).bfloat16()
    b = torch.randn(k, n, generator=g).bfloat16()
    exact = a.double() @ b.double()
    gap = F.quantize(exact.abs(), "bf16").clamp(min=1e-30) * 2.0 ** -7

    def spacings(c: torch.Tensor) -> float:
        return ((c.double() - exact).abs() / gap).max().item()

    return {"k": k, "torch bf16 matmul": spacings(a @ b),
            "exact, rounded once": spacings(F.quantize(exact, "bf16")),
            "bf16 accumulator": spacings(accumulate(a.double(), b.double(), "bf16"))}


def accumulate(a: torch.Tensor, b: torch.Tensor, acc: str | F.FloatFormat,
               chunk: int = 1, truncate: bool = False,
               promote_every: int | None = None) -> torch.Tensor:
    """a @ b (float64 result) as a matmul unit with a limited accumulator computes it: the
    products a_ik b_kj exact, summed `chunk` at a time (exactly) into an accumulator in format
    `acc` that rounds (or, with `truncate`, chops) after every addition. With `promote_every`
    (a multiple of chunk), the accumulator is added into an fp32 sum and cleared every that many
    products: DeepSeek-V3's promotion to CUDA cores (Section 3.3.2, every 128 elements)."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"need (m, k) @ (k, n), got {tuple(a.shape)} and {tuple(b.shape)}")
    K = a.shape[1]
    if chunk < 1 or K % chunk:
        raise ValueError(f"chunk must divide k = {K}, got {chunk}")
    if promote_every is not None and (promote_every < chunk or promote_every % chunk):
        raise ValueError(f"promote_every must be a multiple of chunk ({chunk}), got "
                         f"{promote_every}")
    rnd = _rounder(acc, truncate)
    to_fp32 = _rounder("fp32")
    ad, bd = a.double(), b.double()
    s = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float64)
    total = torch.zeros_like(s)
    for k in range(0, K, chunk):
        s = rnd(s + ad[:, k:k + chunk] @ bd[k:k + chunk])  # the chunk's sum: exact here
        if promote_every and (k + chunk) % promote_every == 0:
            total, s = to_fp32(total + s), torch.zeros_like(s)
    return to_fp32(total + s)


def accumulation_errors(k: int = 4096, m: int = 32, n: int = 32, inputs: str = "fp8_e4m3",
                        cases: dict[str, dict] | None = None, seed: int = 0) -> list[dict]:
    """Relative error ||C - C_exact|| / ||C_exact|| (Frobenius) of a (m, k) @ (k, n) product of
    Gaussian matrices rounded to `inputs` (8-bit and narrower formats: scaled first so that the
    largest entry is the format's max, as FP8 recipes do), for each accumulator case (keyword
    arguments of `accumulate`; default `ACCUMULATORS`). C_exact is the exact product of the
    rounded inputs, so the error is the accumulator's alone."""
    cases = cases or ACCUMULATORS
    if min(k, m, n) < 1:
        raise ValueError(f"matrix dimensions must be >= 1, got k={k}, m={m}, n={n}")
    g = torch.Generator().manual_seed(seed)
    f = F.get(inputs)
    a = torch.randn(m, k, generator=g, dtype=torch.float64)
    b = torch.randn(k, n, generator=g, dtype=torch.float64)
    if f.bits <= 8:
        a, b = a * (f.max / a.abs().max()), b * (f.max / b.abs().max())
    a, b = F.quantize(a, f), F.quantize(b, f)
    exact = a @ b
    rows = []
    for name, kw in cases.items():
        c = accumulate(a, b, **kw)
        rows.append({"accumulator": name, "k": k,
                     "relative error": ((c - exact).norm() / exact.norm()).item()})
    return rows


E8M13 = F.FloatFormat("e8m13", 8, 13)  # 14 significant bits: "around 14 bits" (DeepSeek-V3)
BF16_ACCUMULATORS: dict[str, dict] = {"fp32": {"acc": "fp32"}, "bf16": {"acc": "bf16"}}
ACCUMULATORS: dict[str, dict] = {  # for FP8 inputs (products up to 448^2: beyond fp16)
    "fp32": {"acc": "fp32"},
    "bf16": {"acc": "bf16"},
    "14 bits, chopped, one product at a time": {"acc": E8M13, "truncate": True},
    "14 bits, chopped, 32 products at a time": {"acc": E8M13, "truncate": True, "chunk": 32},
    "14 bits, chopped, 32 at a time, promoted every 128": {
        "acc": E8M13, "truncate": True, "chunk": 32, "promote_every": 128},
}

SWEEP_KS = (64, 256, 1024, 4096, 16384)
SWEEP_COMMAND = ("python -c \"from trainbook.precision import numerics; "
                 "numerics.write_accumulation_sweep('book/precision/data/"
                 "numerics-accumulation.json')\"")


def accumulation_sweep(ks: Sequence[int] = SWEEP_KS, seeds: Sequence[int] = (0, 1, 2, 3),
                       m: int = 16, n: int = 16) -> list[dict]:
    """`accumulation_errors` for every k and seed: bf16 inputs into fp32 and bf16 accumulators,
    and FP8 (E4M3) inputs into each of `ACCUMULATORS`. One row per (inputs, accumulator, k,
    seed). Minutes at the default sizes: the chapter reads the stored result."""
    rows = []
    for k in ks:
        for seed in seeds:
            for inputs, cases in (("bf16", BF16_ACCUMULATORS), ("fp8_e4m3", ACCUMULATORS)):
                for r in accumulation_errors(k, m, n, inputs, cases, seed):
                    rows.append({"inputs": inputs, "seed": seed, "m": m, "n": n, **r})
    return rows


def write_accumulation_sweep(path: str | Path, ks: Sequence[int] = SWEEP_KS,
                             seeds: Sequence[int] = (0, 1, 2, 3)) -> dict:
    """Run `accumulation_sweep` and write it with the command, date, versions and machine to
    `path` (JSON); returns what was written."""
    out = {**metadata(torch.device("cpu"), "fp64", SWEEP_COMMAND),
           "kind": "numerics-accumulation", "ks": list(ks), "seeds": list(seeds),
           "rows": accumulation_sweep(ks, seeds)}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=1) + "\n")
    return out
