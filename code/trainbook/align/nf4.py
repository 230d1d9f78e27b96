"""NF4, QLoRA's 4-bit NormalFloat, from scratch: the 16 levels from normal quantiles, block-wise
absmax quantisation and double quantisation of the constants.

A 4-bit type is a table of 16 levels in [-1, 1]; a block of `blocksize` consecutive weights is
divided by its largest magnitude (absmax, kept in fp32) and each value becomes the index of the
nearest level. NF4 puts the levels at quantiles of N(0, 1), so that normally distributed
weights fill the 16 bins about equally (Dettmers et al. 2023, Section 3): 8 positive levels, 7
negative ones and an exact zero, normalised to +-1. `nf4_levels` computes them with
`torch.special.ndtri` (the inverse normal CDF) the way bitsandbytes' `create_normal_map`
does with scipy, and the tests hold them to `bitsandbytes.functional.get_4bit_type("nf4")`.

Double quantisation stores the fp32 absmax constants themselves in 8 bits: subtract their mean,
quantise blocks of 256 with the signed 8-bit dynamic map (`dynamic_map`, bitsandbytes'
`create_dynamic_map`), keep one fp32 absmax per 256 constants. The constants cost 32/64 = 0.5
bits per parameter without it, 8/64 + 32/(64*256) = 0.127 with it (`bits_per_param`).

`quantize` / `dequantize` give the same codes, packing (two codes per byte, the first in the high
nibble) and dequantised values as `bitsandbytes.functional.quantize_4bit` / `dequantize_4bit`
on CPU (tests/test_nf4.py). `quantization_error` compares 4-bit types on the same weights (NF4,
bitsandbytes' FP4, E2M1 and int4 at the same block absmax; MXFP4 and NVFP4 as their specs scale
them), and `lloyd_max_levels` finds the table with the least squared error for given weights.
A linear layer stored this way is `align.nf4_linear.NF4Linear`.

Chapter: book/alignment/lora
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F

from .. import formats

# The paper's and bitsandbytes' settings this module reproduces; tests/test_nf4.py asserts each
# against the installed bitsandbytes, so an upgrade that changes one fails a test.
BLOCKSIZE = 64  # quantize_4bit's default block (blocksize=None -> 64) and QLoRA's
DQ_BLOCKSIZE = 256  # quantize_4bit(compress_statistics=True) quantises the absmax in 256s
NF4_OFFSET = 0.9677083  # create_normal_map's default outermost probability
BNB_DEFAULT_QUANT_TYPE = "fp4"  # quantize_4bit's, Linear4bit's and BitsAndBytesConfig's default:
# NF4 must be asked for by name (quant_type="nf4", bnb_4bit_quant_type="nf4")
BNB_LINEAR4BIT_COMPRESS_STATISTICS = True  # Linear4bit / Params4bit default: double quantisation
HF_DEFAULT_DOUBLE_QUANT = False  # BitsAndBytesConfig(bnb_4bit_use_double_quant=False): ask for it
ABSMAX_BITS = 32  # the constants are fp32
KINDS = ("nf4", "fp4", "e2m1", "int4")  # 16-entry tables with a block absmax
BLOCK_FORMATS = ("mxfp4", "nvfp4")  # formats.BLOCK_FORMATS with their own scales


# ---------------------------------------------------------------------------------------------
# The tables
# ---------------------------------------------------------------------------------------------

def nf4_levels(offset: float = NF4_OFFSET) -> torch.Tensor:
    """The 16 NF4 levels, sorted, in [-1, 1] (float32).

    Positive half: the normal quantiles at 8 evenly spaced probabilities from `offset` down to
    (not including) 0.5; negative half: minus those at 7 probabilities over the same range;
    plus an exact 0; all divided by the largest. Asymmetric because 16 levels with an exact zero
    leave 15 nonzero ones: one side gets 8. bitsandbytes' `offset` 0.9677083 keeps the outermost
    quantile finite; it equals 1 - (1/30 + 1/32)/2 to the digits it is given with."""
    if not (isinstance(offset, float) and 0.5 < offset < 1):
        raise ValueError(f"offset is a probability in (0.5, 1), got {offset!r}")
    pos = torch.special.ndtri(torch.linspace(offset, 0.5, 9)[:-1].double())
    neg = -torch.special.ndtri(torch.linspace(offset, 0.5, 8)[:-1].double())
    v = torch.cat([neg, torch.zeros(1, dtype=torch.float64), pos]).sort().values
    return (v / v.max()).float()


def float_levels(name: str) -> torch.Tensor:
    """Every value of a small float format of `trainbook.formats` (e.g. "fp4_e2m1"), sorted and
    divided by its max: the format used as a 16-entry table with a block absmax."""
    f = formats.get(name)
    if f.bits > 8:
        raise ValueError(f"{name} has {f.bits} bits: a table of its values is for formats of "
                         "at most 8 bits")
    mags = {0.0}
    for e in range(2 ** f.exp_bits):
        for m in range(2 ** f.man_bits):
            frac = m / 2 ** f.man_bits
            mags.add(math.ldexp(frac, f.emin) if e == 0 else math.ldexp(1 + frac, e - f.bias))
    v = torch.tensor(sorted({s * x for x in mags if x <= f.max for s in (1, -1)}))
    return (v / v.abs().max()).float()


def levels(kind: str) -> torch.Tensor:
    """The sorted level table of a 4-bit type: "nf4"; "fp4" (bitsandbytes' FP4: magnitudes 0,
    0.0625, 2, 3, 4, 6, 8, 12 over 12, its sign-exponent-mantissa 1-2-1 with bias 2 and no 1.0);
    "e2m1" (the OCP FP4 element: 0, 0.5, 1, 1.5, 2, 3, 4, 6 over 6); "int4" (k/7, k = -7..7)."""
    if kind == "nf4":
        return nf4_levels()
    if kind == "fp4":
        mags = torch.tensor([0.0, 0.0625, 2, 3, 4, 6, 8, 12]) / 12
        return torch.cat([-mags.flip(0)[:-1], mags])
    if kind == "e2m1":
        return float_levels("fp4_e2m1")
    if kind == "int4":
        return torch.arange(-7, 8, dtype=torch.float32) / 7
    raise ValueError(f"unknown 4-bit type {kind!r}; choose one of {', '.join(KINDS)}")


def dynamic_map(signed: bool = True, max_exponent_bits: int = 7,
                total_bits: int = 8) -> torch.Tensor:
    """bitsandbytes' 8-bit dynamic map (Dettmers 2016's dynamic tree quantisation): for each
    exponent i = 0..max_exponent_bits-1, 2^i evenly spaced fractions in (0.1, 1) times
    10^(i - max_exponent_bits + 1), with both signs, plus 0 and 1: 256 sorted values in [-1, 1]
    with fine steps near zero and coarse ones near one."""
    if not signed or max_exponent_bits != 7 or total_bits != 8:
        raise ValueError("only the signed 8-bit map with 7 exponent bits is built here "
                         "(the one double quantisation uses)")
    data: list[float] = []
    for i in range(max_exponent_bits):
        b = torch.linspace(0.1, 1, 2 ** i + 1, dtype=torch.float32)
        means = ((b[:-1] + b[1:]) / 2.0 * 10 ** (i - max_exponent_bits + 1)).tolist()
        data += means + [-m for m in means]
    return torch.tensor(sorted(data + [0.0, 1.0]), dtype=torch.float32)


@cache
def _table(kind: str) -> torch.Tensor:
    """levels(kind), or the 8-bit dynamic map for "dynamic", built once (read-only)."""
    return dynamic_map() if kind == "dynamic" else levels(kind)


def bits_per_param(blocksize: int = BLOCKSIZE, double: bool = False,
                   dq_blocksize: int = DQ_BLOCKSIZE) -> float:
    """Storage per weight: 4 bits of code plus the shared constants. Without double
    quantisation one fp32 absmax per block (32/blocksize); with it one 8-bit code per block and
    one fp32 absmax per dq_blocksize blocks (8/blocksize + 32/(blocksize*dq_blocksize))."""
    _positive("blocksize", blocksize)
    _positive("dq_blocksize", dq_blocksize)
    if not double:
        return 4 + ABSMAX_BITS / blocksize
    return 4 + 8 / blocksize + ABSMAX_BITS / (blocksize * dq_blocksize)


# ---------------------------------------------------------------------------------------------
# Quantise and dequantise
# ---------------------------------------------------------------------------------------------

@dataclass
class Quantized:
    """A tensor in a 4-bit type: packed codes and the block constants (plain fp32 absmax, or
    8-bit codes of absmax - offset with one fp32 absmax per dq_blocksize of them)."""

    packed: torch.Tensor  # uint8, two codes per byte (first code in the high nibble)
    absmax: torch.Tensor  # fp32 (n_blocks,), or uint8 codes of (absmax - offset) when double
    shape: tuple[int, ...]
    kind: str
    blocksize: int
    offset: float = 0.0  # mean of the absmax constants (double quantisation)
    absmax2: torch.Tensor | None = None  # fp32 (ceil(n_blocks / dq_blocksize),)
    dq_blocksize: int = DQ_BLOCKSIZE

    @property
    def double(self) -> bool:
        return self.absmax2 is not None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def nbytes(self) -> int:
        """Bytes stored: codes, constants, second-level constants and the offset."""
        extra = self.absmax2.nbytes + 4 if self.double else 0
        return self.packed.nbytes + self.absmax.nbytes + extra

    def bits_per_param(self) -> float:
        return 8 * self.nbytes() / self.numel


def _positive(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a whole number >= 1, got {v!r}")
    return v


def _check_tensor(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float32, torch.bfloat16,
                                                          torch.float16):
        raise ValueError(f"quantize takes a float32/bf16/fp16 tensor, got "
                         f"{getattr(x, 'dtype', type(x).__name__)}")
    if x.numel() == 0:
        raise ValueError("quantize got an empty tensor: there is nothing to quantise")
    if not bool(torch.isfinite(x).all()):
        raise ValueError("the tensor holds inf or NaN: a block's absmax would be infinite; "
                         "find where they come from before quantising")


def nearest(values: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Index of the nearest entry of a sorted `table` for each value (a tie goes to the lower
    entry, as bitsandbytes' bucketize over the midpoints does)."""
    mids = (table[:-1] + table[1:]) / 2
    return torch.bucketize(values, mids)


