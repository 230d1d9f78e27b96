"""Command-line commands: each module has add_arguments(parser) and run(args) -> int."""

from . import hardware, params, train

COMMANDS = {"params": params, "hardware": hardware, "train": train}
