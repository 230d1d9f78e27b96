import json
import subprocess
import sys

import pytest

from trainbook.__main__ import main
from trainbook.commands import COMMANDS


def test_top_level_help_lists_every_command():
    out = subprocess.run([sys.executable, "-m", "trainbook", "--help"], capture_output=True, text=True, timeout=60)
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
    assert main(["train", "--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--n-kv-heads", "1",
                 "--d-ff", "32", "--vocab-size", "300", "--seq-len", "16", "--batch-size", "4",
                 "--steps", "3", "--warmup-steps", "1", "--no-progress", "--cache-dir", cache_dir,
                 "--json-out", str(out)]) == 0
    assert len(json.loads(out.read_text())["history"]) == 3


@pytest.mark.parametrize("argv, message", [
    (["params", "--model", "llama-9"], "unknown model 'llama-9'"),
    (["params", "--model", "missing/config.json"], "no config.json at"),
    (["train", "--steps", "0"], "steps must be >= 1"),
    (["train", "--dtype", "fp64"], "dtype must be fp32, bf16 or fp16"),
])
def test_bad_input_is_one_clear_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err
