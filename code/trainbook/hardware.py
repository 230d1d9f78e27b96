"""Accelerator specs: the one table of peak FLOPS, memory and bandwidth in the book.

Every peak in trainbook (MFU, time and cost estimates, rooflines, the planner) comes from
`SPECS` or, for a CPU or an unknown GPU, from a matmul measured on the machine at hand
(`trainbook.bench.peak.detect`). This module is data only: it measures nothing. Peaks are *dense*
tensor-core numbers; vendor sheets often print 2:4-sparse numbers, twice as large.

Units: TFLOPS = 10^12 FLOP/s, memory in GiB, bandwidth in decimal GB/s. Interconnect is the
per-GPU bidirectional total. `memory_gib` is the nominal capacity on the box; `reported_gib` is
what the device reports (`nvidia-smi`'s total, `torch.cuda.get_device_properties().total_memory`,
rocm-smi's VRAM total), which is what a job can plan with: an "80GB" H100 reports 81,559 MiB =
79.6 GiB, an H200's "141 GB" is 143,771 MiB = 140.4 GiB. `capacity_gib` is the reported figure
where the table has one, else the nominal one.

The scale-up fabric: `domain` GPUs share one NVLink/NVSwitch (or Infinity Fabric) domain (8 in
an HGX node, 72 in a GB200 NVL72 rack, a whole slice of TPUs), linked by a switch (any pair at
full rate), a direct mesh, a torus (TPU ICI: neighbours only, 2-D or 3-D) or only PCIe. What a
collective achieves there is not half the bidirectional figure:
`ring_busbw_gbps` is the bus bandwidth nccl-tests reports for ring-type collectives (all-gather,
reduce-scatter, ring all-reduce) over the whole domain, `allreduce_busbw_gbps` the all-reduce's,
which on NVSwitch systems with NVLink SHARP (H100, H200) is NCCL's default NVLS algorithm and
faster. `busbw_gbps(op)` is the one answer every cost model uses; where no measurement is in the
table it assumes `ASSUMED_LINK_EFFICIENCY` of the one-way link rate, and says so. `nic_gbps` is
the scale-out network per GPU on the platform's reference design.

Chapter: book/appendix/hardware.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
TOPOLOGIES = ("switch", "mesh", "pcie", "torus")  # torus: TPU inter-chip interconnect (ICI)
ASSUMED_LINK_EFFICIENCY = 0.8  # busbw / one-way link rate where nccl-tests figures are not listed
RING_OPS = ("all_gather", "reduce_scatter", "ring_all_reduce", "all_to_all", "send")
# Host link of a GPU: PCIe 5.0 x16, 32 GT/s x 16 lanes / 8 = 64 GB/s per direction before the
# 128b/130b line code (PCI-SIG PCIe 5.0 base specification). Offload and CPU-side optimizers use it.
PCIE5_X16_GBPS = 32 * 16 / 8


@dataclass(frozen=True)
class Accelerator:
    """One accelerator's spec sheet (or a measurement, when `measured` is True)."""

    name: str
    vendor: str
    tflops: dict[str, float | None]  # dense peak per dtype; None where the chip lacks it
    memory_gib: float
    hbm_gbps: float  # memory bandwidth, decimal GB/s
    interconnect: str
    interconnect_gbps: float  # per GPU, bidirectional, decimal GB/s
    source: str
    measured: bool = False
    notes: str = field(default="")
    domain: int = 1  # GPUs in one scale-up domain (NVLink / Infinity Fabric)
    topology: str = "pcie"  # how the domain is linked: one of TOPOLOGIES
    ring_busbw_gbps: float | None = None  # achieved by ring-type collectives (nccl-tests)
    allreduce_busbw_gbps: float | None = None  # achieved by all-reduce (NVLS where default)
    nic_gbps: float | None = None  # scale-out network per GPU, decimal GB/s
    fabric_source: str = ""
    reported_gib: float | None = None  # total memory as the device reports it, GiB
    reported_source: str = ""

    @property
    def capacity_gib(self) -> float:
        """GiB a job can plan with: the reported total where known, else the nominal one."""
        return self.reported_gib if self.reported_gib is not None else self.memory_gib

    def busbw_gbps(self, op: str = "all_reduce") -> float:
        """Achievable bus bandwidth (decimal GB/s) of collective `op` over the scale-up domain:
        the table's nccl-tests figure, or ASSUMED_LINK_EFFICIENCY x the one-way link rate."""
        if op != "all_reduce" and op not in RING_OPS:
            raise ValueError(f"unknown collective {op!r}; use all_reduce or one of "
                             f"{', '.join(RING_OPS)}")
        measured = self.allreduce_busbw_gbps if op == "all_reduce" else None
        measured = measured or self.ring_busbw_gbps
        if measured:
            return measured
        return ASSUMED_LINK_EFFICIENCY * self.interconnect_gbps / 2

    def busbw_is_assumed(self, op: str = "all_reduce") -> bool:
        """True when `busbw_gbps(op)` is the assumed efficiency, not a listed measurement."""
        return not ((op == "all_reduce" and self.allreduce_busbw_gbps) or self.ring_busbw_gbps)

    def peak_flops(self, dtype: str) -> float:
        """Dense peak in FLOP/s for `dtype`, with a clear error when the chip lacks it."""
        dtype = normalize_dtype(dtype)
        value = self.tflops.get(dtype)
        if value is None:
            have = ", ".join(d for d in DTYPES if self.tflops.get(d) is not None)
            raise ValueError(f"{self.name} has no {dtype} peak; it has: {have}")
        return value * 1e12


    def __post_init__(self):
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"topology {self.topology!r} is not one of {', '.join(TOPOLOGIES)}")
        if not isinstance(self.domain, int) or self.domain < 1:
            raise ValueError(f"domain must be a positive whole number of GPUs, got "
                             f"{self.domain!r}")

    def ridge_point(self, dtype: str) -> float:
        """FLOPs per byte of HBM traffic above which a kernel can be compute-bound (roofline)."""
        if not self.hbm_gbps:
            raise ValueError(f"{self.name} has no memory bandwidth in the table")
        return self.peak_flops(dtype) / (self.hbm_gbps * 1e9)


