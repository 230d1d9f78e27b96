"""The one runtime: the reference trainer, its configuration, checkpoints and native parallelism.

`config` holds the options and the layout they ask for; `loop` the training loop; `optim`,
`schedule`, `init` and `objective` what it optimises with, at which learning rate, from which
weights, towards which prediction (Part 2 teaches each); `engine` how
one step runs (one process or DDP, or a composed layout); `parallelize` builds the named device
mesh and applies PyTorch's own parallelism to the model from outside; `checkpoint` saves and
loads (atomic single files, or sharded with torch.distributed.checkpoint).

Chapter: book/start/first-run; book/parallelism/putting-it-together (layouts).
"""

from __future__ import annotations

from .checkpoint import checkpoint_path, latest_checkpoint, load_checkpoint, save_checkpoint
from .config import TrainConfig, config_fields, layout_for, model_config, read_layout
from .engine import evaluate
from .loop import Distributed, TrainResult, generate_text, init_distributed, peak_dtype, train
from .optim import make_optimizer
from .schedule import lr_at

__all__ = ["Distributed", "TrainConfig", "TrainResult", "checkpoint_path", "config_fields",
           "evaluate", "generate_text", "init_distributed", "latest_checkpoint", "layout_for",
           "load_checkpoint", "lr_at", "make_optimizer", "model_config", "peak_dtype",
           "read_layout", "save_checkpoint", "train"]
