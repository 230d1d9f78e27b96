import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))  # repository tooling (tools/notebooks.py)
os.environ.setdefault("TRAINBOOK_SIZE", "small")


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One tokenizer cache for the whole session: each BPE is trained once."""
    return str(tmp_path_factory.mktemp("tokenizers"))


@pytest.fixture(scope="session")
def hf_dir():
    return ROOT / "tests" / "data" / "hf"


def pytest_report_header(config):
    """The machine's class in every test log: whether bf16 is native here or emulated."""
    from trainbook.bench import lowp

    return f"trainbook machine: {lowp.machine_line()}"
