"""Commands never show a traceback: bad input to every command and option is one `error:` line.

The cases are generated from the parser itself (trainbook.__main__.build_parser), so a new command
or option is covered the day it is added: for every option, by the kind argparse says it is
(whole number, number, choice, name, path), the values a person gets wrong (missing, negative,
zero, non-numeric, huge, unknown model or GPU, a broken config.json, a path that cannot be
written...). For each case: exit status 2, exactly one line on stderr that starts with `error:`,
names the bad value or option and says what to do, no traceback, and nothing written.

Values that may be legitimate (zero, huge) must not crash: the command either rejects them in
one line or accepts them. Accepted input is stopped where the real work would start (the trainer,
a benchmark sweep, joining a process group): the stubs below raise `Reached`, so no case trains,
benchmarks or waits on a rendezvous. `python -m pytest tests/test_cli_bad_input.py -s` prints
how many cases ran.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from terminal import say

from trainbook.__main__ import build_parser, main
from trainbook.commands import COMMANDS, _args

ROOT = Path(__file__).resolve().parents[1]
CASE_TIMEOUT_S = 30  # a case that runs longer hangs on its input: a failure, not a wait
RAN: Counter = Counter()  # cases run, by kind (printed at the end)

# A valid command line for each command: the case changes one option of it. Commands not listed
# (added since) get their generic cases (unknown option, missing required, wrong type) only.
ALIGN_DATA = Path(__file__).resolve().parents[1] / "book" / "alignment" / "data"  # stored policies
BASE: dict[str, list[str]] = {
    "params": ["--model", "tiny-llama"],
    "hardware": [],
    "train": ["--steps", "4", "--warmup-steps", "1", "--json-out", "run.json"],
    "benchtrain": ["--models", "tiny-llama", "--output", "bench.json"],
    "chinchilla": ["--flops", "1e21"],
    "ckpt": ["convert", "ckpt.pt", "--to", "single", "--out", "one.pt"],
    "collectives": ["--json-out", "coll.json"],
    "cost": ["--model", "llama-3-8b", "--tokens", "15T"],
    "cp": [],
    "ep": [],
    "flops": ["--model", "llama-3-8b", "--seq-len", "8192"],
    "formats": [],
    "health": ["--checks", "xid", "--kernel-log", "afile"],
    "gpumeasure": ["--out", "gpu"],
    "mamf": ["--m", "64", "--n", "64", "--k", "64", "--dtype", "fp32", "--output", "mamf.jsonl"],
    "memory": ["--model", "llama-3-8b"],
    "nan-hunt": ["--steps", "2", "--d-model", "32", "--n-layers", "1", "--tokenizer", "bytes"],
    "plan": ["--model", "llama-3-8b", "--gpus", "8", "--global-batch-tokens", "1048576",
             "--seq-len", "8192"],
    "slurm": ["--output", "job.sbatch"],
    "export-hf": ["--checkpoint", "ckpt.pt", "--out", "hf"],
    "import-hf": ["hf", "--out", "model.pt"],
    "eval": ["base", "--items", "5"],
    "collapse": ["--out", "collapse.json"],
    "lora": ["--model", "tiny-llama"],
    "moe-params": ["--model", "mixtral-8x7b"],
    "multimodal": ["--model", "llama-2-7b"],
    "dpo": ["--steps", "1", "--prompts", "32", "--eval-items", "2"],
    "grpo": ["--steps", "1", "--prompts", "2", "--group", "2", "--eval-items", "2"],
    "reward-model": ["--start", str(ALIGN_DATA), "--out", "rm"],
    "ppo": ["--start", str(ALIGN_DATA), "--reward", str(ALIGN_DATA), "--out", "ppo"],
    "tp": [],
    "zero": [],
    "records": ["check", "lm-eval-check"],
}
# Options whose negative values are legitimate.
NEGATIVE_OK = {("train", "--seed")}
# String options that name a thing: an unknown name must be rejected.
NAMES = {"--model": "no-such-model", "--models": "no-such-model", "--gpu": "no-such-gpu",
         "--dtype": "fp64x", "--device": "tpu9", "--size": "enormous", "--tokenizer": "wordpiece",
         "--corpus": "no-such-corpus", "--objective": "no-such-objective",
         "--optimizer": "no-such-optimizer", "--schedule": "no-such-schedule",
         "--decay-shape": "no-such-shape", "--init": "no-such-init", "--pp-schedule": "no-such",
         "--recompute": "no-such", "--kinds": "zero9", "--ops": "all_sum", "--layout": "tp=x",
         "--explain": "tp=x", "--tokens": "lots", "--ckpt-interval-minutes": "soon",
         "--payload-range": "lots"}
# Options that name a file or folder to write: must not be written when the input is bad, and a
# path that cannot be written is one error line. Inputs to read: a missing one is one error line.
OUTPUTS = {"--output", "--json-out", "--out", "--ckpt-dir", "--cache-dir"}
INPUTS = {"--resume-from"}
INT_TYPES = {int, _args.positive_int, _args.non_negative_int}
HUGE = "1" + "0" * 30
FIX_WORDS = ("must", "use ", "give", "expected", "choose", "should", "not ", "unknown", "e.g.",
             "--help", "between", "required", "only", "need", "exceed", "divisible", "create",
             "start it", "pass ", "write ", "lacks", "supported", "invalid", "valid", "from ",
             "pick", "at most", "at least", "larger", "smaller", "in [", "in (")


class Reached(BaseException):
    """Raised where a command's real work would start: the input was accepted."""