def _gpu(name, vendor, fp32, tf32, bf16, fp16, fp8, mem, hbm, link, link_gbps, source, notes="",
         **fabric):
    tflops = dict(fp32=fp32, tf32=tf32, bf16=bf16, fp16=fp16, fp8=fp8)
    return Accelerator(name, vendor, tflops, mem, hbm, link, link_gbps, source, notes=notes,
                       **fabric)


# Reference figures for the fabric: nccl-tests bus bandwidth at large messages on one 8-GPU node.
_NCCL_TESTS = ("nccl-tests all_reduce_perf / all_gather_perf busbw at >= 1 GB on 8 GPUs of one "
               "node, as operators report it (e.g. 8x H100 SXM all-reduce 460-480 GB/s, 8x A100 "
               "SXM4 230-250 GB/s: Alaya NeW, 'NCCL-tests in practice', 2026)")
_HGX = dict(domain=8, topology="switch")
_OAM_MESH = dict(domain=8, topology="mesh", nic_gbps=50.0)  # AMD 8-GPU platforms, a NIC per GPU


def _smi(mib: int) -> dict:
    """The total nvidia-smi prints for the card (MiB), as reported_gib and its source."""
    return dict(reported_gib=mib / 1024, reported_source=f"nvidia-smi total: {mib:,} MiB")


