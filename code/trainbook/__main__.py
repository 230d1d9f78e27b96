"""python -m trainbook <command>: the handbook's tools from the command line.

Chapter: book/how-to-use.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .commands import COMMANDS


def build_parser() -> argparse.ArgumentParser:
    invoked = Path(sys.argv[0]).name
    parser = argparse.ArgumentParser(
        prog="python -m trainbook" if invoked == "__main__.py" else invoked,
        description="Tools from trainbook, the executable LLM training handbook.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module in COMMANDS.items():
        p = sub.add_parser(name, help=module.HELP, description=module.__doc__)
        module.add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command].run(args)
    except ValueError as e:  # bad input: one clear line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