def _reached(*_a, **_k):
    raise Reached


@pytest.fixture(autouse=True)
def _stubs(monkeypatch):
    """Stop accepted input where the work starts; pretend to be rank 0 of 2 under torchrun, so
    the torchrun commands check their input against a world size."""
    import trainbook.train as train_pkg
    from trainbook import records
    from trainbook.align import ppo_study, reward_study
    from trainbook.bench import hf, matmul
    from trainbook.commands import _torchrun, gpumeasure

    monkeypatch.setattr(train_pkg, "train", _reached)
    monkeypatch.setattr(hf, "train_speed", _reached)
    monkeypatch.setattr(matmul, "sweep", _reached)
    monkeypatch.setattr(gpumeasure, "_Run", _reached)
    monkeypatch.setattr(_torchrun, "process_group", _reached)
    monkeypatch.setattr(ppo_study, "write_runs", _reached)
    monkeypatch.setattr(reward_study, "write_reward_model", _reached)
    monkeypatch.setattr(reward_study, "write_overopt", _reached)
    monkeypatch.setattr(records, "check", _reached)
    monkeypatch.setattr(records, "regen", _reached)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")


@pytest.fixture(scope="module", autouse=True)
def _report(request):
    yield
    if RAN:
        say(request, f"test_cli_bad_input: {sum(RAN.values())} bad-input cases "
                     f"({', '.join(f'{k} {v}' for k, v in sorted(RAN.items()))})")


# ------------------------------------------------------------------------------------------------
# The cases, generated from the parser
# ------------------------------------------------------------------------------------------------

def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


SUBPARSERS = subparsers()


def options(sub: argparse.ArgumentParser) -> list[argparse.Action]:
    """The options that take a value (flags like --json have nothing to get wrong)."""
    return [a for a in sub._actions if a.option_strings and a.nargs != 0
            and not isinstance(a, (argparse._HelpAction, argparse.BooleanOptionalAction))]


def flag(a: argparse.Action) -> str:
    return max(a.option_strings, key=len)


def kind(command: str, a: argparse.Action) -> str:
    if a.choices is not None:
        return "choice"
    if a.type in INT_TYPES:
        return "int"
    if a.type is float or (a.type is not None and a.type.__name__ == "_flops"):
        return "float"
    name = flag(a)
    if name in OUTPUTS:
        return "output"
    if name in INPUTS:
        return "input"
    return "name"


