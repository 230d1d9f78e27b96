"""Checkpointing (book/failures/checkpointing): the full state's bytes against the memory
estimator and a real checkpoint; a writer SIGKILLed mid-write (the atomic path keeps the old
checkpoint, a plain torch.save leaves a file that does not load); checksums recorded after the
data catch a flipped bit that torch.load accepts, and resume refuses the file; weights_only
refuses a pickle that runs code; DCP reshards 1 -> 2, 2 -> 1 and FSDP -> TP bit for bit;
every rank's random state comes back; asynchronous saves write the state as it was; the
`ckpt` command inspects, verifies and converts (safetensors and transformers included)."""

import dataclasses
import hashlib
import json

import pytest
import torch

from trainbook import launch
from trainbook.__main__ import main
from trainbook.compute import cost
from trainbook.configs import param_counts, resolve
from trainbook.failures import checkpointing as C
from trainbook.failures import ckpt_layouts as L
from trainbook.failures import ckpt_tools as T
from trainbook.train import latest_checkpoint, load_checkpoint, train
from trainbook.train.checkpoint import (
    RATE_ENV,
    SUMS,
    AsyncCheckpointer,
    CorruptCheckpoint,
    prune_checkpoints,
    read_sums,
    rng_state,
    save_checkpoint,
    set_rng_state,
)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny run with a checkpoint every 2 steps: (config, checkpoint folder)."""
    folder = tmp_path_factory.mktemp("ckpt")
    cfg = C.tiny_config(steps=4, ckpt_dir=str(folder), ckpt_every=2)
    with launch.threads(1):
        train(cfg)
    return cfg, folder


# ---------------------------------------------------------------------------------------------
# What a checkpoint costs
# ---------------------------------------------------------------------------------------------

def test_full_state_is_twelve_bytes_per_parameter_and_matches_a_real_checkpoint(trained):
    n = param_counts(resolve("llama-3-405b"))["total"]
    for dtype in ("bf16", "fp32"):
        b = cost.checkpoint_bytes("llama-3-405b", dtype)
        assert b == {"weights": 4 * n, "optimizer": 8 * n}
    assert cost.checkpoint_bytes("llama-3-405b", optimizer="sgd")["optimizer"] == 4 * n
    stall = cost.checkpoint_seconds(12 * n, cost.LLAMA3_STORAGE_GBPS)
    assert stall == pytest.approx(12 * n / 2e12) and 2 < stall < 3
    with pytest.raises(ValueError, match="write bandwidth"):
        cost.checkpoint_seconds(1e9, 0)
    cfg, folder = trained
    got = C.model_bytes_check(cfg, load_checkpoint(folder / "step-000004.pt"))
    assert got["weights"] == got["weights_est"] and got["moments"] == got["moments_est"]


def test_stall_table_and_the_interval_an_overhead_budget_allows():
    rows = C.stall_table(per_node_gbps=(0.1, 1.0, 10.0), overhead=0.01)
    total = sum(cost.checkpoint_bytes("llama-3-405b").values())
    assert rows[0]["stall_s"] == pytest.approx(total / (2048 * 0.1e9))
    assert rows[2]["job_GBps"] == cost.LLAMA3_STORAGE_GBPS  # capped by the file system
    for r in rows:
        assert r["min_interval_min"] == pytest.approx(r["stall_s"] / 0.01 / 60)
    assert rows[0]["young_interval_min"] > rows[1]["young_interval_min"]
    with pytest.raises(ValueError, match="overhead must be a fraction"):
        C.stall_table(overhead=5)


# ---------------------------------------------------------------------------------------------
# Crashes, corruption, unsafe pickles
# ---------------------------------------------------------------------------------------------

def test_a_sigkill_mid_write_keeps_the_old_checkpoint_only_when_the_write_is_atomic(tmp_path):
    naive, atomic = C.crash_during_write(tmp_path, mbytes=2, rate_mbps=2)
    for r in (naive, atomic):
        assert r["exit"] == -9 and 0 < r["bytes_when_killed"] < r["full_bytes"]
    assert not naive["loads"] and naive["files"]["latest.pt"] < naive["full_bytes"]
    assert atomic["loads"] and atomic["step"] == 1  # the old checkpoint, whole
    assert atomic["files"]["latest.pt"] == atomic["full_bytes"]
    assert 0 < atomic["files"]["latest.pt.tmp"] < atomic["full_bytes"]


def test_prune_removes_half_written_checkpoints_and_their_checksums(tmp_path):
    for step in (1, 2, 3):
        save_checkpoint(tmp_path / f"step-{step:06d}.pt", {"step": step})
    (tmp_path / "step-000002.pt.tmp").write_bytes(b"half a checkpoint")
    (tmp_path / "step-000004.pt.tmp").write_bytes(b"still being written?")
    gone = prune_checkpoints(tmp_path, keep=2)
    assert sorted(p.name for p in gone) == ["step-000001.pt", "step-000002.pt.tmp"]
    assert sorted(read_sums(tmp_path)) == ["step-000002.pt", "step-000003.pt"]
    assert (tmp_path / "step-000004.pt.tmp").exists()  # newer than every complete checkpoint


def test_checksums_catch_a_flipped_bit_that_torch_load_accepts(trained, tmp_path, capsys):
    cfg, folder = trained
    work = tmp_path / "ckpt"
    work.mkdir()
    for name in ("step-000002.pt", "step-000004.pt", SUMS):
        (work / name).write_bytes((folder / name).read_bytes())
    path = work / "step-000004.pt"
    sums = read_sums(work)
    assert sums[path.name] == hashlib.sha256(path.read_bytes()).hexdigest()  # sha256sum -c
    assert main(["ckpt", "verify", str(path)]) == 0
    before = torch.load(path, weights_only=True)
    flipped = C.flip_bit(path)
    after = torch.load(path, weights_only=True)  # loads: no error, a different weight
    assert abs(flipped["after"]) > 1e30 * abs(flipped["before"])
    changed = [k for k in before["model"] if not torch.equal(before["model"][k], after["model"][k])]
    assert changed == ["blocks.0.attn.q.weight"]
    with pytest.raises(ValueError, match="has no model tensor 'nope'"):
        C.flip_bit(path, "nope")
    with pytest.raises(CorruptCheckpoint, match="step-000002.pt"):  # names the fallback
        load_checkpoint(path)
    capsys.readouterr()
    assert main(["ckpt", "verify", str(path)]) == 1
    out = capsys.readouterr().out
    assert "FAIL checksums" in out and "bytes changed after it was written" in out
    with pytest.raises(CorruptCheckpoint, match="is corrupt"):
        train(dataclasses.replace(cfg, ckpt_dir=str(work), resume=True, steps=6))
    (work / SUMS).unlink()  # without checksums: verify cannot vouch for it
    assert main(["ckpt", "verify", str(path)]) == 1
    assert "no checksum recorded" in capsys.readouterr().out


def test_weights_only_refuses_a_pickle_that_runs_code(tmp_path):
    marker = tmp_path / "ran.txt"
    path = C.write_pickle_payload(tmp_path / "evil.pt", marker)
    refused = C.try_load(path, weights_only=True)
    assert "Unsupported global" in refused and "exec" in refused and not marker.exists()
    with pytest.raises(ValueError, match="does not load as a trainbook checkpoint"):
        T.inspect(path)
    assert not marker.exists()
    assert C.try_load(path, weights_only=False) == "loaded" and marker.exists()


# ---------------------------------------------------------------------------------------------
# DCP across world sizes and layouts; every rank's random state
# ---------------------------------------------------------------------------------------------

def ranks_round(one_process_dcp: str, out: str, trainer_dir: str, cfg: dict) -> dict:
    """On 2 ranks: load a 1-process DCP checkpoint under FSDP and under TP, save it again from
    the FSDP layout, train under FSDP with DCP checkpoints, and save and restore each rank's
    own random stream."""
    import torch.distributed as dist

    from trainbook.train.checkpoint import save_sharded

    tp = L.sharded_state(one_process_dcp, tp=2)
    parts, optimizer, extra = L.load_under(one_process_dcp, dp_shard=2)
    fsdp = L.full_state(parts, optimizer)
    save_sharded(out, parts, optimizer, extra)
    L.train_on_ranks({**cfg, "dp_shard": 2, "ckpt_dir": trainer_dir})
    torch.manual_seed(100 + dist.get_rank())  # ranks with streams of their own
    state = rng_state()
    expected = torch.rand(3)
    torch.manual_seed(7)
    set_rng_state(state)
    return {"fsdp": fsdp, "tp": tp, "rng_ok": torch.equal(torch.rand(3), expected),
            "ranks_in_state": len(state.get("ranks", []))}


def test_dcp_reshards_across_world_sizes_and_layouts_bit_for_bit(trained, tmp_path):
    cfg, folder = trained
    single = folder / "step-000004.pt"
    one = T.to_dcp(single, tmp_path / "one")  # written by one process
    original = L.sharded_state(str(one))
    state = load_checkpoint(single)
    assert L.same_state({"model": original["model"]}, {"model": state["model"]}) == []
    small = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("ckpt_dir",
                                                                          "ckpt_every")}
    small.update(steps=3, grad_accum=1, batch_size=2)
    res = launch.run(ranks_round, 2, args=(str(one), str(tmp_path / "two"),
                                           str(tmp_path / "trainer"), small), timeout_s=240)
    for r in res:
        assert L.same_state(r.value["fsdp"], original) == []  # 1 -> 2 under FSDP
        assert L.same_state(r.value["tp"], original) == []  # 1 -> 2 under TP
        assert r.value["rng_ok"] and r.value["ranks_in_state"] == 2
    back = L.sharded_state(str(tmp_path / "two"))  # 2 -> 1
    assert L.same_state(back, original) == []
    # the trainer's own DCP folder, saved under FSDP on 2 ranks: the ckpt command reads it
    trainer_ckpt = latest_checkpoint(tmp_path / "trainer")
    assert trainer_ckpt.is_dir() and T.verify(trainer_ckpt)["ok"]
    info = T.inspect(trainer_ckpt)
    assert info["kind"] == "DCP folder" and info["step"] == 3 and info["layout"]["zero"] == 3
    assert {"model", "optim", "rng"} <= {r["component"] for r in info["components"]}
    assert len(load_checkpoint(trainer_ckpt / "extra.pt")["rng"]["ranks"]) == 2
    assert main(["ckpt", "convert", str(trainer_ckpt), "--to", "single", "--out",
                 str(tmp_path / "conv" / "step-000003.pt")]) == 0
    conv = load_checkpoint(tmp_path / "conv" / "step-000003.pt")
    assert conv["step"] == 3 and T.verify(tmp_path / "conv" / "step-000003.pt")["ok"]
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(trainer_ckpt, tmp_path / "native.pt")  # PyTorch's own converter
    native = torch.load(tmp_path / "native.pt", weights_only=True)["model"]
    assert all(torch.equal(native[k], conv["model"][k]) for k in conv["model"])


# ---------------------------------------------------------------------------------------------
# Asynchronous saves
# ---------------------------------------------------------------------------------------------

def test_async_saves_write_the_state_as_it_was_and_report_errors(tmp_path, monkeypatch):
    monkeypatch.setenv(RATE_ENV, "0.5")  # a slow disk: the write is still going when we change
    w = torch.arange(100_000, dtype=torch.float32)
    writer = AsyncCheckpointer()
    writer.save(tmp_path / "a.pt", {"w": w})
    # the 400 kB at 0.5 MB/s take 0.8 s: the write is still going when save returns (a
    # behaviour, not a timing: the thread cannot have finished before its first 0.1 s sleep)
    assert writer._thread is not None and writer._thread.is_alive()
    w.add_(1.0)  # the next step changes the weights in place
    writer.wait()
    assert torch.equal(load_checkpoint(tmp_path / "a.pt")["w"], torch.arange(100_000.0))
    monkeypatch.delenv(RATE_ENV)
    (tmp_path / "file").write_text("x")
    writer.save(tmp_path / "file" / "b.pt", {"w": w})  # its folder is a file
    with pytest.raises(OSError):
        writer.wait()
    r = C.save_stall(tmp_path / "stall", mbytes=2, repeats=1)
    assert r["snapshot_ok"] and r["async_total_s"] >= r["async_stall_s"] > 0


def test_the_trainer_with_async_checkpoints_resumes_bit_for_bit(tmp_path):
    cfg = C.tiny_config(steps=6, ckpt_dir=str(tmp_path), ckpt_every=2, ckpt_async=True)
    with launch.threads(1):
        whole = train(dataclasses.replace(cfg, ckpt_dir=None, ckpt_every=0, ckpt_async=False))
        train(dataclasses.replace(cfg, stop_after=4))
        assert load_checkpoint(latest_checkpoint(tmp_path))["step"] == 4
        resumed = train(dataclasses.replace(cfg, resume=True))
    assert resumed.losses() == whole.losses()
    with pytest.raises(ValueError, match="--ckpt-async is wired for one process and DDP"):
        train(dataclasses.replace(cfg, dp_shard=2, ckpt_dir=str(tmp_path / "fsdp")))


# ---------------------------------------------------------------------------------------------
# The ckpt command and the formats it writes
# ---------------------------------------------------------------------------------------------

def test_ckpt_inspect_and_convert_to_safetensors_and_transformers(trained, tmp_path, capsys):
    cfg, folder = trained
    path = folder / "step-000004.pt"
    assert main(["ckpt", "inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "step 4" in out and "optimizer" in out and "data position" in out
    assert main(["ckpt", "inspect", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    by = {r["component"]: r for r in info["components"]}
    assert by["model"]["bytes"] == 4 * param_counts(T.reference_model(
        load_checkpoint(path)["model_config"], "meta").cfg)["total"]
    st = tmp_path / "w.safetensors"
    assert main(["ckpt", "convert", str(path), "--to", "safetensors", "--out", str(st)]) == 0
    model = T.from_safetensors(st)
    state = load_checkpoint(path)["model"]
    assert all(torch.equal(model.state_dict()[k], state[k]) for k in state)
    assert main(["ckpt", "convert", str(path), "--to", "hf", "--out", str(tmp_path / "hf")]) == 0
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        ours, _ = model(x)
        theirs = hf(x).logits
    assert (ours - theirs).abs().max().item() < 1e-4


@pytest.mark.parametrize("argv, message", [
    (["ckpt"], "give an action"),
    (["ckpt", "list", "x.pt"], "give an action"),
    (["ckpt", "inspect"], "needs a checkpoint path"),
    (["ckpt", "inspect", "missing.pt"], "no checkpoint at missing.pt"),
    (["ckpt", "verify", "x.pt", "--to", "hf"], "--to and --out are for ckpt convert"),
    (["ckpt", "convert", "x.pt", "--to", "hf"], "needs --to"),
    (["ckpt", "convert", "x.pt", "--to", "dcp", "--out", "full"], "folder with files in it"),
    (["ckpt", "convert", "x.pt", "--to", "single", "--out", "x.pt"], "the checkpoint itself"),
    (["ckpt", "convert", "x.pt", "--to", "single", "--out", "one.pt"], "already a single file"),
    (["ckpt", "inspect", "emptydir"], "not a complete DCP checkpoint"),
    (["ckpt", "inspect", "junk.pt"], "does not load as a trainbook checkpoint"),
])
def test_ckpt_bad_input_is_one_line(argv, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    save_checkpoint(tmp_path / "x.pt", {"step": 1})
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("x")
    (tmp_path / "emptydir").mkdir()
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err
