"""Argument types shared by the commands: argparse rejects a bad count while it parses, before
any work, naming the option in its error line (exit status 2). Not a command itself.

Chapter: book/how-to-use.
"""

from __future__ import annotations

import argparse
import shlex


def _whole(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be >= {least}, got {value}")
    return value


def positive_int(text: str) -> int:
    """A whole number >= 1 (steps, ranks, sizes)."""
    return _whole(text, 1)


def non_negative_int(text: str) -> int:
    """A whole number >= 0 (warm-up iterations)."""
    return _whole(text, 0)


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
