"""Tensor and sequence parallelism from scratch (Megatron-LM), and the same with DTensor.

Tensor parallelism (TP) splits every weight matrix of a block over `tp` ranks that all see the
same batch. Shoeybi et al. 2019 (Section 3) pair the layers: the first linear layer of a block is
split by output columns ("column-parallel": each rank computes a slice of the features, no
communication), the second by input rows ("row-parallel": each rank computes a partial sum of
the full output), so a block needs one all-reduce in forward, at its end. Two conjugate
operators mark the region: `f` is the identity in forward and an all-reduce in backward (where
the block's input gradient is a sum over ranks), `g` the reverse. Attention splits by heads,
the MLP by its hidden size, the embedding and the output layer by vocabulary.

Sequence parallelism (SP, Korthikanti et al. 2022, Section 4.2) notes that an all-reduce is a
reduce-scatter followed by an all-gather, and moves the norms (and dropout) in between: outside
the TP region the activations are split along the sequence, so their memory is divided by tp,
for the same communication volume.

`parallelize_scratch` applies it to a copy of the reference `trainbook.model.Transformer` from
outside, by swapping modules (the model's forward runs unchanged), keeping the reference
parameter names, so `full_tensors` can gather the shards for comparison with
`harness.reference`. Every collective goes through `tp_comm.Comm`, which counts calls and bytes;
the embedding and the loss are split by vocabulary (`vocab_parallel`). `parallelize_dtensor` does
the same with PyTorch's `parallelize_module`; `TensorParallelRun` trains either through the
teaching loop (`harness.run`, `harness.sweep`).

Chapter: book/parallelism/tensor-parallel.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..configs import ModelConfig
from ..launch import rank_device
from ..model import Attention, Rope, Transformer
from ..train.parallelize import tp_plan
from . import harness
from .tp_comm import Comm, enter_tp, exit_tp, mark_replicated, shard_parameter
from .vocab_parallel import VocabParallelEmbedding, vocab_parallel_cross_entropy

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from ..compute.memory import MemoryBreakdown

KINDS = ("scratch", "scratch_sp", "dtensor", "dtensor_sp")


def check_divisible(cfg: ModelConfig, tp: int, seq_len: int | None = None,
                    sp: bool = False) -> None:
    """Raise a ValueError unless `tp` ranks can split this model (and, with SP, the sequence)."""
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive integer, got {tp!r}")
    for n, what in ((cfg.n_heads, "attention heads"), (cfg.n_kv_heads, "key/value heads"),
                    (cfg.d_ff, "MLP hidden size"), (cfg.vocab_size, "vocabulary size")):
        if n % tp:
            raise ValueError(f"tp {tp} does not divide the {n} {what}; pick a tp that divides it")
    if cfg.is_moe:
        raise ValueError("tensor parallelism here covers dense models; mixture-of-experts layers "
                         "are split by expert parallelism instead")
    if sp and seq_len is not None and seq_len % tp:
        raise ValueError(f"sequence parallelism splits the sequence: tp {tp} does not divide "
                         f"seq_len {seq_len}")


# ---------------------------------------------------------------------------------------------
# Layers: each takes the full reference layer and keeps this rank's slice
# ---------------------------------------------------------------------------------------------

class ColumnParallelLinear(nn.Module):
    """Y_i = X A_i: this rank's output features. No communication: the caller enters the TP
    region once (f or all-gather) for all column layers that share an input (q, k, v)."""

    def __init__(self, linear: nn.Linear, comm: Comm):
        super().__init__()
        self.weight = shard_parameter(linear.weight, 0, comm)
        self.bias = shard_parameter(linear.bias, 0, comm) if linear.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Z = sum_i Y_i B_i: a partial sum per rank, reduced on the way out (g or reduce-scatter);
    the bias is added once, after the reduction."""

    def __init__(self, linear: nn.Linear, comm: Comm):
        super().__init__()
        self.comm = comm
        self.weight = shard_parameter(linear.weight, 1, comm)
        self.bias = (mark_replicated(copy.deepcopy(linear.bias), comm)
                     if linear.bias is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = exit_tp(F.linear(x, self.weight), self.comm)
        return z + self.bias if self.bias is not None else z


class TPAttention(Attention):
    """Attention with this rank's n_heads / tp query heads and n_kv_heads / tp key/value heads:
    q, k, v column-parallel (whole heads), o row-parallel. Heads never talk to each other, so
    the attention itself needs no communication: the reference forward runs unchanged (it reads
    the head counts from the projections' widths)."""

    def __init__(self, attn: Attention, comm: Comm):
        nn.Module.__init__(self)  # the layers come from `attn`, sliced, not freshly made
        self.cfg, self.comm = attn.cfg, comm
        self.softmax_scale = attn.softmax_scale  # a muP-scaled model keeps its scale under TP
        self.q_norm, self.k_norm = attn.q_norm, attn.k_norm  # per head: whole heads per rank
        self.q, self.k, self.v = (ColumnParallelLinear(m, comm) for m in (attn.q, attn.k, attn.v))
        self.o = RowParallelLinear(attn.o, comm)

    def forward(self, x: torch.Tensor, rope: Rope | None = None) -> torch.Tensor:
        return super().forward(enter_tp(x, self.comm), rope)


class TPMLP(nn.Module):
    """SwiGLU: gate and up column-parallel, down row-parallel (the elementwise product and
    activation act on this rank's features only). GELU MLP: up column, down row."""

    def __init__(self, mlp: nn.Module, comm: Comm):
        super().__init__()
        self.comm, self.swiglu = comm, mlp.swiglu
        if self.swiglu:
            self.gate = ColumnParallelLinear(mlp.gate, comm)
        self.up = ColumnParallelLinear(mlp.up, comm)
        self.down = RowParallelLinear(mlp.down, comm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = enter_tp(x, self.comm)
        if self.swiglu:
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.down(F.gelu(self.up(x), approximate="tanh"))


# ---------------------------------------------------------------------------------------------
# The whole model
# ---------------------------------------------------------------------------------------------

class SequenceParallelPositions(nn.Embedding):
    """Learned positions (gpt2), replicated. Under SP the embedding hands each rank its sequence
    shard, so the rank adds its shard's rows of the table; without SP, all of them."""

    def __init__(self, pos: nn.Embedding, comm: Comm):
        super().__init__(pos.num_embeddings, pos.embedding_dim)
        self.comm = comm
        self.weight = mark_replicated(nn.Parameter(pos.weight.detach().clone()), comm)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        full = super().forward(positions)  # (T, d_model)
        if not self.comm.sp:
            return full
        n = full.shape[0] // self.comm.tp
        return full[self.comm.rank * n:(self.comm.rank + 1) * n]  # (T / tp, d_model)


class ParallelHead(ColumnParallelLinear):
    """The output layer: enter the TP region (f, or the all-gather of the sequence under SP),
    then this rank's vocabulary slice of the logits, for the vocabulary-parallel loss."""

    def __init__(self, linear: nn.Linear, comm: Comm):
        super().__init__(linear, comm)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(enter_tp(x, self.comm, "head"))


def parallelize_scratch(model: Transformer, comm: Comm) -> Transformer:
    """Megatron TP (and SP) applied from outside to a copy of the reference model: the
    embedding, attention, MLP and head are swapped for their parallel versions, norms marked
    replicated; the model's own forward (`Transformer.trunk`) runs unchanged and returns this
    rank's vocabulary slice of the logits (loss: `scratch_loss`). Parameter names stay the
    reference's, so `full_tensors` can gather the shards for comparison. Under SP the residual
    stream between blocks holds seq_len / tp positions per rank."""
    check_divisible(model.cfg, comm.tp)
    model = copy.deepcopy(model)
    model.embed = VocabParallelEmbedding(model.embed, comm)
    if model.pos is not None:
        model.pos = SequenceParallelPositions(model.pos, comm)
    for block in model.layers():
        for p in (*block.attn_norm.parameters(), *block.mlp_norm.parameters()):
            mark_replicated(p, comm)
        block.attn, block.mlp = TPAttention(block.attn, comm), TPMLP(block.mlp, comm)
    for p in model.norm.parameters():
        mark_replicated(p, comm)
    model.head = ParallelHead(model.head, comm)
    if model.cfg.tied:
        model.head.weight = model.embed.weight  # the same V / tp rows serve both
    return model


def scratch_loss(model: Transformer, comm: Comm, x: torch.Tensor,
                 y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's logits slice (B, T, V / tp), mean loss over all tokens): the model's forward,
    then the vocabulary-parallel cross-entropy in place of `lm_loss`."""
    logits, _ = model(x)  # through __call__, so module hooks (CommDebugMode) see the root
    loss = vocab_parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                        comm, comm.rank * logits.shape[-1])
    return logits, loss


def sync_sequence_parallel_grads(model: nn.Module, comm: Comm) -> None:
    """Under SP the norms (and row-parallel biases, positions) saw only this rank's positions:
    sum their gradients over ranks, in one flat all-reduce."""
    params = [p for p in model.parameters()
              if getattr(p, "sp_partial", False) and p.grad is not None]
    if not params:
        return
    flat = comm.all_reduce(torch.cat([p.grad.reshape(-1) for p in params]), "backward", "grads")
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        p.grad.copy_(g.view_as(p))


def full_tensors(model: nn.Module, what: str = "grad",
                 group: dist.ProcessGroup | None = None) -> dict[str, torch.Tensor]:
    """Gradients ('grad') or weights ('data') by reference name, shards gathered to full size
    over `group` (default: all ranks). Works for both the scratch model (tp_dim attributes) and
    DTensor parameters."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        t = p.grad if what == "grad" else p.data
        if isinstance(t, DTensor):
            out[name] = t.full_tensor().detach().clone()
        elif getattr(p, "tp_dim", None) is not None:
            parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, t.detach().contiguous(), group=group)
            out[name] = torch.cat(parts, dim=p.tp_dim)
        else:
            out[name] = t.detach().clone()
    return out


def theory_counts(cfg: ModelConfig, sp: bool, batch: int, seq_len: int) -> list[dict]:
    """Collectives per training step that the Megatron analysis predicts for this model.

    Per block: 2 all-reduces forward and 2 backward (TP), or an all-gather and a reduce-scatter
    in place of each (TP + SP), all on the (batch, seq, d_model) activation. Plus the embedding's
    g, the head's f and three all-reduces of one number per token for the loss. (SP's flat
    all-reduce of the norm gradients depends on the parameters, not on this analysis.)"""
    act, token = batch * seq_len * cfg.d_model * 4, batch * seq_len * 4
    L = cfg.n_layers
    if sp:
        rows = [("all_gather", "forward", "block", 2 * L, act),
                ("reduce_scatter", "forward", "block", 2 * L, act),
                ("reduce_scatter", "backward", "block", 2 * L, act),
                ("all_gather", "backward", "block", 2 * L, act),
                ("reduce_scatter", "forward", "embed", 1, act),
                ("all_gather", "backward", "embed", 1, act),
                ("all_gather", "forward", "head", 1, act),
                ("reduce_scatter", "backward", "head", 1, act)]
    else:
        rows = [("all_reduce", "forward", "block", 2 * L, act),
                ("all_reduce", "backward", "block", 2 * L, act),
                ("all_reduce", "forward", "embed", 1, act),
                ("all_reduce", "backward", "head", 1, act)]
    rows.append(("all_reduce", "forward", "loss", 3, token))
    return [{"op": o, "phase": p, "where": w, "calls": c, "bytes": c * each}
            for o, p, w, c, each in rows]


# ---------------------------------------------------------------------------------------------
# Native: DTensor parallelize_module
# ---------------------------------------------------------------------------------------------

def parallelize_dtensor(model: Transformer, sp: bool = False, shared_input: bool = True,
                        mesh: DeviceMesh | None = None) -> tuple[Transformer, DeviceMesh]:
    """Shard the reference model in place with DTensor over the 1-D `mesh` (default: all ranks);
    returns (model, mesh)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    if mesh is None:  # an explicit device: the default mesh follows the accelerator
        mesh = init_device_mesh(rank_device().type, (dist.get_world_size(),))
    check_divisible(model.cfg, mesh.size())
    parallelize_module(model, mesh, tp_plan(model, sp, shared_input))
    if model.cfg.tied:  # parallelize_module replaced head and embedding weights separately
        model.head.weight = model.embed.weight
    return model, mesh


# ---------------------------------------------------------------------------------------------
# Training through the teaching loop
# ---------------------------------------------------------------------------------------------

@dataclass(kw_only=True)
class TensorParallelRun(harness.Technique):
    """The reference model with tensor parallelism over the mesh's "tp" ranks, every rank on the
    whole global batch: from scratch (`scratch`, `scratch_sp`) or with DTensor (`dtensor`,
    `dtensor_sp`; `shared_input=False` lets each column layer convert its own input). Stats:
    the scratch `Comm` tally of the first step (by op, phase and where), this rank."""

    kind: str = "scratch"
    shared_input: bool = True
    mesh_dim: str = "tp"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")

    def build(self, setup: harness.Setup, mesh: DeviceMesh | None) -> None:
        if mesh is None:
            raise ValueError("tensor parallelism needs a process group: run under torchrun or "
                             "trainbook.launch.run(harness.sweep, nprocs, ...)")
        self.group = mesh["tp"].get_group()
        tp, sp = mesh.size(), self.kind.endswith("_sp")
        check_divisible(setup.model_config(), tp, setup.seq_len, sp)
        model = harness.build_model(setup).to(rank_device())
        if self.kind.startswith("scratch"):
            self.comm = Comm(tp, dist.get_rank(self.group), sp, group=self.group)
            self.model = parallelize_scratch(model, self.comm)
        else:
            self.comm = None
            self.model = parallelize_dtensor(model, sp, self.shared_input, mesh=mesh)[0]
        self.optimizer = harness.make_optimizer(setup, self.model.parameters())
        self.first_step_counts = None

    def forward_backward(self, x: torch.Tensor,
                         y: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        if self.comm is None:
            from torch.distributed.tensor.parallel import loss_parallel
            with loss_parallel():
                logits, loss = self.model(x, y)
                loss.backward()
        else:
            logits, loss = scratch_loss(self.model, self.comm, x, y)
            loss.backward()
            sync_sequence_parallel_grads(self.model, self.comm)
            if self.first_step_counts is None:
                self.first_step_counts = self.comm.table()
        return logits, loss.detach()

    def gradients(self) -> dict[str, torch.Tensor]:
        return {n: harness.full_tensor(t)
                for n, t in full_tensors(self.model, "grad", self.group).items()}

    def parameters(self) -> dict[str, torch.Tensor]:
        return {n: harness.full_tensor(t)
                for n, t in full_tensors(self.model, "data", self.group).items()}

    def stats(self) -> dict:
        return {"counts": self.first_step_counts, "rank": dist.get_rank(self.group)}


def estimate_memory(setup: harness.Setup, tp: int, sp: bool) -> MemoryBreakdown:
    """The memory estimator's per-rank figure for this setup (fp32, whole global batch per rank).
    Compare with AdamW: the estimator's "sgd" has a momentum buffer, the harness's SGD none."""
    from ..compute.memory import MemoryInputs, estimate

    return estimate(MemoryInputs(model=setup.model_config(), dtype="fp32",
                                 optimizer=setup.optimizer, tp=tp, sp=sp,
                                 micro_batch=setup.global_batch, seq_len=setup.seq_len,
                                 activations="reference"))
