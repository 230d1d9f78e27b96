import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainbook import launch
from trainbook.bench import collectives as bench
from trainbook.parallel import collectives


@pytest.mark.parametrize("text, nbytes", [("4096", 4096), ("1KiB", 1024), ("64MiB", 64 * 2**20),
                                          ("1GB", 10**9), ("2 KB", 2000), ("1e6", 10**6),
                                          ("1.5KB", 1500), ("1kib", 1024), ("8B", 8)])
def test_parse_size(text, nbytes):
    assert bench.parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["lots", "1.5B", "0", "12XB"])
def test_parse_size_rejects_nonsense(text):
    with pytest.raises(ValueError):
        bench.parse_size(text)


@pytest.mark.parametrize("text", ["1.2.3", "1..2", "e6", "+-1", "1e"])
def test_parse_size_rejects_malformed_numbers_clearly(text):
    with pytest.raises(ValueError, match="cannot read size"):
        bench.parse_size(text)


@pytest.mark.parametrize("text, hint", [("64M", "64MB .* or 64MiB"), ("1K", "1KB .* or 1KiB"),
                                        ("2g", "2GB .* or 2GiB")])
def test_parse_size_refuses_bare_ambiguous_suffixes(text, hint):
    with pytest.raises(ValueError, match=f"ambiguous; write {hint}"):
        bench.parse_size(text)


def test_parse_size_decimal_agrees_with_parse_count():
    from trainbook.compute.cost import parse_count
    assert bench.parse_size("1MB") == parse_count("1M") == 10**6
    assert bench.parse_size("3GB") == parse_count("3G")
    assert bench.parse_size("1MiB") == 2**20


def test_payload_sizes_and_errors():
    assert bench.payload_sizes(1024, 16384, 4) == [1024, 4096, 16384]
    with pytest.raises(ValueError, match="1 <= start <= stop"):
        bench.payload_sizes(4096, 1024)


def test_bus_factors_follow_nccl_tests():
    assert bench.bus_factor("all_reduce", 8) == pytest.approx(1.75)
    assert bench.bus_factor("all_gather", 8) == pytest.approx(0.875)
    assert bench.bus_factor("broadcast", 8) == 1.0
    with pytest.raises(ValueError, match="unknown collective 'allreduce'"):
        bench.bus_factor("allreduce", 8)


@settings(max_examples=30, deadline=None)
@given(alpha=st.floats(1e-6, 1e-3), bw=st.floats(1e8, 1e12))
def test_alpha_beta_fit_recovers_a_noiseless_model(alpha, bw):
    sizes = [2**k for k in range(10, 28, 3)]
    times = [alpha + s / bw for s in sizes]
    a, b = bench.fit_alpha_beta(sizes, times)
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(bw, rel=1e-6)


def test_ring_beats_tree_on_bandwidth_and_loses_on_latency():
    big, small = 2**30, 8
    assert collectives.ring_time(64, big, 5e-6, 50e9) < collectives.tree_time(64, big, 5e-6, 50e9)
    assert (collectives.ring_time(64, small, 5e-6, 50e9)
            > collectives.tree_time(64, small, 5e-6, 50e9))


@pytest.mark.parametrize("n", [2, 3, 4])
def test_scratch_all_reduce_matches_native(n):
    for r in launch.run(collectives.scratch_vs_native, n, kwargs=dict(numel=96), timeout_s=90):
        assert r.value["ring"] < 1e-5 and r.value["tree"] < 1e-5


def test_what_each_collective_does():
    out = launch.run(collectives.what_each_collective_does, 2, timeout_s=90)
    r0, r1 = out[0].value, out[1].value
    assert r0["all_reduce"][1] == [10.0, 12.0]
    assert r1["all_gather"][1] == [0.0, 10.0]
    assert r0["reduce_scatter"][1] == [10.0] and r1["reduce_scatter"][1] == [12.0]
    assert r1["all_to_all"][1] == [1.0, 11.0]


def test_the_gloo_strided_view_pitfall():
    wrong = [r.value for r in launch.run(collectives.strided_all_reduce, 2, args=(False,),
                                         timeout_s=90)]
    right = [r.value for r in launch.run(collectives.strided_all_reduce, 2, args=(True,),
                                         timeout_s=90)]
    assert right == [0.0, 0.0]
    assert max(wrong) > 0  # silently wrong on gloo (torch 2.13): .contiguous() first


