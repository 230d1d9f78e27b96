"""Data sets shipped inside the package, each checked against its recorded sha256 when read.

Provenance (papers, repository, commit, columns) is in this folder's README.md.

Chapter: book/compute/scaling-laws.
"""

from __future__ import annotations

import hashlib
import io
from importlib import resources
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd

DATASETS = {
    "chinchilla-fig4-points": ("chinchilla-fig4-points.csv",
                               "193478df4e90f040016431996c45682659306840ecdadf83cfb9cd5ca0aa1b30"),
}


def read_bytes(name: str) -> bytes:
    """The raw bytes of a shipped data set, after checking its sha256."""
    if name not in DATASETS:
        raise ValueError(f"unknown data set {name!r}; shipped: {', '.join(DATASETS)}")
    filename, sha = DATASETS[name]
    raw = resources.files(__name__).joinpath(filename).read_bytes()
    if hashlib.sha256(raw).hexdigest() != sha:
        raise RuntimeError(f"data set {name} is corrupt (sha256 mismatch); reinstall trainbook")
    return raw


def load_csv(name: str) -> pd.DataFrame:
    """A shipped CSV data set as a pandas DataFrame, columns as in the file."""
    import pandas as pd

    return pd.read_csv(io.BytesIO(read_bytes(name)))
