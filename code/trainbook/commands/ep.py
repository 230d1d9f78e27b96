"""trainbook ep: train a tiny Mixtral-style mixture of experts with its experts spread over the
torchrun ranks (expert parallelism x data parallelism, all-to-all dispatch and combine).

Prints the loss of every step, the tokens each expert received in the last step (per layer), the
tokens dropped by the capacity limit and the all-to-all bytes rank 0 sent. NCCL on GPUs, gloo on
CPU. Example: torchrun --standalone --nproc_per_node 8 -m trainbook ep --experts 8 --top-k 2
--steps 10 --aux-weight 0.01. Chapter: book/parallelism/expert-parallel
"""

from __future__ import annotations

import argparse
import json

from ..parallel import expert_parallel, harness
from ..parallel.moe_routing import check_moe
from . import _torchrun
from ._args import finite_float, positive_int

HELP = ("expert parallelism: train a tiny MoE with experts over the ranks, routing and traffic "
        "(torchrun)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--experts", type=positive_int, default=8,
                   help="number of experts, divisible by the ranks (default: 8)")
    p.add_argument("--top-k", type=positive_int, default=2, help="experts per token (default: 2)")
    p.add_argument("--steps", type=positive_int, default=10, help="training steps (default: 10)")
    p.add_argument("--global-batch", type=positive_int, default=16,
                   help="sequences per step, all ranks together; divisible by the ranks "
                        "(default: 16)")
    p.add_argument("--capacity-factor", type=finite_float, default=None,
                   help="tokens an expert takes, as a multiple of an even share "
                        "(default: no limit, no token dropped)")
    p.add_argument("--aux-weight", type=finite_float, default=0.01,
                   help="weight of the load-balancing loss (default: 0.01)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def run(args: argparse.Namespace) -> int:
    setup = harness.Setup(d_ff=64, steps=args.steps, global_batch=args.global_batch)
    technique = expert_parallel.ExpertParallelRun(
        n_experts=args.experts, top_k=args.top_k, capacity_factor=args.capacity_factor,
        aux_weight=args.aux_weight)
    world = _torchrun.world_size("ep")
    check_moe(technique.n_experts, technique.top_k, world, technique.capacity_factor)
    if setup.global_batch % world:
        raise ValueError(f"--global-batch {setup.global_batch} does not split over {world} "
                         f"ranks; use a multiple of {world}")
    with _torchrun.process_group():
        out = harness.run(setup, technique)
        if _torchrun.is_main():
            _print(out, technique, world, args.json)
    return 0


def _print(out: harness.Result, run: expert_parallel.ExpertParallelRun, world: int,
           as_json: bool) -> None:
    last = out["routing"][-1]
    summary = {"ranks": world, "experts": run.n_experts, "top_k": run.top_k,
               "losses": out.trace.losses,
               "tokens_per_expert": last["tokens_per_expert"].tolist(),  # last step, per layer
               "dropped": last["dropped"],
               "alltoall_bytes_rank0": (out["alltoall"]["forward_bytes"]
                                        + out["alltoall"]["backward_bytes"]),
               "allreduce_bytes_rank0": out["allreduce_bytes"]}
    if as_json:
        print(json.dumps(summary, indent=2))
        return
    print(f"{world} ranks, {run.n_experts} experts, top-{run.top_k}")
    print(f"losses {[round(v, 4) for v in summary['losses']]}")
    print(f"tokens per expert (last step, per layer) {summary['tokens_per_expert']}")
    print(f"dropped {summary['dropped']}, all-to-all bytes sent by rank 0 "
          f"{summary['alltoall_bytes_rank0']:,}")