def test_benchmark_rows_under_the_launcher():
    rows = launch.run(bench.benchmark, 2, kwargs=dict(ops=("all_reduce", "all_gather"),
                                                     sizes=(1024, 65536), iters=2),
                      timeout_s=90)[0].value
    assert [(r["op"], r["bytes"]) for r in rows] == [("all_reduce", 1024), ("all_reduce", 65536),
                                                     ("all_gather", 1024), ("all_gather", 65536)]
    for r in rows:
        assert r["time_s"] > 0
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * bench.bus_factor(r["op"], 2))


def test_benchmark_outside_a_process_group_says_how_to_run_it():
    with pytest.raises(ValueError, match="torchrun"):
        bench.benchmark()


def test_torchrun_command(tmp_path):
    """The `collectives` command under real torchrun: `-m trainbook` with a subcommand."""
    out = tmp_path / "c.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "trainbook", "collectives", "--ops", "all_reduce,broadcast",
           "--payload-range", "1KiB", "64KiB", "--iters", "2", "--timeout-s", "60",
           "--json-out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "busbw GB/s" in proc.stdout and "all_reduce: t =" in proc.stdout
    import json
    data = json.loads(out.read_text())
    assert data["meta"]["ranks"] == 2 and set(data["fits"]) == {"all_reduce", "broadcast"}


def test_command_help_and_bad_input(capsys):
    from trainbook.__main__ import main
    with pytest.raises(SystemExit) as e:
        main(["collectives", "--help"])
    assert e.value.code == 0 and "busbw" in capsys.readouterr().out
    assert main(["collectives", "--ops", "allreduce"]) == 2
    assert "unknown collective" in capsys.readouterr().err
    assert main(["collectives"]) == 2  # not under torchrun
    assert "torchrun" in capsys.readouterr().err


def test_fit_ops_fits_each_op_with_two_payloads_or_more():
    rows = [{"op": op, "bytes": s, "ranks": 2, "time_s": 1e-5 + s / 1e9}
            for op, sizes in (("all_reduce", (1024, 65536)), ("broadcast", (1024,))) for s in sizes]
    fits = bench.fit_ops(rows)
    assert set(fits) == {"all_reduce"}
    assert fits["all_reduce"]["alpha_us"] == pytest.approx(10, rel=1e-6)
    assert fits["all_reduce"]["bus_bandwidth_GBps"] == pytest.approx(
        1.0 * bench.bus_factor("all_reduce", 2))


def test_collective_time_is_ring_steps_times_alpha_plus_bus_factor_bandwidth():
    alpha, bw, S = 5e-6, 50e9, 2**30
    for op, steps in (("all_reduce", 14), ("all_gather", 7), ("reduce_scatter", 7),
                      ("all_to_all", 7), ("broadcast", 7)):
        assert collectives.collective_time(op, 8, S, alpha, bw) == pytest.approx(
            steps * alpha + bench.bus_factor(op, 8) * S / bw)
    assert (collectives.ring_time(8, S, alpha, bw)
            == collectives.collective_time("all_reduce", 8, S, alpha, bw))
    assert collectives.ring_time(8, S, alpha, bw) == pytest.approx(2 * 7 * (alpha + S / 8 / bw))
    assert collectives.collective_time("all_reduce", 1, S, alpha, bw) == 0.0


@pytest.mark.parametrize("fn", [
    collectives.ring_time, collectives.tree_time,
    lambda n, s, a, b: collectives.collective_time("all_gather", n, s, a, b)])
def test_alpha_beta_models_validate_their_inputs(fn):
    with pytest.raises(ValueError, match="n must be a whole number >= 1"):
        fn(0, 1e6, 5e-6, 50e9)
    with pytest.raises(ValueError, match="bandwidth must be positive"):
        fn(8, 1e6, 5e-6, 0)
    with pytest.raises(ValueError, match="n must be a whole number >= 1"):
        bench.bus_factor("all_reduce", 0)
    with pytest.raises(ValueError, match="unknown collective"):
        collectives.collective_time("allgather", 8, 1e6, 5e-6, 50e9)