SPECS: dict[str, Accelerator] = {
    a.name: a
    for a in [
        _gpu("v100-sxm2-32gb", "NVIDIA", 15.7, None, None, 125.0, None, 32, 900, "NVLink 2", 300,
             "NVIDIA Tesla V100 datasheet (SXM2); fp16 is the tensor-core peak",
             domain=8, topology="mesh", nic_gbps=6.25,
             **_smi(32510),
             fabric_source="DGX-1: hybrid cube-mesh NVLink, 4 x 100 Gb/s InfiniBand per 8 GPUs"),
        _gpu("t4", "NVIDIA", 8.1, None, None, 65.0, None, 16, 320, "PCIe Gen3", 32,
             "NVIDIA T4 datasheet; fp16 is the tensor-core peak (no bf16: emulated only)",
             **_smi(15360),
             fabric_source="PCIe card: no scale-up fabric"),
        _gpu("l4", "NVIDIA", 30.3, 60.0, 121.0, 121.0, 242.0, 24, 300, "PCIe Gen4", 64,
             "NVIDIA L4 datasheet, dense (the sheet prints sparse, 2x)",
             **_smi(23034),
             fabric_source="PCIe card: no scale-up fabric"),
        _gpu("a100-40gb", "NVIDIA", 19.5, 156.0, 312.0, 312.0, None, 40, 1555, "NVLink 3", 600,
             "NVIDIA A100 datasheet (SXM4 40 GB), dense (sparse numbers are 2x)",
             **_HGX, ring_busbw_gbps=235.0, nic_gbps=25.0,
             **_smi(40960),
             fabric_source=_NCCL_TESTS + "; DGX A100: one 200 Gb/s HDR NIC per GPU"),
        _gpu("a100-80gb", "NVIDIA", 19.5, 156.0, 312.0, 312.0, None, 80, 2039, "NVLink 3", 600,
             "NVIDIA A100 datasheet (SXM4 80 GB), dense (sparse numbers are 2x)",
             **_HGX, ring_busbw_gbps=235.0, nic_gbps=25.0,
             **_smi(81920),
             fabric_source=_NCCL_TESTS + "; DGX A100: one 200 Gb/s HDR NIC per GPU"),
        _gpu("h100-sxm", "NVIDIA", 66.9, 494.7, 989.4, 989.4, 1978.9, 80, 3350, "NVLink 4", 900,
             "NVIDIA H100 Tensor Core GPU Architecture whitepaper, Table 3 (H100 SXM5), dense",
             **_HGX, ring_busbw_gbps=370.0, allreduce_busbw_gbps=480.0, nic_gbps=50.0,
             **_smi(81559),
             fabric_source=_NCCL_TESTS + "; all-reduce runs NVLink SHARP (NVLS) by default, "
             "ring-type collectives about 370 GB/s; DGX H100: one 400 Gb/s NIC per GPU"),
        _gpu("h100-pcie", "NVIDIA", 51.2, 378.0, 756.0, 756.0, 1513.0, 80, 2000, "PCIe Gen5", 128,
             "NVIDIA H100 Tensor Core GPU Architecture whitepaper, Table 3 (H100 PCIe), dense",
             notes="an NVLink bridge joins pairs at 600 GB/s", domain=2,
             **_smi(81559),
             fabric_source="PCIe card; NVLink bridge pairs"),
        _gpu("h200", "NVIDIA", 66.9, 494.7, 989.4, 989.4, 1978.9, 141, 4800, "NVLink 4", 900,
             "NVIDIA H200 datasheet (SXM), dense (sparse numbers are 2x)",
             notes="same GH100 compute as the H100 SXM; 141 GB HBM3e",
             **_HGX, ring_busbw_gbps=370.0, allreduce_busbw_gbps=475.0, nic_gbps=50.0,
             **_smi(143771),
             fabric_source=_NCCL_TESTS + "; all-reduce about 475 GB/s (NVLS); ring-type "
             "collectives assumed as on the H100 (same NVLink 4 and NVSwitch)"),
        _gpu("b200", "NVIDIA", 75.0, 1100.0, 2250.0, 2250.0, 4500.0, 180, 7700, "NVLink 5", 1800,
             "NVIDIA HGX B200 datasheet, per-GPU column, dense (the sheet prints sparse, 2x)",
             **_HGX, nic_gbps=50.0,
             **_smi(183359),
             fabric_source="HGX B200: NVLink 5 switch; one 400 Gb/s NIC per GPU; no nccl-tests "
             "figure listed"),
        _gpu("h20", "NVIDIA", 44.0, 74.0, 148.0, 148.0, 296.0, 96, 4000, "NVLink 4", 900,
             "NVIDIA H20 (HGX H20, for the China market), dense; NVIDIA publishes no public "
             "datasheet: figures as NVIDIA's partners list them (bf16 about 15% of the H100's)",
             notes="GH100 with 78 SMs enabled; compute capped, memory and NVLink kept",
             **_HGX, nic_gbps=50.0,
             fabric_source="HGX H20: NVLink 4 and NVSwitch as HGX H100; no nccl-tests figure "
             "listed"),
        _gpu("gb200-nvl72", "NVIDIA", 80.0, 1250.0, 2500.0, 2500.0, 5000.0, 186, 8000,
             "NVLink 5", 1800,
             "NVIDIA GB200 NVL72 datasheet, rack figures / 72 GPUs, dense (the sheet prints "
             "sparse, 2x)",
             notes="one NVLink domain of 72 GPUs (the rack)", domain=72, topology="switch",
             nic_gbps=100.0,
             fabric_source="GB200 NVL72: 72 GPUs on NVLink switch trays; ConnectX-8 800 Gb/s "
             "per GPU for scale-out; no nccl-tests figure listed"),
        _gpu("mi300x", "AMD", 163.4, 653.7, 1307.4, 1307.4, 2614.9, 192, 5300,
             "Infinity Fabric", 896,
             "AMD Instinct MI300X datasheet, dense matrix peaks (sparse numbers are 2x)",
             notes="fp32 is the matrix-core peak; 7 links x 128 GB/s",
             **_OAM_MESH,
             reported_gib=205_822_885_888 / 2**30,
             reported_source="rocm-smi VRAM Total Memory: 205,822,885,888 B",
             fabric_source="AMD Instinct MI300X platform: 8 GPUs fully connected by Infinity "
             "Fabric (7 links, 64 GB/s per direction each); a 400 Gb/s NIC per GPU"),
        _gpu("mi325x", "AMD", 163.4, 653.7, 1307.4, 1307.4, 2614.9, 256, 6000,
             "Infinity Fabric", 896,
             "AMD Instinct MI325X datasheet, dense matrix peaks (the MI300X's CDNA 3 compute "
             "with 256 GB of HBM3E at 6 TB/s)",
             notes="fp32 is the matrix-core peak; 7 links x 128 GB/s",
             **_OAM_MESH,
             fabric_source="AMD Instinct MI325X platform: 8 GPUs fully connected by Infinity "
             "Fabric, as the MI300X's"),
        _gpu("mi355x", "AMD", 157.3, None, 2516.6, 2516.6, 5033.2, 288, 8000,
             "Infinity Fabric", 1075,
             "AMD Instinct MI355X (CDNA 4), dense, from the ISSCC 2026 figure of 8,192 FP8 "
             "FLOP per clock per CU x 256 CUs x 2.4 GHz (AMD's 5 PFLOPS FP8), bf16 half of "
             "it; no tf32 matrix rate; 288 GB HBM3E at 8 TB/s",
             notes="fp32 is the vector peak; liquid-cooled, 1.4 kW",
             **_OAM_MESH,
             fabric_source="MI355X platform: 8 GPUs fully connected by 4th-generation Infinity "
             "Fabric (7 links, about 153.6 GB/s each, bidirectional); a 400 Gb/s NIC per GPU"),
        _gpu("tpu-v5p", "Google", None, None, 459.0, None, None, 95, 2765, "ICI", 1200,
             "Google Cloud TPU v5p documentation, per chip: bf16 459 TFLOPS (the FP8 line is "
             "the same 459: no faster FP8), 95 GiB HBM2e at 2,765 GB/s",
             notes="2 TensorCores per chip; int8 918 TOPS; largest slice 6,144 chips",
             domain=8960, topology="torus", nic_gbps=50 / 8,
             fabric_source="Cloud TPU v5p: 3-D torus ICI, 1,200 GB/s bidirectional per chip, "
             "8,960 chips per pod; data-center network 50 Gb/s per chip"),
        _gpu("tpu-v6e", "Google", None, None, 918.0, None, None, 32, 1638, "ICI", 800,
             "Google Cloud TPU v6e (Trillium) documentation, per chip: bf16 918 TFLOPS, "
             "32 GB HBM at 1,638 GB/s",
             notes="1 TensorCore per chip; int8 1,836 TOPS",
             domain=256, topology="torus",
             fabric_source="Cloud TPU v6e: 2-D torus ICI, 800 GB/s bidirectional per chip, "
             "256 chips per pod"),
    ]
}

