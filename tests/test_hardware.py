import pytest

from trainbook import hardware
from trainbook.bench import peak


def test_every_row_has_every_dtype_and_a_source():
    for a in hardware.SPECS.values():
        assert set(a.tflops) == set(hardware.DTYPES)
        assert a.source and a.memory_gib > 0 and a.hbm_gbps > 0 and a.interconnect_gbps > 0
        assert not a.measured


def test_required_accelerators_present():
    for name in ["v100-sxm2-32gb", "a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h200",
                 "b200", "mi300x"]:
        assert name in hardware.SPECS


def test_peaks_are_dense_and_ordered():
    h100 = hardware.get("h100-sxm")
    assert h100.peak_flops("bf16") == pytest.approx(989.4e12)
    assert h100.peak_flops("torch.bfloat16") == h100.peak_flops("bf16")
    for a in hardware.SPECS.values():  # lower precision is never slower on the same chip
        t = [a.tflops[d] for d in ("fp32", "tf32", "bf16", "fp8") if a.tflops[d] is not None]
        assert t == sorted(t)
    # A100 dense bf16 is 312 TFLOPS (624 is the 2:4-sparse number).
    assert hardware.get("a100-80gb").tflops["bf16"] == 312.0


def test_missing_dtype_and_unknown_names_are_clear():
    with pytest.raises(ValueError, match="has no bf16 peak"):
        hardware.get("v100-sxm2-32gb").peak_flops("bf16")
    with pytest.raises(ValueError, match="unknown accelerator 'h1000'"):
        hardware.get("h1000")
    assert hardware.get(hardware.SPECS["h200"]) is hardware.SPECS["h200"]  # a spec passes through
    with pytest.raises(ValueError, match="a name or an entry of hardware.SPECS"):
        hardware.get(8)
    with pytest.raises(ValueError, match="unknown dtype"):
        hardware.normalize_dtype("int3")


@pytest.mark.parametrize("device_name, key", [
    ("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H100 PCIe", "h100-pcie"),
    ("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
    ("NVIDIA A100-SXM4-40GB", "a100-40gb"), ("Tesla V100-SXM2-32GB", "v100-sxm2-32gb"),
    ("AMD Instinct MI300X", "mi300x"), ("NVIDIA B200", "b200"), ("Tesla T4", "t4"),
    ("NVIDIA L4", "l4"), ("NVIDIA A100 80GB PCIe", "a100-80gb"), ("NVIDIA H20", "h20"),
    ("AMD Instinct MI325X", "mi325x"), ("AMD Instinct MI355X", "mi355x"),
])
def test_device_names_match(device_name, key):
    assert hardware.match_device_name(device_name).name == key


@pytest.mark.parametrize("device_name", ["NVIDIA GeForce GT 710", "NVIDIA L40S", "NVIDIA H200 NVL",
                                         "AMD Instinct MI350X"])
def test_unknown_gpu_names_match_nothing(device_name):
    assert hardware.match_device_name(device_name) is None


def test_newer_rows_as_their_sources_print_them():
    """H20, MI325X, MI355X and TPU v5p/v6e: the figures the sources give, and what they lack."""
    h20, mi325x, mi355x = (hardware.get(n) for n in ("h20", "mi325x", "mi355x"))
    assert h20.tflops["bf16"] == 148.0 and h20.memory_gib == 96 and h20.hbm_gbps == 4000
    assert h20.peak_flops("bf16") < 0.16 * hardware.get("h100-sxm").peak_flops("bf16")
    assert mi325x.tflops == hardware.get("mi300x").tflops and mi325x.memory_gib == 256
    # 8,192 FP8 FLOP/clock/CU x 256 CUs x 2.4 GHz
    assert mi355x.peak_flops("fp8") == pytest.approx(8192 * 256 * 2.4e9, rel=1e-4)
    assert mi355x.peak_flops("bf16") == pytest.approx(mi355x.peak_flops("fp8") / 2, rel=1e-4)
    v5p, v6e = hardware.get("tpu-v5p"), hardware.get("tpu-v6e")
    assert (v5p.tflops["bf16"], v6e.tflops["bf16"]) == (459.0, 918.0)
    assert v5p.topology == v6e.topology == "torus" and (v5p.domain, v6e.domain) == (8960, 256)
    with pytest.raises(ValueError, match="tpu-v6e has no fp8 peak; it has: bf16"):
        v6e.peak_flops("fp8")


def test_cpu_peak_is_measured():
    cpu = peak.detect("cpu")
    assert cpu.measured and "measured" in cpu.source
    assert 1e-4 < cpu.tflops["fp32"] < 100  # TFLOPS: a real CPU, not a typo
    assert peak.detect("cpu") is cpu  # cached per process


def test_measure_rejects_tiny_sizes():
    with pytest.raises(ValueError, match="too small"):
        peak.measure_matmul_tflops("fp32", sizes=(4,))


def test_table_rows():
    rows = hardware.table()
    assert len(rows) == len(hardware.SPECS)
    assert {"name", "bf16 TFLOPS", "memory GiB", "HBM GB/s", "source"} <= set(rows[0])


def test_ridge_point():
    h100 = hardware.get("h100-sxm")
    assert h100.ridge_point("bf16") == pytest.approx(989.4e12 / 3350e9)
    with pytest.raises(ValueError, match="no memory bandwidth"):
        peak.cpu_spec().ridge_point("fp32")


def test_fabric_busbw_is_measured_where_listed_and_assumed_elsewhere():
    h100, b200 = hardware.get("h100-sxm"), hardware.get("b200")
    # nccl-tests on 8 H100 SXM: all-reduce (NVLS) ~480 GB/s, ring-type collectives ~370 GB/s
    assert h100.busbw_gbps("all_reduce") == 480.0 and h100.busbw_gbps("all_gather") == 370.0
    assert not h100.busbw_is_assumed("all_gather")
    assert b200.busbw_is_assumed() and b200.busbw_gbps() == pytest.approx(
        hardware.ASSUMED_LINK_EFFICIENCY * b200.interconnect_gbps / 2)
    for a in hardware.SPECS.values():
        assert a.topology in hardware.TOPOLOGIES and a.domain >= 1 and a.fabric_source
        # achievable never exceeds the one-way link rate times the NVLS in-network reduction
        assert a.busbw_gbps("reduce_scatter") <= a.interconnect_gbps / 2
    assert hardware.get("gb200-nvl72").domain == 72
    assert hardware.match_device_name("NVIDIA GB200").name == "gb200-nvl72"
    with pytest.raises(ValueError, match="unknown collective"):
        h100.busbw_gbps("gossip")


def test_reported_capacity_is_a_little_under_the_nominal_one():
    for a in hardware.SPECS.values():
        assert a.capacity_gib == (a.reported_gib or a.memory_gib)
        if a.reported_gib is not None:
            assert 0.93 * a.memory_gib < a.reported_gib <= a.memory_gib and a.reported_source
    assert hardware.get("h100-sxm").capacity_gib == pytest.approx(79.65, abs=0.01)
    assert hardware.get("h200").capacity_gib == pytest.approx(140.40, abs=0.01)