def without(argv: list[str], name: str) -> list[str]:
    """argv less option `name` and its values."""
    argv = list(argv)
    if name in argv:
        i = argv.index(name)
        j = i + 1
        while j < len(argv) and not argv[j].startswith("--"):
            j += 1
        del argv[i:j]
    return argv


def with_option(command: str, a: argparse.Action, values: list[str]) -> list[str]:
    """The base command line with option `a` set to `values` (replacing the base's value, and
    the options it excludes)."""
    base, name = list(BASE.get(command, [])), flag(a)
    for g in SUBPARSERS[command]._mutually_exclusive_groups:  # --m and --m-range: one of them
        if a in g._group_actions:
            for other in g._group_actions:
                base = without(base, flag(other))
    base = without(base, name)
    n = a.nargs if isinstance(a.nargs, int) else 1
    values = values if len(values) >= n else values * n
    return [command, *base, name, *values]


def cases() -> list[tuple[str, list[str], str, str]]:
    """(id, argv, what the error line must name, expectation): 'reject' must be exit 2 with one
    error line; 'no-crash' may also be accepted (exit 0 or stopped at the work)."""
    out = []
    for command, sub in SUBPARSERS.items():
        known = command in BASE
        out.append((f"{command}-unknown-option", [command, *BASE.get(command, []), "--bogus",
                                                  "1"], ("--bogus",), "reject"))
        for a in sub._actions:
            if a.required and a.option_strings and known:  # a positional has no flag
                argv = without(BASE[command], flag(a))
                out.append((f"{command}-missing-{flag(a)}", [command, *argv], (flag(a),),
                            "reject"))
        for g in sub._mutually_exclusive_groups:
            a, b = g._group_actions[:2]
            argv = [command, *BASE.get(command, [])]
            for x in (a, b):
                if flag(x) not in argv:
                    argv += [flag(x)] + (["1"] * (x.nargs if isinstance(x.nargs, int) else 1)
                                         if x.nargs != 0 else [])
            if known:
                out.append((f"{command}-conflict-{flag(a)}-{flag(b)}", argv, (flag(a), flag(b)),
                            "reject"))
        for a in options(sub):
            k, name = kind(command, a), flag(a)
            cid = f"{command}{name}"
            if k in ("int", "float"):
                out.append((f"{cid}=abc", with_option(command, a, ["abc"]), ("abc",), "reject"))
                out.append((f"{cid}=empty", with_option(command, a, [""]), (name,), "reject"))
                if k == "int":
                    out.append((f"{cid}=1.5", with_option(command, a, ["1.5"]), ("1.5",),
                                "reject"))
                else:
                    for v in ("nan", "inf", "1e400"):
                        out.append((f"{cid}={v}", with_option(command, a, [v]),
                                    (v, "inf", name), "reject"))
                if not known:
                    continue
                expect = "no-crash" if (command, name) in NEGATIVE_OK else "reject"
                out.append((f"{cid}=-1", with_option(command, a, ["-1"]), ("-1", name), expect))
                out.append((f"{cid}=0", with_option(command, a, ["0"]), ("0", name), "no-crash"))
                # a huge value may be refused for what it implies: the line need not repeat it
                out.append((f"{cid}=huge", with_option(command, a, [HUGE]), (), "no-crash"))
            elif k == "choice":
                out.append((f"{cid}=bogus", with_option(command, a, ["bogus"]), ("bogus",),
                            "reject"))
            elif not known:
                continue
            elif k == "name":
                bad = NAMES.get(name)
                if bad is None:
                    continue
                out.append((f"{cid}={bad}", with_option(command, a, [bad]),
                            (bad, name, f"'{bad.split('=')[-1]}'"), "reject"))
                if name in ("--model", "--models"):
                    for label, path in CONFIGS.items():
                        out.append((f"{cid}=config-{label}", with_option(command, a, [path]),
                                    (path,), "reject"))
            elif k == "output":
                out.append((f"{cid}=under-a-file", with_option(command, a, ["afile/x/out"]),
                            ("afile",), "reject"))
            elif k == "input":
                out.append((f"{cid}=missing", with_option(command, a, ["missing.pt"]),
                            ("missing.pt",), "reject"))
    out += [(f"{c}-{label}", argv, names, "reject") for c, label, argv, names in EXTRA
            if c in COMMANDS]
    return out