_NAME_PATTERNS = [  # (regex on torch.cuda.get_device_name(), spec key); first match wins
    (r"\bH200\b(?! NVL)", "h200"),
    (r"\bH100 PCIe\b", "h100-pcie"),
    (r"\bH100\b", "h100-sxm"),
    (r"\bGB200\b", "gb200-nvl72"),
    (r"\bB200\b", "b200"),
    (r"\bA100.*80GB", "a100-80gb"),
    (r"\bA100\b", "a100-40gb"),
    (r"\bV100\b", "v100-sxm2-32gb"),
    (r"\bMI300X\b", "mi300x"),
    (r"\bMI325X\b", "mi325x"),
    (r"\bMI355X\b", "mi355x"),
    (r"\bH20\b", "h20"),
    (r"\bT4\b", "t4"),
    (r"\bL4\b", "l4"),  # not L40 or L40S
]

_DTYPE_ALIASES = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32",
    "tf32": "tf32",
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16",
    "fp8": "fp8", "float8": "fp8", "e4m3": "fp8",
}


def normalize_dtype(dtype: str | torch.dtype) -> str:
    """'bfloat16', torch.bfloat16 or 'bf16' -> 'bf16'."""
    key = str(dtype).removeprefix("torch.").lower()
    if key not in _DTYPE_ALIASES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return _DTYPE_ALIASES[key]


