import json
import subprocess
import sys

import pytest

from trainbook.__main__ import main
from trainbook.commands import COMMANDS


def test_top_level_help_lists_every_command():
    out = subprocess.run([sys.executable, "-m", "trainbook", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0
    for name in COMMANDS:
        assert name in out.stdout


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_command_has_help(name, capsys):
    with pytest.raises(SystemExit) as e:
        main([name, "--help"])
    assert e.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_train_help_documents_every_option(capsys):
    from trainbook.train import config_fields
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for f in config_fields():
        assert "--" + f.name.replace("_", "-") in out
        assert f.metadata["help"].split()[0] in out


def test_params_llama_3_8b(capsys):
    assert main(["params", "--model", "llama-3-8b"]) == 0
    assert "8,030,261,248" in capsys.readouterr().out


def test_params_from_config_json(hf_dir, capsys):
    assert main(["params", "--model", str(hf_dir / "llama-3-8b.json"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["params"]["total"] == 8_030_261_248


def test_hardware_json(capsys):
    assert main(["hardware", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert any(r["name"] == "h100-sxm" for r in rows)


def test_train_command_runs(cache_dir, tmp_path, capsys):
    out = tmp_path / "run.json"
    assert main(["train", "--d-model", "32", "--n-layers", "1", "--n-heads", "2",
                 "--n-kv-heads", "1", "--d-ff", "32", "--vocab-size", "300", "--seq-len", "16",
                 "--batch-size", "4", "--steps", "3", "--warmup-steps", "1", "--no-progress",
                 "--cache-dir", cache_dir, "--json-out", str(out)]) == 0
    assert len(json.loads(out.read_text())["history"]) == 3


@pytest.mark.parametrize("argv, message", [
    (["params", "--model", "llama-9"], "unknown model 'llama-9'"),
    (["params", "--model", "missing/config.json"], "no config.json at"),
    (["train", "--steps", "0"], "steps must be >= 1"),
    (["train", "--dtype", "fp64"], "dtype must be one of fp32, bf16, fp16, fp8-emulated"),
])
def test_bad_input_is_one_clear_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


# ---------------------------------------------------------------------------------------------
# One command line: every tool is a command with --help and --json; argparse lives only here
# ---------------------------------------------------------------------------------------------

TORCHRUN_COMMANDS = ("collectives", "zero", "tp", "cp", "ep")


def _subparser(name):
    from trainbook.__main__ import build_parser
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return sub.choices[name]


def test_the_torchrun_commands_are_listed():
    out = subprocess.run([sys.executable, "-m", "trainbook", "--help"], capture_output=True,
                         text=True, timeout=60)
    listed = {line.split()[0] for line in out.stdout.splitlines() if line.startswith("    ")}
    assert set(TORCHRUN_COMMANDS) <= listed & set(COMMANDS)


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_command_has_json(name):
    options = {s for a in _subparser(name)._actions for s in a.option_strings}
    assert "--json" in options


def test_only_the_command_line_imports_argparse():
    """Library modules are called, not run: their options live in trainbook/commands/."""
    import ast
    package = __import__("pathlib").Path(__import__("trainbook").__file__).parent
    offenders = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package)
        if rel.parts[0] == "commands" or rel.as_posix() == "__main__.py":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) else [])
            if "argparse" in names:
                offenders.append(f"{rel}:{node.lineno}")
            if (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
                    and getattr(node.test.left, "id", None) == "__name__"):
                offenders.append(f"{rel}:{node.lineno} (__main__ block)")
    assert not offenders, f"move these command-line programs into trainbook/commands/: {offenders}"


@pytest.mark.parametrize("argv", [
    ["chinchilla", "--flops", "1e21"],
    ["cost", "--model", "llama-3-8b", "--tokens", "1T", "--gpus", "8"],
    ["flops", "--model", "tiny-llama", "--seq-len", "64"],
    ["memory", "--model", "tiny-llama", "--seq-len", "64"],
    ["plan", "--model", "tiny-llama", "--gpus", "2", "--global-batch-tokens", "1024",
     "--seq-len", "64", "--top", "2"],
    ["mamf", "--m", "16", "--n", "16", "--k", "16", "--dtype", "fp32", "--device", "cpu", "--quick",
     "--flush-mib", "0"],
], ids=lambda a: a[0])
def test_cheap_commands_print_json(argv, capsys):
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)


def test_train_json_is_the_final_summary(cache_dir, capsys):
    assert main(["train", "--d-model", "32", "--n-layers", "1", "--n-heads", "2",
                 "--n-kv-heads", "1", "--d-ff", "32", "--vocab-size", "300", "--seq-len", "16",
                 "--batch-size", "4", "--steps", "2", "--warmup-steps", "1", "--no-progress",
                 "--cache-dir", cache_dir, "--json"]) == 0
    out = capsys.readouterr()
    s = json.loads(out.out)  # the log went to stderr
    assert s["steps"] == 2 and s["tokens"] == 2 * 4 * 16
    assert s["final_loss"] > 0 and s["val_loss"] > 0 and s["tokens_per_s"] > 0


def test_torchrun_commands_print_json_on_rank_zero():
    """zero, tp, cp, ep and collectives with tiny shapes, all in one 2-rank group of the
    launcher."""
    import dist_fns

    from trainbook import launch

    argvs = [["zero", "--kinds", "zero1,zero3", "--steps", "1", "--json"],
             ["tp", "--kind", "scratch_sp", "--d-model", "32", "--heads", "4", "--kv-heads", "2",
              "--seq-len", "16", "--batch", "2", "--steps", "1", "--json"],
             ["cp", "--kind", "ring_zigzag", "--seq-len", "16", "--steps", "1", "--json"],
             ["ep", "--experts", "4", "--steps", "1", "--global-batch", "4", "--json"],
             ["collectives", "--ops", "all_reduce", "--payload-range", "1KiB", "4KiB",
              "--iters", "1", "--json"]]
    rank0, rank1 = (r.value for r in launch.run(dist_fns.cli_json, 2, args=(argvs,), timeout_s=150))
    assert [code for code, _ in rank0 + rank1] == [0] * 10
    assert all(doc is None for _, doc in rank1)  # only rank 0 prints
    zero, tp, cp, ep, coll = (doc for _, doc in rank0)
    assert [k["kind"] for k in zero["kinds"]] == ["zero1", "zero3"]
    assert all(k["max_diff"]["loss"] < 1e-5 for k in zero["kinds"])
    assert zero["kinds"][1]["bytes_per_step_psi"]["all_gather"] == pytest.approx(2, rel=0.05)
    assert tp["rows"][0]["kind"] == "scratch_sp" and tp["rows"][0]["reduce_scatter"] > 0
    assert cp["ranks"] == 2 and cp["max_diff"]["loss"] < 1e-5
    assert len(ep["losses"]) == 1 and len(ep["tokens_per_expert"][0]) == 4
    assert coll["meta"]["ranks"] == 2 and [r["bytes"] for r in coll["rows"]] == [1024, 4096]


def test_torchrun_json_stdout_is_only_json():
    """Under real torchrun, `-m trainbook <command> --json` leaves nothing but rank 0's JSON on
    stdout."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "trainbook", "cp", "--kind", "allgather_kv", "--seq-len", "16", "--steps", "1",
           "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["kind"] == "allgather_kv"


@pytest.mark.parametrize("argv, env, message", [
    (["zero", "--kinds", "zero1,zero9"], {}, "unknown ['zero9']"),
    (["zero"], {}, "start it with torchrun"),
    (["tp", "--d-model", "30", "--heads", "4"], {}, "hidden size 30 is not divisible by 4 heads"),
    (["tp"], {"WORLD_SIZE": "3"}, "tp 3 does not divide the 8 attention heads"),
    (["cp", "--seq-len", "64"], {"WORLD_SIZE": "3"}, "not divisible by 6"),
    (["cp"], {}, "start it with torchrun"),
    (["ep", "--experts", "2", "--top-k", "3"], {},
     "top_k 3 is larger than the number of experts 2"),
    (["ep", "--experts", "8"], {"WORLD_SIZE": "3"}, "8 experts do not split over 3"),
    (["ep", "--experts", "4", "--global-batch", "6"], {"WORLD_SIZE": "4"},
     "--global-batch 6 does not split"),
    (["collectives", "--payload-range", "64M", "1GiB"], {}, "a bare M is ambiguous"),
    (["collectives", "--ops", ","], {}, "names no collective"),
    (["collectives"], {}, "start it with torchrun"),
    (["train", "--json-out", "/no/such/folder/run.json"], {}, "its folder does not exist"),
])
def test_bad_input_to_the_commands_is_one_line(argv, env, message, capsys, monkeypatch):
    """Checked before any process group or training starts: one `error:` line, exit status 2."""
    for key in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    if env:
        monkeypatch.setenv("RANK", "0")
        for key, value in env.items():
            monkeypatch.setenv(key, value)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("argv", [["zero", "--steps", "0"], ["cp", "--seq-len", "-4"],
                                  ["collectives", "--warmup", "-1"], ["tp", "--kind", "megatron"]])
def test_bad_counts_are_argparse_errors(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    assert [line for line in err.splitlines() if "error:" in line] == [err.splitlines()[-1]]


def test_help_keeps_the_example_commands_on_their_own_lines(capsys):
    """argparse's default formatter reflowed each command's examples into one paragraph."""
    from trainbook.__main__ import main

    with pytest.raises(SystemExit):
        main(["records", "--help"])
    out = capsys.readouterr().out
    assert "\n  python -m trainbook records list " in out
    assert "\n  python -m trainbook records regen clipping-divergence " in out
