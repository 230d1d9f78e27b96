"""python -m trainbook <command>: the handbook's tools from the command line.

Chapter: book/how-to-use; book/appendix/cli (every command's help, printed from build_parser).
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import shutil
import sys
from pathlib import Path
from typing import NoReturn

from .commands import COMMANDS

_BAD_NUMBER = re.compile(r"invalid (int|float|positive_int|non_negative_int) value: ('.*')$")
_WANTED = {"int": "a whole number", "positive_int": "a whole number",
           "non_negative_int": "a whole number", "float": "a number"}


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `error: <what is wrong> (see `<command> --help`)`, exit
    status 2, instead of the usage block followed by the error (a person reads one line)."""

    def error(self, message: str) -> NoReturn:
        message = _BAD_NUMBER.sub(lambda m: f"{m[2]} is not {_WANTED[m[1]]}", message)
        self.exit(2, f"error: {message} (see `{self.prog} --help`)\n")


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The whole command line (book/appendix/cli prints every command's help from it). prog:
    the name in usage lines; default: as invoked (`trainbook` or `python -m trainbook`)."""
    invoked = Path(sys.argv[0]).name
    parser = Parser(
        prog=prog or ("python -m trainbook" if invoked == "__main__.py" else invoked),
        description="Tools from trainbook, the executable LLM training handbook.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module in COMMANDS.items():
        # the docstring as written: its example commands keep their lines (argparse would
        # reflow them into one paragraph and break names at hyphens)
        p = sub.add_parser(name, help=module.HELP, description=module.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
    return parser


def os_error_line(e: OSError) -> str:
    """An OSError as one line: what failed, on which path, and for a full disk how much room
    is left there."""
    where = f" {e.filename}" if e.filename else ""
    line = f"{e.strerror or e}{':' if where else ''}{where}"
    if e.errno == errno.ENOSPC and e.filename:
        folder = Path(e.filename).parent
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
        line += f" ({shutil.disk_usage(folder).free:,} bytes free there: free space, or write " \
                "elsewhere)"
    elif e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        line += " (not writable by this user, or a read-only file system: write elsewhere)"
    return line


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command].run(args)
    except ValueError as e:  # bad input: one clear line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `trainbook hardware | head -1`: the reader has what it wanted
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # no second error when Python flushes at exit
        return 141  # 128 + SIGPIPE, what a shell reports for a command its pipe closed
    except OSError as e:  # the file system said no mid-run: one line that says what and where
        print(f"error: {os_error_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: what the command printed so far is its summary
        print(f"interrupted: `{args.command}` stopped by Ctrl-C; the output above is what it "
              "finished (exit status 130)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
