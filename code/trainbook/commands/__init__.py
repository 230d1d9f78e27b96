"""Command-line commands. Each module here is one command, named after the module (an
underscore becomes a hyphen: nan_hunt.py is `nan-hunt`), and has HELP (one line),
add_arguments(parser) and run(args) -> exit status. Adding a command is adding a module;
`python -m trainbook --help` lists them all.

Chapter: book/how-to-use.
"""

from __future__ import annotations

import importlib
import pkgutil

ORDER = ("params", "hardware", "train")  # listed first, in this order; the rest alphabetically


def _discover() -> dict:
    names = [m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")]
    names.sort(key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), n))
    return {n.replace("_", "-"): importlib.import_module(f"{__name__}.{n}") for n in names}


COMMANDS = _discover()