# Broken config.json files (made in the case's folder before it runs). Running as root, file
# permissions do not stop a read or a write, so "unreadable" is a folder or undecodable bytes,
# and "cannot be written" a path under a regular file.
CONFIGS = {"missing": "missing/config.json", "malformed": "bad/config.json",
           "list": "list/config.json", "empty-object": "empty/config.json",
           "binary": "binary/config.json", "folder": "folder.json",
           "empty-file": "blank/config.json"}
CONFIG_FILES = {"bad/config.json": b'{"model_type": "llama", ', "list/config.json": b"[1, 2]",
                "empty/config.json": b"{}", "binary/config.json": b"\xff\xfe\x00\x81",
                "blank/config.json": b"", "latin1.txt": "caf\xe9\n".encode("latin-1"),
                "notjson/tokenizer.json": b"{not json"}

# Combinations each option allows alone but not together, and inputs only the command knows.
EXTRA = [
    ("memory", "zero-without-dp", ["memory", "--model", "llama-3-8b", "--zero", "1"], ("--dp",)),
    ("memory", "ep-not-dividing-dp", ["memory", "--model", "mixtral-8x7b", "--dp", "3",
                                      "--ep", "2"], ("3",)),
    ("plan", "batch-not-multiple", ["plan", "--model", "llama-3-8b", "--gpus", "8",
                                    "--global-batch-tokens", "1000", "--seq-len", "8192"],
     ("1000", "1,000")),
    ("flops", "seq-len-past-max", ["flops", "--model", "gpt2", "--seq-len", "4096"], ("4096",)),
    ("mamf", "no-n", ["mamf", "--m", "64", "--k", "64"], ("--n",)),
    ("mamf", "range-backwards", ["mamf", "--m-range", "64", "32", "8", "--n", "64", "--k",
                                 "64"], ("64",)),
    ("mamf", "range-endless", ["mamf", "--m-range", "1", "1000000000", "1", "--n", "64", "--k",
                               "64"], ("--m-range",)),
    ("tp", "heads-not-dividing", ["tp", "--heads", "8", "--kv-heads", "3"], ("3",)),
    ("ep", "experts-not-dividing", ["ep", "--experts", "3"], ("3",)),
    ("cp", "seq-not-splitting", ["cp", "--seq-len", "5"], ("5",)),
    ("train", "warmup-past-steps", ["train", "--steps", "5", "--warmup-steps", "10"], ("10",)),
    ("train", "kv-heads-not-dividing", ["train", "--n-heads", "4", "--n-kv-heads", "3"], ("3",)),
    ("train", "tp-without-ranks", ["train", "--tp", "4"], ("4",)),
    ("train", "resume-without-ckpt-dir", ["train", "--resume"], ("ckpt_dir", "--ckpt-dir")),
    ("train", "corpus-not-utf8", ["train", "--corpus", "latin1.txt"], ("latin1.txt",)),
    ("train", "corpus-a-folder", ["train", "--corpus", "folder.json"], ("folder.json",)),
    ("train", "tokenizer-not-json", ["train", "--tokenizer", "notjson/tokenizer.json"],
     ("notjson/tokenizer.json",)),
    ("train", "warmup-past-a-short-run", ["train", "--steps", "6"], ("--warmup-steps",)),
    ("collectives", "payload-backwards", ["collectives", "--payload-range", "1MiB", "1KiB"],
     ("1MiB", "payload range")),
    ("cost", "both-mtbf", ["cost", "--model", "llama-3-8b", "--tokens", "15T",
                           "--mtbf-gpu-hours", "1", "--failures-per-million-gpu-hours", "1"],
     ("--failures-per-million-gpu-hours",)),
]