def get(name: str | Accelerator) -> Accelerator:
    """Look up a spec by name ('h100-sxm', 'a100-80gb', ...); a spec passes through, so every
    function that takes an accelerator accepts either."""
    if isinstance(name, Accelerator):
        return name
    if not isinstance(name, str):
        raise ValueError(f"an accelerator is a name or an entry of hardware.SPECS, got "
                         f"{name!r}; known: {', '.join(SPECS)}")
    key = name.lower()
    if key not in SPECS:
        raise ValueError(f"unknown accelerator {name!r}; known: {', '.join(SPECS)}")
    return SPECS[key]


def match_device_name(device_name: str) -> Accelerator | None:
    """The spec whose name matches a CUDA/ROCm device name, or None for an unknown chip."""
    for pattern, key in _NAME_PATTERNS:
        if re.search(pattern, device_name, re.IGNORECASE):
            return SPECS[key]
    return None


def table() -> list[dict]:
    """The spec table as rows (for the CLI, the appendix and the planner)."""
    rows = []
    for a in SPECS.values():
        row = {"name": a.name, "vendor": a.vendor}
        row.update({f"{d} TFLOPS": a.tflops[d] for d in DTYPES})
        row.update({"memory GiB": a.memory_gib, "reported GiB": a.reported_gib,
                    "HBM GB/s": a.hbm_gbps,
                    "interconnect": a.interconnect, "link GB/s": a.interconnect_gbps,
                    "domain GPUs": a.domain, "topology": a.topology,
                    "ring busbw GB/s": a.ring_busbw_gbps,
                    "all-reduce busbw GB/s": a.allreduce_busbw_gbps, "NIC GB/s": a.nic_gbps,
                    "source": a.source, "reported memory source": a.reported_source})
        rows.append(row)
    return rows
