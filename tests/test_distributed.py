"""DDP under torchrun (2 processes, gloo) matches single-process training on the same global
batch."""

import json
import subprocess
import sys

import torch

from trainbook.train import TrainConfig, train

ARGS = dict(model="tiny-llama", d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64,
            vocab_size=384, seq_len=32, steps=8, warmup_steps=2, lr=3e-3, eval_batches=2)


def cli_args(args: dict) -> list[str]:
    return [x for k, v in args.items() for x in (f"--{k.replace('_', '-')}", str(v))]


def test_ddp_two_processes_match_single_process(cache_dir, tmp_path):
    out = tmp_path / "ddp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "trainbook", "train",
           *cli_args(dict(ARGS, batch_size=4, cache_dir=cache_dir, timeout_s=60)),
           "--no-progress", "--log-every", "0", "--json-out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ddp = json.loads(out.read_text())
    assert ddp["world_size"] == 2

    single = train(TrainConfig(**ARGS, batch_size=8, cache_dir=cache_dir, progress=False,
                               log_every=0))
    ddp_losses = torch.tensor([r["loss"] for r in ddp["history"]])
    # Exact gradients up to summation order; AdamW amplifies ~1e-7 differences slightly.
    torch.testing.assert_close(ddp_losses, torch.tensor(single.losses()), rtol=0, atol=2e-5)
    grad_norms = torch.tensor([r["grad_norm"] for r in ddp["history"]])
    torch.testing.assert_close(grad_norms, torch.tensor([r["grad_norm"] for r in single.history]),
                               rtol=1e-4, atol=1e-6)