def blockwise_absmax(x: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(absmax per block (fp32), x / absmax in [-1, 1], flattened) over blocks of the flattened
    tensor; the last block may be shorter. Multiplies by the reciprocal, as bitsandbytes does
    (x / absmax can differ in the last bit)."""
    flat = x.detach().reshape(-1).float()
    blocks = F.pad(flat, (0, -flat.numel() % blocksize)).reshape(-1, blocksize)
    absmax = blocks.abs().amax(-1)  # zero padding cannot raise a block's absmax
    scaled = (blocks * (1.0 / absmax.clamp(min=1e-38))[:, None]).clamp(-1, 1)
    return absmax, scaled.reshape(-1)[:flat.numel()]


def pack(codes: torch.Tensor, pad_code: int = 0) -> torch.Tensor:
    """Two 4-bit codes per byte, the first in the high nibble: (n,) -> (ceil(n/2), 1) uint8
    (an odd count is padded with `pad_code`)."""
    if not 0 <= pad_code <= 15:
        raise ValueError(f"pad_code is a 4-bit code in [0, 15], got {pad_code!r}")
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > 15):
        raise ValueError("codes must be 4-bit values in [0, 15]; quantise with `nearest` first")
    c = codes.reshape(-1).to(torch.uint8)
    if c.numel() % 2:
        c = torch.cat([c, c.new_full((1,), pad_code)])
    return ((c[::2] << 4) | c[1::2]).unsqueeze(1)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The codes back from `pack`: (n/2, 1) uint8 -> (n,) int64."""
    p = packed.reshape(-1).long()
    return torch.stack([p >> 4, p & 0xF], dim=1).reshape(-1)


def quantize_constants(absmax: torch.Tensor, dq_blocksize: int = DQ_BLOCKSIZE
                       ) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Double quantisation: (uint8 codes of absmax - mean, fp32 absmax per dq block, mean)."""
    offset = absmax.mean()
    c = absmax - offset
    n = c.numel()
    pad = -n % dq_blocksize
    blocks = F.pad(c, (0, pad)).reshape(-1, dq_blocksize)
    absmax2 = blocks.abs().amax(-1)  # zero padding cannot raise a block's absmax
    scaled = (blocks / absmax2.clamp(min=1e-38)[:, None]).reshape(-1)[:n]
    return nearest(scaled, _table("dynamic")).to(torch.uint8), absmax2, float(offset)


def dequantize_constants(q: Quantized) -> torch.Tensor:
    """The fp32 absmax per block, read back from the 8-bit codes when double-quantised."""
    if not q.double:
        return q.absmax
    n = q.absmax.numel()
    scale = q.absmax2.repeat_interleave(q.dq_blocksize)[:n]
    return _table("dynamic").to(scale.device)[q.absmax.long()] * scale + q.offset


def quantize(x: torch.Tensor, kind: str = "nf4", blocksize: int = BLOCKSIZE,
             double: bool = False, dq_blocksize: int = DQ_BLOCKSIZE) -> Quantized:
    """x in a 4-bit type with one absmax per `blocksize` values (flattened, row-major), and
    with `double` the absmax themselves in 8 bits."""
    table = _table(kind)
    _positive("blocksize", blocksize)
    _positive("dq_blocksize", dq_blocksize)
    _check_tensor(x)
    absmax, scaled = blockwise_absmax(x, blocksize)
    zero = int(nearest(torch.zeros(1), table))  # bitsandbytes pads an odd count with a 0
    q = Quantized(pack(nearest(scaled, table), zero), absmax, tuple(x.shape), kind, blocksize)
    if double:
        q.absmax, q.absmax2, q.offset = quantize_constants(absmax, dq_blocksize)
        q.dq_blocksize = dq_blocksize
    return q


def dequantize(q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The tensor back, in `dtype`: level[code] * absmax of its block (computed in fp32)."""
    n = q.numel
    vals = _table(q.kind).to(q.packed.device)[unpack(q.packed)[:n]]
    scale = dequantize_constants(q).repeat_interleave(q.blocksize)[:n]
    return (vals * scale).reshape(q.shape).to(dtype)


def quantization_error(x: torch.Tensor, kinds: Sequence[str] = KINDS + BLOCK_FORMATS,
                       blocksize: int = BLOCKSIZE,
                       tables: dict[str, torch.Tensor] | None = None) -> list[dict]:
    """Per type: relative RMS error ||x - q(x)|| / ||x||, storage bits per value and, for the
    16-entry tables, the entropy of the codes used (4 bits = every level equally often).
    `tables` adds level tables of your own (sorted, in [-1, 1]) under the same block absmax."""
    _positive("blocksize", blocksize)
    _check_tensor(x)
    x = x.detach().float()
    todo = [(k, None) for k in kinds] + list((tables or {}).items())
    rows = []
    for kind, table in todo:
        entropy = float("nan")
        if table is None and kind in BLOCK_FORMATS:
            bf = formats.get_block(kind)
            if x.numel() % bf.block:
                raise ValueError(f"{kind} needs a multiple of {bf.block} values, got {x.numel()}")
            deq = formats.block_quantize(x.reshape(-1, bf.block), bf).reshape(x.shape)
            bits = bf.bits_per_element
        else:
            if table is None and kind not in KINDS:
                raise ValueError(f"unknown type {kind!r}; choose from {', '.join(KINDS)}, "
                                 f"{', '.join(BLOCK_FORMATS)}")
            table = _table(kind) if table is None else table
            absmax, scaled = blockwise_absmax(x, blocksize)
            codes = nearest(scaled, table)
            deq = table[codes] * absmax.repeat_interleave(blocksize)[:x.numel()]
            bits = bits_per_param(blocksize)
            p = torch.bincount(codes, minlength=len(table)).double() / x.numel()
            entropy = float(-(p[p > 0] * p[p > 0].log2()).sum())
        err = float((x.reshape(-1) - deq.reshape(-1)).norm() / x.norm())
        rows.append({"type": kind, "rel_rms_error": err, "bits_per_param": bits,
                     "code_entropy_bits": entropy})
    return rows


def lloyd_max_levels(x: torch.Tensor, blocksize: int = BLOCKSIZE, n_levels: int = 16,
                     iters: int = 50) -> torch.Tensor:
    """The n_levels-entry table with the least squared error on x's absmax-scaled values:
    Lloyd's algorithm (1-D k-means: each level moves to the mean of the values nearest it),
    started from NF4. The error-optimal table for these weights, to compare NF4 against."""
    _positive("n_levels", n_levels)
    _positive("iters", iters)
    _check_tensor(x)
    _, v = blockwise_absmax(x, blocksize)
    table = nf4_levels() if n_levels == 16 else torch.linspace(-1, 1, n_levels)
    for _ in range(iters):
        codes = nearest(v, table)
        sums = torch.zeros(n_levels).index_add_(0, codes, v)
        n = torch.bincount(codes, minlength=n_levels).float()
        table = torch.where(n > 0, sums / n.clamp(min=1), table).sort().values
    return table
