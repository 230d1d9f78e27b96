
import dist_fns
import pytest
import torch

from trainbook import launch


def test_results_and_output_in_rank_order():
    out = launch.run(dist_fns.rank_sum, nprocs=2, timeout_s=60)
    assert [r.rank for r in out] == [0, 1]
    assert [r.value for r in out] == [3.0, 3.0]
    assert out[1].stdout == "rank 1 of 2\n"


def test_a_failing_rank_is_named_with_its_traceback():
    with pytest.raises(RuntimeError, match="rank 1 failed") as e:
        launch.run(dist_fns.fail_on_rank_one, nprocs=2, timeout_s=60)
    assert "boom on purpose" in str(e.value)


def test_a_hang_times_out_instead_of_hanging():
    """The run stops at its timeout and says so: the process group's (gloo gives up on the
    collective after 3 s) or the launcher's. pytest's own timeout would catch a real hang; how
    long the stop took is the machine's business, not the test's."""
    with pytest.raises((TimeoutError, RuntimeError),
                       match=r"Timed out waiting 3000ms|did not finish in 3"):
        launch.run(dist_fns.hang_on_rank_one, nprocs=2, timeout_s=3)


def test_bad_arguments():
    with pytest.raises(ValueError, match="nprocs must be >= 1"):
        launch.run(dist_fns.rank_sum, nprocs=0)
    with pytest.raises(ValueError, match="module-level functions"):
        launch.run(lambda: 1, nprocs=2)
    with pytest.raises(ValueError, match="backend must be gloo or nccl"):
        launch.run(dist_fns.rank_sum, nprocs=2, backend="mpi")


def test_rank_device_is_the_cpu_under_gloo_and_needs_a_group():
    out = launch.run(launch.rank_device, nprocs=2, timeout_s=60)
    assert [str(r.value) for r in out] == ["cpu", "cpu"]
    with pytest.raises(ValueError, match="needs a process group"):
        launch.rank_device()


def test_threads_sets_and_restores_the_count_as_block_and_decorator():
    from trainbook.launch import threads
    before = torch.get_num_threads()

    @threads(1)
    def inside():
        return torch.get_num_threads()

    assert inside() == 1 and torch.get_num_threads() == before
    with pytest.raises(RuntimeError), threads(1):
        raise RuntimeError("restored even so")
    assert torch.get_num_threads() == before
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="whole number >= 1"), threads(bad):
            pass
