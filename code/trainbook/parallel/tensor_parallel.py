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
`harness.reference`. Every collective goes through `Comm`, which counts calls and bytes.
`parallelize_dtensor` does the same with PyTorch's `parallelize_module`; `run_tp` trains either
and `sweep` runs several variants in one launch.

Chapter: book/parallelism/tensor-parallel.
"""

from __future__ import annotations

import copy
import warnings
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..bench.collectives import bus_factor
from ..configs import ModelConfig
from ..launch import rank_device
from ..model import Attention, Transformer
from ..train.parallelize import tp_plan  # noqa: F401 (the one plan, shown in the chapter)
from . import harness

KINDS = ("scratch", "scratch_sp", "dtensor", "dtensor_sp")
# CommDebugMode's op names (c10d ops for plain dist calls, functional ones for DTensor)
_OP_NAMES = {"allreduce": "all_reduce", "_allgather_base": "all_gather",
             "_reduce_scatter_base": "reduce_scatter", "all_gather_into_tensor": "all_gather",
             "reduce_scatter_tensor": "reduce_scatter"}


def check_divisible(cfg: ModelConfig, tp: int, seq_len: int | None = None,
                    sp: bool = False) -> None:
    """Raise a ValueError unless `tp` ranks can split this model (and, with SP, the sequence)."""
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive integer, got {tp!r}")
    for n, what in ((cfg.n_heads, "attention heads"), (cfg.kv_heads, "key/value heads"),
                    (cfg.ffn_dim, "MLP hidden size"), (cfg.vocab_size, "vocabulary size")):
        if n % tp:
            raise ValueError(f"tp {tp} does not divide the {n} {what}; pick a tp that divides it")
    if cfg.is_moe:
        raise ValueError("tensor parallelism here covers dense models; mixture-of-experts layers "
                         "are split by expert parallelism instead")
    if sp and seq_len is not None and seq_len % tp:
        raise ValueError(f"sequence parallelism splits the sequence: tp {tp} does not divide "
                         f"seq_len {seq_len}")


# ---------------------------------------------------------------------------------------------
# Counted collectives
# ---------------------------------------------------------------------------------------------

@dataclass
class Comm:
    """The TP group (here: all ranks) and a tally of collectives by (op, phase, where).

    Bytes are those of the full tensor a collective works on (the all-reduce buffer, the
    all-gather's output, the reduce-scatter's input); `wire_bytes` gives what each rank sends.
    """

    tp: int
    rank: int
    sp: bool = False
    counts: dict = field(default_factory=lambda: defaultdict(lambda: [0, 0]))

    def record(self, op: str, phase: str, where: str, t: torch.Tensor) -> None:
        c = self.counts[(op, phase, where)]
        c[0] += 1
        c[1] += t.numel() * t.element_size()

    def all_reduce(self, x, phase, where, op=dist.ReduceOp.SUM):
        x = x.contiguous().clone()  # gloo: contiguous; clone: never modify a saved tensor
        self.record("all_reduce", phase, where, x)
        dist.all_reduce(x, op=op)
        return x

    def all_gather(self, x, dim, phase, where):
        """Concatenate every rank's x along dim (each rank holds one contiguous chunk)."""
        x = x.movedim(dim, 0).contiguous()
        out = x.new_empty((self.tp * x.shape[0], *x.shape[1:]))
        self.record("all_gather", phase, where, out)
        dist.all_gather_single(out, x)
        return out.movedim(0, dim).contiguous()  # one copy, shared by every layer that reads it

    def reduce_scatter(self, x, dim, phase, where):
        """Sum x over ranks and keep this rank's chunk along dim."""
        x = x.movedim(dim, 0).contiguous()
        self.record("reduce_scatter", phase, where, x)
        out = x.new_empty((x.shape[0] // self.tp, *x.shape[1:]))
        dist.reduce_scatter_single(out, x)
        return out.movedim(0, dim).contiguous()

    def table(self) -> list[dict]:
        return [{"op": op, "phase": ph, "where": w, "calls": c, "bytes": b}
                for (op, ph, w), (c, b) in sorted(self.counts.items())]


def wire_bytes(op: str, nbytes: float, n: int) -> float:
    """Bytes each rank sends in a ring collective over n ranks on a tensor of nbytes:
    `bench.collectives.bus_factor` x nbytes (2(n-1)/n for all-reduce, (n-1)/n otherwise)."""
    return bus_factor(op, n) * nbytes


# ---------------------------------------------------------------------------------------------
# The conjugate operators: f / g (TP), and their sequence-parallel versions
# ---------------------------------------------------------------------------------------------

class CopyToTP(torch.autograd.Function):
    """f: identity forward; all-reduce backward (each rank holds part of the input gradient)."""

    @staticmethod
    def forward(ctx, x, comm, where):
        ctx.comm, ctx.where = comm, where
        return x

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.all_reduce(grad, "backward", ctx.where), None, None


class ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward (sum the partial outputs); identity backward."""

    @staticmethod
    def forward(ctx, x, comm, where):
        return comm.all_reduce(x, "forward", where)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class GatherSequence(torch.autograd.Function):
    """SP entry: all-gather the sequence shards forward; reduce-scatter the gradient backward."""

    @staticmethod
    def forward(ctx, x, comm, where):
        ctx.comm, ctx.where = comm, where
        return comm.all_gather(x, 1, "forward", where)

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.reduce_scatter(grad, 1, "backward", ctx.where), None, None


class ScatterSequence(torch.autograd.Function):
    """SP exit: reduce-scatter partial sums to sequence shards forward; all-gather backward."""

    @staticmethod
    def forward(ctx, x, comm, where):
        ctx.comm, ctx.where = comm, where
        return comm.reduce_scatter(x, 1, "forward", where)

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.all_gather(grad, 1, "backward", ctx.where), None, None


def enter_tp(x, comm: Comm, where: str = "block"):
    """Into a TP region: f (TP), or all-gather the sequence (TP + SP)."""
    return (GatherSequence if comm.sp else CopyToTP).apply(x, comm, where)


def exit_tp(x, comm: Comm, where: str = "block"):
    """Out of a TP region: g (TP), or reduce-scatter to sequence shards (TP + SP)."""
    return (ScatterSequence if comm.sp else ReduceFromTP).apply(x, comm, where)


# ---------------------------------------------------------------------------------------------
# Layers: each takes the full reference layer and keeps this rank's slice
# ---------------------------------------------------------------------------------------------

def _shard(t: torch.Tensor, dim: int, comm: Comm) -> nn.Parameter:
    p = nn.Parameter(t.detach().chunk(comm.tp, dim)[comm.rank].clone())
    p.tp_dim = dim  # how full_tensors reassembles it
    return p


def _replicated(p: nn.Parameter, comm: Comm) -> nn.Parameter:
    """A parameter every rank holds whole. Under SP it sees only a sequence shard, so its
    gradient is partial and must be all-reduced (`sync_sequence_parallel_grads`)."""
    p.sp_partial = comm.sp
    return p


class ColumnParallelLinear(nn.Module):
    """Y_i = X A_i: this rank's output features. No communication: the caller enters the TP
    region once (f or all-gather) for all column layers that share an input (q, k, v)."""

    def __init__(self, linear: nn.Linear, comm: Comm):
        super().__init__()
        self.weight = _shard(linear.weight, 0, comm)
        self.bias = _shard(linear.bias, 0, comm) if linear.bias is not None else None

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Z = sum_i Y_i B_i: a partial sum per rank, reduced on the way out (g or reduce-scatter);
    the bias is added once, after the reduction."""

    def __init__(self, linear: nn.Linear, comm: Comm):
        super().__init__()
        self.comm = comm
        self.weight = _shard(linear.weight, 1, comm)
        self.bias = (_replicated(copy.deepcopy(linear.bias), comm)
                     if linear.bias is not None else None)

    def forward(self, x):
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
        self.q, self.k, self.v = (ColumnParallelLinear(m, comm) for m in (attn.q, attn.k, attn.v))
        self.o = RowParallelLinear(attn.o, comm)

    def forward(self, x, rope=None):
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

    def forward(self, x):
        x = enter_tp(x, self.comm)
        if self.swiglu:
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.down(F.gelu(self.up(x), approximate="tanh"))


class VocabParallelEmbedding(nn.Module):
    """Each rank holds V / tp rows; ids outside its range look up zeros; the partial
    embeddings are summed (all-reduce), or reduce-scattered to sequence shards under SP."""

    def __init__(self, embed: nn.Embedding, comm: Comm):
        super().__init__()
        self.comm = comm
        self.weight = _shard(embed.weight, 0, comm)
        self.start = comm.rank * self.weight.shape[0]

    def forward(self, idx):
        local = idx - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return exit_tp(out * inside.unsqueeze(-1), self.comm, "embed")


# ---------------------------------------------------------------------------------------------
# Vocabulary-parallel cross-entropy: three all-reduces of one number per token
# ---------------------------------------------------------------------------------------------

def _local_max(logits):
    return logits.max(dim=-1).values


def _local_sum_exp(logits, gmax):
    return (logits - gmax.unsqueeze(-1)).exp().sum(dim=-1)


def _local_target_logit(logits, targets, start):
    local = targets - start
    inside = (local >= 0) & (local < logits.shape[-1])
    picked = logits.gather(-1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    return picked * inside, local, inside


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of logits split by vocabulary, (N, V/tp) per rank, without gathering
    them: loss = log sum_v exp(z_v - m) + m - z_target, where the max m, the sum and z_target
    are each all-reduced. Backward is local: softmax minus one-hot, on this rank's columns."""

    @staticmethod
    def forward(ctx, logits, targets, comm, start):
        logits = logits.float()
        gmax = comm.all_reduce(_local_max(logits), "forward", "loss", op=dist.ReduceOp.MAX)
        total = comm.all_reduce(_local_sum_exp(logits, gmax), "forward", "loss")
        picked, local, inside = _local_target_logit(logits, targets, start)
        target = comm.all_reduce(picked, "forward", "loss")
        softmax = (logits - gmax.unsqueeze(-1)).exp() / total.unsqueeze(-1)
        ctx.save_for_backward(softmax, local.clamp(0, logits.shape[-1] - 1), inside)
        return (total.log() + gmax - target).mean()

    @staticmethod
    def backward(ctx, grad):
        softmax, local, inside = ctx.saved_tensors
        g = softmax.clone()
        g[torch.arange(len(g)), local] -= inside.to(g.dtype)
        return g * (grad / len(g)), None, None, None


def vocab_parallel_cross_entropy(logits, targets, comm: Comm, start: int):
    return VocabParallelCrossEntropy.apply(logits, targets, comm, start)


def emulate_vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                                         tp: int) -> torch.Tensor:
    """The same arithmetic in one process: split (N, V) logits into tp vocabulary shards, run each
    rank's local step, and combine as the all-reduces would. Equals F.cross_entropy."""
    if logits.dim() != 2 or logits.shape[-1] % tp:
        raise ValueError(f"need (N, V) logits with V divisible by tp {tp}, "
                         f"got {tuple(logits.shape)}")
    shards = logits.float().chunk(tp, dim=-1)
    starts = [i * shards[0].shape[-1] for i in range(tp)]
    gmax = torch.stack([_local_max(s) for s in shards]).max(0).values
    total = torch.stack([_local_sum_exp(s, gmax) for s in shards]).sum(0)
    target = torch.stack([_local_target_logit(s, targets, a)[0]
                          for s, a in zip(shards, starts)]).sum(0)
    return (total.log() + gmax - target).mean()


def cross_entropy_rank(logits: torch.Tensor, targets: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Run on every rank with the same full (N, V) logits: this rank keeps its V / tp columns,
    computes the vocabulary-parallel loss and its gradient. Returns (loss, gradient shard), to
    check against F.cross_entropy (tests and notebook)."""
    if not dist.is_initialized():
        raise ValueError("cross_entropy_rank runs inside a process group (launch.run)")
    comm = Comm(dist.get_world_size(), dist.get_rank())
    if logits.dim() != 2 or logits.shape[-1] % comm.tp:
        raise ValueError(f"need (N, V) logits with V divisible by tp {comm.tp}, "
                         f"got {tuple(logits.shape)}")
    local = logits.chunk(comm.tp, dim=-1)[comm.rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, targets, comm, comm.rank * local.shape[-1])
    loss.backward()
    return loss.item(), local.grad


# ---------------------------------------------------------------------------------------------
# The whole model
# ---------------------------------------------------------------------------------------------

class SequenceParallelPositions(nn.Embedding):
    """Learned positions (gpt2), replicated. Under SP the embedding hands each rank its sequence
    shard, so the rank adds its shard's rows of the table; without SP, all of them."""

    def __init__(self, pos: nn.Embedding, comm: Comm):
        super().__init__(pos.num_embeddings, pos.embedding_dim)
        self.comm = comm
        self.weight = _replicated(nn.Parameter(pos.weight.detach().clone()), comm)

    def forward(self, positions):
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

    def forward(self, x):
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
            _replicated(p, comm)
        block.attn, block.mlp = TPAttention(block.attn, comm), TPMLP(block.mlp, comm)
    for p in model.norm.parameters():
        _replicated(p, comm)
    model.head = ParallelHead(model.head, comm)
    if model.cfg.tied:
        model.head.weight = model.embed.weight  # the same V / tp rows serve both
    return model


def scratch_loss(model: Transformer, comm: Comm, x: torch.Tensor, y: torch.Tensor):
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


def full_tensors(model: nn.Module, what: str = "grad") -> dict[str, torch.Tensor]:
    """Gradients ('grad') or weights ('data') by reference name, shards gathered to full size.
    Works for both the scratch model (tp_dim attributes) and DTensor parameters."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        t = p.grad if what == "grad" else p.data
        if isinstance(t, DTensor):
            out[name] = t.full_tensor().detach().clone()
        elif getattr(p, "tp_dim", None) is not None:
            parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, t.detach().contiguous())
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

def parallelize_dtensor(model: Transformer, sp: bool = False, shared_input: bool = True):
    """Shard the reference model in place with DTensor over all ranks; returns (model, mesh)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    tp = dist.get_world_size()
    check_divisible(model.cfg, tp)
    mesh = init_device_mesh(rank_device().type, (tp,))
    parallelize_module(model, mesh, tp_plan(model, sp, shared_input))
    if model.cfg.tied:  # parallelize_module replaced head and embedding weights separately
        model.head.weight = model.embed.weight
    return model, mesh


# ---------------------------------------------------------------------------------------------
# Training runs, counted and measured
# ---------------------------------------------------------------------------------------------

def _build(setup: harness.Setup, kind: str, shared_input: bool = True):
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if not dist.is_initialized():
        raise ValueError("tensor parallelism needs a process group: run under torchrun or "
                         "trainbook.launch.run")
    tp, sp = dist.get_world_size(), kind.endswith("_sp")
    check_divisible(setup.model_config(), tp, setup.seq_len, sp)
    model = harness.build_model(setup).to(rank_device())
    if kind.startswith("scratch"):
        comm = Comm(tp, dist.get_rank(), sp)
        return parallelize_scratch(model, comm), comm
    return parallelize_dtensor(model, sp, shared_input)[0], None


def _forward_backward(model, comm: Comm | None, x, y):
    """Forward and backward; comm None means DTensor (the loss under loss_parallel)."""
    if comm is None:
        from torch.distributed.tensor.parallel import loss_parallel
        with loss_parallel():
            logits, loss = model(x, y)
            loss.backward()
    else:
        logits, loss = scratch_loss(model, comm, x, y)
        loss.backward()
        sync_sequence_parallel_grads(model, comm)
    return logits, loss


def _step_fn(comm: Comm | None):
    """One training step: forward, backward (with the SP gradient sum), optimizer."""
    def step(model, optimizer, x, y):
        logits, loss = _forward_backward(model, comm, x, y)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del logits
        return loss
    return step


def _op_name(op) -> str:
    name = str(op).split(".")[-1]
    return _OP_NAMES.get(name.rstrip("_"), name)


def _scalar(loss) -> float:
    return (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).item()


def run_tp(setup: harness.Setup, kind: str = "scratch", measure_memory: bool = False,
           shared_input: bool = True) -> dict:
    """Train the reference model with tensor parallelism over all ranks (every rank sees the
    whole global batch). Returns the trace in reference names, the collectives of the first
    step (scratch: counted by Comm; every kind: as CommDebugMode observes them, by op, in forward
    and backward and, separately, in the optimizer step) and, optionally, this rank's
    peak memory of one more step."""
    from torch.distributed.tensor.debug import CommDebugMode

    model, comm = _build(setup, kind, shared_input)
    opt = harness.make_optimizer(setup, model.parameters())
    step = _step_fn(comm)
    losses, first, counts, observed, in_optimizer = [], {}, None, {}, {}
    for i, (x, y) in enumerate(harness.global_batches(setup)):
        x, y = x.to(rank_device()), y.to(rank_device())
        if i == 0:  # count the first step's collectives and keep its full gradients
            mode = CommDebugMode()
            with mode, warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Full backward hook")
                _, loss = _forward_backward(model, comm, x, y)
            first = full_tensors(model, "grad")
            counts = comm.table() if comm is not None else None
            observed = {_op_name(k): v for k, v in mode.get_comm_counts().items()}
            # DTensor reduces Partial gradients when the optimizer reads them
            in_step = CommDebugMode()
            with in_step:
                opt.step()
            in_optimizer = {_op_name(k): v for k, v in in_step.get_comm_counts().items()}
            opt.zero_grad(set_to_none=True)
        else:
            loss = step(model, opt, x, y)
        losses.append(_scalar(loss))
    cpu = lambda d: {k: v.cpu() for k, v in d.items()}  # noqa: E731
    trace = harness.Trace(losses, cpu(first), cpu(full_tensors(model, "data")))
    out = {"kind": kind, "trace": trace, "counts": counts, "observed": observed,
           "in_optimizer": in_optimizer, "rank": dist.get_rank()}
    if measure_memory:
        from ..bench.memory_measure import tracked_peak
        x, y = (t.to(rank_device()) for t in harness.global_batches(setup)[0])
        out["memory"] = tracked_peak(model, opt, x, y, step=step)
    return out


def sweep(setup: harness.Setup, variants: list[dict]) -> list[dict]:
    """run_tp once per variant (its keyword arguments; a "setup" key overrides the setup), in one
    process group: one launch instead of many, since starting processes costs more than a run."""
    return [run_tp(v.get("setup", setup), **{k: a for k, a in v.items() if k != "setup"})
            for v in variants]


def estimate_memory(setup: harness.Setup, tp: int, sp: bool):
    """The memory estimator's per-rank figure for this setup (fp32, whole global batch per rank).
    Compare with AdamW: the estimator's "sgd" has a momentum buffer, the harness's SGD none."""
    from ..compute.memory import MemoryInputs, estimate

    return estimate(MemoryInputs(model=setup.model_config(), dtype="fp32",
                                 optimizer=setup.optimizer, tp=tp, sp=sp,
                                 micro_batch=setup.global_batch, seq_len=setup.seq_len))
