"""The one runtime: the reference trainer, its configuration, checkpoints and native parallelism.

`loop` holds the configuration and the training loop; `parallelize` builds the named device mesh
from a layout and applies PyTorch's own parallelism to the model from outside; `checkpoint`
saves and loads (atomic single files, or sharded with torch.distributed.checkpoint).

Chapter: book/start/first-run; book/parallelism/putting-it-together (layouts).
"""

from .loop import (Distributed, TrainConfig, TrainResult, checkpoint_path, config_fields,
                   evaluate, generate_text, init_distributed, latest_checkpoint, load_checkpoint,
                   lr_at, make_optimizer, model_config, peak_dtype, resolve_device,
                   save_checkpoint, train)

__all__ = ["Distributed", "TrainConfig", "TrainResult", "checkpoint_path", "config_fields",
           "evaluate", "generate_text", "init_distributed", "latest_checkpoint",
           "load_checkpoint", "lr_at", "make_optimizer", "model_config", "peak_dtype",
           "resolve_device", "save_checkpoint", "train"]
