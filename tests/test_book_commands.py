"""Every `trainbook train` command the book prints is one the trainer accepts.

Readers copy the "At scale" commands into their jobs, where a refusal costs a queue wait: each
command in a shell block of a chapter, the README or the guide is parsed by the real command
line and checked by the trainer's own configuration and layout checks for the world size its
launcher gives (torchrun's --nnodes x --nproc_per_node), without training."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import notebooks  # tools/notebooks.py
import pytest

from trainbook.__main__ import build_parser
from trainbook.train import TrainConfig, config_fields, layout_for, model_config

ROOT = Path(__file__).resolve().parents[1]
SHELL = ("", "bash", "sh", "shell", "console")
UNKNOWN_NODES = 2  # --nnodes "$SLURM_NNODES": the check holds for any count; take two


def shell_blocks(text: str) -> list[str]:
    """The text of each fenced shell block (```bash, or a fence with no language)."""
    blocks, fence, lines = [], None, []
    for line in text.splitlines():
        if line.startswith("```") and fence is None:
            fence, lines = line[3:].strip(), []
        elif line.startswith("```"):
            if fence in SHELL:
                blocks.append("\n".join(lines) + "\n")
            fence = None
        elif fence is not None:
            lines.append(line)
    return blocks


def book_commands() -> list[tuple[str, str]]:
    """(where, command line) for each `-m trainbook train` line with real options."""
    texts = {**notebooks.pages_markdown(), "README.md": (ROOT / "README.md").read_text()}
    found = []
    for where, text in texts.items():
        for block in shell_blocks(text):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split(" # ")[0].strip()
                if re.search(r"-m trainbook train\b", line) and "..." not in line.split() \
                        and "--help" not in line:
                    found.append((where, " ".join(line.split())))
    return found


COMMANDS = book_commands()


def world_size(launcher: list[str]) -> int:
    """Ranks the launcher starts: torchrun's nodes x processes per node, 1 for python."""
    if not any(word.endswith("torchrun") for word in launcher):
        return 1
    opts = {}
    for i, word in enumerate(launcher):
        key = word.split("=")[0].replace("-", "_")
        if key in ("__nnodes", "__nproc_per_node"):
            opts[key] = word.split("=", 1)[1] if "=" in word else launcher[i + 1]
    nodes = opts.get("__nnodes", "1")
    per_node = int(opts.get("__nproc_per_node", "1"))
    return (int(nodes) if nodes.isdigit() else UNKNOWN_NODES) * per_node


def test_the_book_prints_train_commands():
    assert len(COMMANDS) >= 30, "the scan lost the book's commands: check shell_blocks"


@pytest.mark.parametrize("where,line", COMMANDS, ids=[f"{w}:{i}" for i, (w, _) in
                                                       enumerate(COMMANDS)])
def test_the_trainer_accepts_the_command(where, line):
    words = shlex.split(line.replace("$(hostname)", "head"))
    at = words.index("trainbook") + 2  # after "-m trainbook train"
    launcher = words[:at - 3]
    # a shell variable as a whole value ($K from the interval formula, $tok a file): a number
    options = [re.sub(r"^\$\{?\w+\}?$", "1", w) for w in words[at:]]
    args = build_parser().parse_args(["train", *options])
    if args.layout:
        pytest.skip("a --layout file comes from `plan --json`: tests/test_compose.py runs that")
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in config_fields()})
    vocab = {"bytes": 256}.get(cfg.tokenizer, cfg.vocab_size)  # a tokenizer file: its own size
    layout_for(cfg, world_size(launcher), model_config(cfg, vocab))


def test_a_refused_command_fails_the_check():
    line = "torchrun --nproc_per_node 8 -m trainbook train --dp-shard 8 --monitor fingerprint"
    with pytest.raises(ValueError, match="--monitor fingerprint is wired for one process"):
        test_the_trainer_accepts_the_command("planted", line)
    assert world_size(shlex.split("torchrun --nnodes=16 --nproc-per-node=8")) == 128
    assert world_size(shlex.split('srun torchrun --nnodes "$N" --nproc_per_node 4')) == 8
    assert world_size(["python"]) == 1