ALL = cases()


# ------------------------------------------------------------------------------------------------
# Running one case in process: exit status, stderr, what was written
# ------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def deadline(seconds: float):
    def fire(*_):
        raise TimeoutError(f"no answer in {seconds} s: the command hangs on this input")
    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def prepare(folder: Path) -> set[str]:
    """The files every case may point at; returns the listing to compare against afterwards."""
    (folder / "afile").write_text("a regular file, not a folder\n")
    (folder / "folder.json").mkdir()
    for rel, data in CONFIG_FILES.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    return listing(folder)


def listing(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


def run_case(argv: list[str], capsys) -> tuple[str, str]:
    """('exit N' | 'reached', stderr); any other exception propagates (that is a traceback)."""
    capsys.readouterr()
    try:
        with deadline(CASE_TIMEOUT_S):
            code = main(argv)
    except SystemExit as e:
        code = e.code
    except Reached:
        return "reached", capsys.readouterr().err
    return f"exit {code}", capsys.readouterr().err


def check_error_line(err: str, names: tuple[str, ...], argv: list[str]) -> None:
    """One line, `error: ...`, naming one of `names` (the bad value or the option, as --seq-len,
    seq_len or seq len) and saying what to do."""
    lines = err.splitlines()
    assert len(lines) == 1, f"{argv}: stderr is not one line:\n{err}"
    line = lines[0]
    assert line.startswith("error: "), f"{argv}: {line}"
    assert "Traceback" not in err
    spellings = {s for n in names for s in (n, n.lstrip("-").replace("-", "_"),
                                            n.lstrip("-").replace("-", " "))}
    assert not names or any(s.lower() in line.lower() for s in spellings), \
        f"{argv}: the error line names none of {names}: {line}"
    assert any(w in line.lower() for w in FIX_WORDS), f"{argv}: says nothing about a fix: {line}"


@pytest.mark.parametrize("cid, argv, names, expect", ALL, ids=[c[0] for c in ALL])
def test_bad_input_is_one_error_line(cid, argv, names, expect, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    before = prepare(tmp_path)
    outcome, err = run_case(argv, capsys)
    RAN[expect] += 1
    assert "Traceback" not in err
    if outcome == "exit 2" or expect == "reject":
        assert outcome == "exit 2", f"{argv}: expected exit status 2, got {outcome}; {err}"
        check_error_line(err, names, argv)
        assert listing(tmp_path) == before, f"{argv} wrote {listing(tmp_path) - before}"
    else:
        assert outcome in ("reached", "exit 0"), f"{argv}: {outcome}; {err}"


# ------------------------------------------------------------------------------------------------
# Property-based: any text that is not a number, any negative number
# ------------------------------------------------------------------------------------------------

NUMERIC = [(c, a) for c, sub in SUBPARSERS.items() for a in options(sub)
           if kind(c, a) in ("int", "float")]


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(option=st.sampled_from(NUMERIC),
       text=st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
                    max_size=12).filter(lambda t: not _is_number(t) and not t.startswith("-")))
def test_any_non_number_is_rejected(option, text, capsys):
    command, a = option
    argv = with_option(command, a, [text])
    outcome, err = run_case(argv, capsys)
    RAN["property"] += 1
    assert outcome == "exit 2", f"{argv}: {outcome}; {err}"
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and "Traceback" not in err


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(option=st.sampled_from([(c, a) for c, a in NUMERIC
                               if c in BASE and (c, flag(a)) not in NEGATIVE_OK]),
       value=st.one_of(st.integers(max_value=-1), st.floats(max_value=-1e-9)))
def test_any_negative_number_is_rejected(option, value, capsys):
    command, a = option
    if kind(command, a) == "int" and isinstance(value, float):
        value = -1 - int(min(-value, 1e9))
    argv = with_option(command, a, [str(value)])
    outcome, err = run_case(argv, capsys)
    RAN["property"] += 1
    assert outcome == "exit 2", f"{argv}: {outcome}; {err}"
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and "Traceback" not in err


def test_every_command_has_cases():
    """Every command the parser knows got cases; a new command without a BASE line is named."""
    covered = {c[1][0] for c in ALL}
    assert covered == set(COMMANDS)
    assert sum(1 for c in ALL if c[1][0] in BASE) > 300


# ------------------------------------------------------------------------------------------------
# The real process: what a person sees in the terminal, and Ctrl-C
# ------------------------------------------------------------------------------------------------

def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = str(ROOT / "code")
    return env


@pytest.mark.parametrize("argv, names", [
    (["plan", "--model", "llama-3-8b", "--gpus", "abc", "--global-batch-tokens", "1048576",
      "--seq-len", "8192"], "abc"),
    (["params", "--model", "bad/config.json"], "bad/config.json"),
    (["memory", "--model", "llama-3-8b", "--gpu", "no-such-gpu"], "no-such-gpu"),
])
def test_the_process_prints_one_line(argv, names, tmp_path):
    prepare(tmp_path)
    out = subprocess.run([sys.executable, "-m", "trainbook", *argv], capture_output=True,
                         text=True, timeout=120, cwd=tmp_path, env=_env())
    RAN["process"] += 1
    assert out.returncode == 2, out.stderr
    check_error_line(out.stderr, names, argv)
    assert out.stdout == ""


def test_keyboard_interrupt_is_one_line_and_130(monkeypatch, capsys):
    """Ctrl-C in any command: exit 130 and one line, from __main__ (no traceback)."""
    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(COMMANDS["params"], "run", interrupted)
    assert main(["params", "--model", "tiny-llama"]) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "interrupted" in err and "Traceback" not in err


def test_ctrl_c_during_training_exits_130_without_traceback(tmp_path):
    """A real SIGINT to a real training run, after its first log line. The child gets SIGINT's
    default disposition: a shell without job control (`pytest ... &`, nohup) starts its
    background jobs with SIGINT ignored, Python keeps it ignored, and Ctrl-C would never arrive."""
    argv = [sys.executable, "-u", "-m", "trainbook", "train", "--d-model", "32", "--n-layers",
            "1", "--n-heads", "2", "--n-kv-heads", "1", "--d-ff", "32", "--tokenizer", "bytes",
            "--seq-len", "16", "--batch-size", "2", "--steps", "100000", "--warmup-steps", "1",
            "--log-every", "1", "--no-progress", "--cache-dir", str(tmp_path)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path, env=_env(),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    guard = threading.Timer(180, proc.kill)  # a run that never logs a step cannot hang the test
    guard.start()
    try:
        for line in proc.stdout:  # wait until it trains
            if "step" in line:
                break
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        guard.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    RAN["process"] += 1
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.strip().splitlines()[-1].startswith("interrupted"), err


def test_an_existing_output_file_is_overwritten_not_refused(tmp_path):
    """torchrun ranks check --json-out after rank 0 may have written it (a 4-rank CI run
    caught `run.json is a file, not a folder`): an existing file is a valid output path."""
    from trainbook.commands._args import check_writable

    out = tmp_path / "run.json"
    out.write_text("{}")
    check_writable(str(out), "--json-out")
    check_writable(str(tmp_path / "new" / "deeper" / "run.json"), "--json-out")
    check_writable(str(tmp_path), "--out", folder=True)
    with pytest.raises(ValueError, match="is a file, not a folder"):
        check_writable(str(out / "x.json"), "--json-out")
    with pytest.raises(ValueError, match="is a folder; give a file"):
        check_writable(str(tmp_path), "--json-out")
