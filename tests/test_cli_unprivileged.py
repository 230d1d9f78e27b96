"""File-system errors as an ordinary user sees them (issue 26): root ignores file modes, so
these cases run the commands as the unprivileged user `nobody` (setpriv), against a folder that
user cannot write. Each is one `error:` line, exit status 2, before any work; a failure in the
middle of a run (a full disk) is one line naming the path and the room left."""

import errno
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from trainbook.__main__ import os_error_line

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                                reason="needs root and setpriv to run as an unprivileged user")
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
TINY = ["--steps", "2", "--warmup-steps", "0", "--d-model", "32", "--n-layers", "1",
        "--n-heads", "2", "--tokenizer", "bytes"]


@pytest.fixture(scope="module")
def locked():
    """A folder everyone can read and only root can write, with a file in it."""
    folder = tempfile.mkdtemp(prefix="trainbook-ro-", dir="/tmp")
    os.chmod(folder, 0o755)
    with open(os.path.join(folder, "input.txt"), "w") as fh:
        fh.write("To be, or not to be, that is the question.\n" * 200)
    os.chmod(os.path.join(folder, "input.txt"), 0o644)
    yield folder
    shutil.rmtree(folder)


CASES = {
    "train --ckpt-dir": ["train", *TINY, "--ckpt-dir", "{ro}/ckpt"],
    "train --json-out": ["train", *TINY, "--json-out", "{ro}/run.json"],
    "tokenizer --out": ["tokenizer", "train", "--input", "{ro}/input.txt", "--vocab-size", "300",
                        "--out", "{ro}/tok.json"],
    "slurm --output": ["slurm", "--output", "{ro}/job.sbatch"],
    "records --root": ["records", "list", "--root", "{ro}"],
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_an_unwritable_path_is_one_line_as_an_ordinary_user(case, locked):
    argv = [a.replace("{ro}", locked) for a in CASES[case]]
    out = subprocess.run([*NOBODY, sys.executable, "-m", "trainbook", *argv], cwd=locked,
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "HOME": locked})
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    assert "Traceback" not in out.stderr
    assert sorted(os.listdir(locked)) == ["input.txt"]  # nothing written


def test_a_mid_run_file_system_error_is_one_line_that_says_where():
    full = OSError(errno.ENOSPC, "No space left on device", "/tmp/x/step-000010.pt")
    line = os_error_line(full)
    assert line.startswith("No space left on device: /tmp/x/step-000010.pt (")
    assert "bytes free there" in line
    denied = os_error_line(PermissionError(errno.EACCES, "Permission denied", "/ro/a.json"))
    assert "not writable by this user" in denied


def test_main_turns_an_os_error_and_a_closed_pipe_into_exit_statuses(monkeypatch, capsys):
    from trainbook import __main__ as M

    def disk_full(args):
        raise OSError(errno.ENOSPC, "No space left on device", "/tmp/out.json")

    monkeypatch.setattr(M.COMMANDS["formats"], "run", disk_full)
    assert M.main(["formats"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: No space left on device: /tmp/out.json")
    # `true` has exited before Python starts writing: every write meets a closed pipe
    out = subprocess.run(["bash", "-c", f"{sys.executable} -m trainbook hardware | true; "
                                        "echo ${PIPESTATUS[0]}"],
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "141" and out.stderr == "", out.stderr
