"""The SFT policy the DPO and GRPO chapters start from, stored with its provenance.

Preference optimisation and RL need a policy that already speaks the chat format and is right
often enough that its samples disagree: a prompt whose samples are all right or all wrong gives
no preference pair and no GRPO advantage. The book's base model fine-tuned by `sft.sft` with
`START_SFT` on `START_ITEMS` training items is such a policy: it answers in the chat format,
right on a minority of test items. Fine-tuning takes longer than a chapter may run on a CPU, so
`write_start` does it once and stores the weights (safetensors, fp32) and a record (the
recipe, the SHA-256 of the weights, the command, date, versions, machine, and the greedy pass@1
it measured on `EVAL_ITEMS` test items); `load_start` checks the digest and loads them.

Chapter: book/alignment/dpo
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ..bench.gpu_truth import header, read_record, write_record
from ..model import Transformer
from . import base, policy, sft, task

START_SFT = sft.SFTConfig(steps=400, lr=1e-3)
START_ITEMS = 5000  # training items the start policy is fine-tuned on (seed 0)
EVAL_ITEMS = 500  # test items its pass@1 is measured on (seed 1)
MEASUREMENT = "align-start"


def eval_items(n: int = EVAL_ITEMS) -> list[task.Problem]:
    """The test items the stored pass@1 is measured on."""
    return task.make_problems(n, 2, seed=1, split="test")


def write_start(folder: str | Path, name: str = "dpo-start",
                cfg: sft.SFTConfig = START_SFT) -> Path:
    """Fine-tune the base model with `cfg` and store `<name>.safetensors` and `<name>.json`."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = task.chat_tokenizer()
    model = base.base_model()
    losses = sft.sft(model, tok, task.make_problems(START_ITEMS, 2, seed=0), cfg)
    weights = folder / f"{name}.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(weights))
    cmd = (f'python -c "from trainbook.align import start; start.write_start({str(folder)!r}, '
           f'{name!r})"')
    record = header(MEASUREMENT, cmd, torch.device("cpu"), "small")
    record.update(sft=dataclasses.asdict(cfg), items=START_ITEMS,
                  base=base.shipped_record()["sha256"], sha256=base.sha256(weights),
                  final_loss=losses[-1], pass1=policy.accuracy(model, tok, eval_items()),
                  eval_items=EVAL_ITEMS)
    return write_record(folder, name, record)


def load_start(folder: str | Path, name: str = "dpo-start") -> Transformer:
    """The stored start policy, after checking its weights against the record's SHA-256."""
    from safetensors.torch import load_file

    path = Path(folder) / f"{name}.json"
    record = read_record(path, MEASUREMENT, "trainbook.align.start.write_start")
    weights = path.with_suffix(".safetensors")
    if not weights.is_file() or base.sha256(weights) != record["sha256"]:
        raise ValueError(f"{weights} is missing or does not match the SHA-256 in {path.name}; "
                         "write it again with start.write_start")
    model = base.base_model()
    model.load_state_dict(load_file(str(weights)))
    return model.eval()


def start_record(folder: str | Path, name: str = "dpo-start") -> dict:
    """The stored record of the start policy (recipe, digest, provenance, pass@1)."""
    return read_record(Path(folder) / f"{name}.json", MEASUREMENT,
                       "trainbook.align.start.write_start")
