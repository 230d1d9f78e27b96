"""Argument types shared by the commands: argparse rejects a bad count while it parses, before
any work, naming the option in its error line (exit status 2). Not a command itself.

Chapter: book/how-to-use.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
from pathlib import Path

LARGEST = 2**63 - 1  # past this a count overflows the C integers torch and numpy take


def _whole(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be >= {least}, got {value}")
    if value > LARGEST:
        raise argparse.ArgumentTypeError(f"{value} is too large (at most 2**63 - 1)")
    return value


def positive_int(text: str) -> int:
    """A whole number >= 1 (steps, ranks, sizes)."""
    return _whole(text, 1)


def non_negative_int(text: str) -> int:
    """A whole number >= 0 (warm-up iterations)."""
    return _whole(text, 0)


def finite_float(text: str) -> float:
    """A finite number: nan and inf parse as floats but are never a sensible setting (a NaN
    passes every `x < 0` check and comes out as a silently wrong result)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (seconds, bandwidths)."""
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def check_model_file(text: str) -> None:
    """A --model that names a file or folder must hold a readable config.json object; presets
    are checked where they are resolved. Raises ValueError naming the path and the fix."""
    path = Path(text)
    if not (path.exists() or text.endswith(".json") or "/" in text):
        return  # a preset name: configs.resolve lists the presets if it is unknown
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"no config.json at {text!r}: give a preset name, a config.json file "
                         "or a model folder that holds one")
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {str(path)!r} as a config.json ({e}); give a Hugging "
                         "Face config.json (UTF-8 JSON)") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ValueError(f"{str(path)!r} is not a Hugging Face config.json: expected a JSON "
                         "object with a model_type (llama, mistral, mixtral, qwen2, qwen3 or gpt2)")


def check_writable(path: str | None, option: str, folder: bool = False) -> None:
    """Fail before any work when `path` (a file, or a folder with folder=True) cannot be
    created: something on the way is a file, or a file is wanted where a folder stands."""
    if path is None:
        return
    p = Path(path)
    if p.exists() and p.is_dir() != folder:
        what = "a folder" if p.is_dir() else "a file"
        raise ValueError(f"{option} {path} is {what}; give {'a folder' if folder else 'a file'} "
                         "name")
    parent = p if folder else p.parent  # an existing file is overwritten: check its folder
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{option} {path}: {parent} is a file, not a folder; give a path "
                         "whose folders can be created")
    # what this user may do there (a read-only mount says no too); root passes any mode bits
    blocked = p if p.exists() and not os.access(p, os.W_OK) else \
        (parent if not os.access(parent, os.W_OK | os.X_OK) else None)
    if blocked is not None:
        raise ValueError(f"{option} {path}: {blocked} is not writable by this user "
                         f"(uid {os.getuid()}) or is on a read-only file system; give a path "
                         "you can write to")


def command_line(args: argparse.Namespace) -> str:
    """The command as given (rebuilt from the parsed options), for a results file."""
    parts = ["python", "-m", "trainbook", args.command]
    for key, value in vars(args).items():
        if key == "command" or value in (None, False):
            continue
        flag = "--" + key.replace("_", "-")
        values = value if isinstance(value, list) else [value]
        parts += [flag] if value is True else [flag, *map(str, values)]
    return shlex.join(parts)
