"""The layout of a training step over ranks: one type, one set of rules, one named mesh.

A `Layout` says how dp * tp * pp * cp ranks split the work (ep is carved out of dp): data
parallel replicas (`dp`, of which `dp_replicate` groups replicate while the rest shard, as in
HSDP, when `zero` > 0), tensor, pipeline and context parallel degrees, the ZeRO stage, the
micro-batch, recomputation and pipeline interleaving. `layout_rules` is the one place that says
which layouts a model admits; the planner (Part 5), the memory estimator and the trainer all ask
it. `mesh_shape` names the mesh dimensions the trainer builds with `init_device_mesh`, in
torchtitan's order (pp outermost, tp innermost: TP needs the fastest links).

Chapter: book/parallelism/putting-it-together.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from numbers import Integral

from .configs import ModelConfig

RECOMPUTE = ("none", "selective", "full")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zbv")
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # outermost first


@dataclass(frozen=True)
class Layout:
    """One way to lay a training step out on dp * tp * pp * cp ranks (ep is carved out of dp)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    micro_batch: int = 1
    recompute: str = "none"
    interleave: int = 1
    dp_replicate: int = 1  # with zero > 0: replica groups of the dp ranks (HSDP); 1: FSDP
    pp_schedule: str = "1f1b"

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def dp_shard(self) -> int:
        """Ranks that shard parameters, gradients and optimizer state (1 without ZeRO)."""
        return self.dp // self.dp_replicate if self.zero else 1

    @property
    def replicas(self) -> int:
        """Ranks that hold the same shard: all dp ranks without ZeRO, dp_replicate with it."""
        return self.dp // self.dp_shard

    def mesh_shape(self) -> dict[str, int]:
        """The named mesh dimensions and their sizes, outermost first (see MESH_DIMS)."""
        sizes = {"pp": self.pp, "dp_replicate": self.replicas, "dp_shard": self.dp_shard,
                 "cp": self.cp, "tp": self.tp}
        return {d: sizes[d] for d in MESH_DIMS}

    def short(self) -> str:
        s = f"dp={self.dp},tp={self.tp},pp={self.pp},cp={self.cp}"
        return s + (f",ep={self.ep}" if self.ep > 1 else "")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def parse(cls, text: str, **defaults: int | str) -> Layout:
        """'tp=8,pp=16,dp=128' (any of the fields, comma-separated) -> Layout."""
        values = dict(defaults)
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, eq, value = part.partition("=")
            key = key.strip().replace("-", "_")
            if not eq or key not in cls.__dataclass_fields__:
                raise ValueError(f"cannot read {part!r} in layout {text!r}; write key=value pairs "
                                 f"such as 'tp=8,pp=16,dp=128' (keys: "
                                 f"{', '.join(cls.__dataclass_fields__)})")
            value = value.strip()
            if key in ("recompute", "pp_schedule"):
                values[key] = value
            else:
                try:
                    values[key] = int(value)
                except ValueError:
                    raise ValueError(f"{key} must be a whole number, got {value!r}") from None
        return cls(**values)

    @classmethod
    def from_dict(cls, d: dict) -> Layout:
        """A layout from a dict with (a subset of) its fields; other keys are ignored, so a row
        of `plan --json` reads as it is."""
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


def stage_layers(n_layers: int, stages: int) -> int | None:
    """Layers on the heaviest stage, or None when the layers do not split over `stages`.

    Either the stages divide the layers, or the first and last stages each carry one block
    fewer, as Llama 3 does to balance the embedding and the head (126 layers on 16 stages)."""
    per = -(-n_layers // stages)
    if n_layers % stages == 0 or (per >= 2 and stages >= 2 and per * stages - n_layers <= 2):
        return per
    return None


def layout_rules(layout: Layout, cfg: ModelConfig, seq_len: int | None = None,
                 sequences: int | None = None) -> list[str]:
    """Every rule the layout breaks for this model (and sequence length and global batch in
    sequences, when given), in words; empty when it breaks none."""
    L, out = layout, []
    for name in ("dp", "tp", "pp", "cp", "ep", "micro_batch", "interleave", "dp_replicate"):
        v = getattr(L, name)
        if isinstance(v, bool) or not isinstance(v, Integral) or v < 1:
            return [f"{name} must be a positive whole number, got {v!r}"]
    for what, n in (("heads", cfg.n_heads), ("key/value heads", cfg.n_kv_heads),
                    ("MLP size", cfg.d_ff)):
        if n % L.tp:
            out.append(f"tp {L.tp} does not divide {n} {what}")
    if stage_layers(cfg.n_layers, L.pp * L.interleave) is None:
        each = f" x interleave {L.interleave}" if L.interleave > 1 else ""
        out.append(f"pp {L.pp}{each} does not divide {cfg.n_layers} layers (even with the first "
                   "and last stages one block short)")
    if L.interleave > 1 and L.pp == 1:
        out.append(f"interleave {L.interleave} needs pp > 1")
    if L.pp_schedule not in PP_SCHEDULES:
        out.append(f"pp_schedule {L.pp_schedule!r} is not one of {', '.join(PP_SCHEDULES)}")
    if seq_len is not None and seq_len % L.cp:
        out.append(f"cp {L.cp} does not divide the sequence length {seq_len}")
    if L.ep > 1 and not cfg.is_moe:
        out.append(f"ep {L.ep} needs a mixture-of-experts model; {cfg.name} is dense")
    elif cfg.n_experts % L.ep:
        out.append(f"ep {L.ep} does not divide {cfg.n_experts} experts")
    if L.dp % L.ep:
        out.append(f"ep {L.ep} does not divide dp {L.dp} (expert ranks are carved out of dp)")
    if L.zero not in (0, 1, 2, 3):
        out.append(f"ZeRO stage {L.zero!r} is not 0, 1, 2 or 3")
    elif L.zero and L.dp < 2:
        out.append(f"ZeRO stage {L.zero} shards over dp ranks and needs dp > 1")
    if L.dp % L.dp_replicate:
        out.append(f"dp_replicate {L.dp_replicate} does not divide dp {L.dp}")
    elif L.dp_replicate > 1 and not L.zero:
        out.append(f"dp_replicate {L.dp_replicate} is HSDP's replica groups and needs zero > 0 "
                   "(without ZeRO every dp rank is a replica already)")
    if L.recompute not in RECOMPUTE:
        out.append(f"recompute {L.recompute!r} is not one of {', '.join(RECOMPUTE)}")
    if sequences is not None:
        if sequences % (L.dp * L.micro_batch):
            out.append(f"global batch of {sequences:,} sequences does not split into dp {L.dp} "
                       f"x micro-batch {L.micro_batch}")
        elif L.pp > 1 and sequences // (L.dp * L.micro_batch) < L.pp:
            out.append(f"{sequences // (L.dp * L.micro_batch)} micro-batch(es) per replica "
                       f"cannot fill {L.pp} pipeline stages (need at least pp)")
    return out


def check_layout(layout: Layout, cfg: ModelConfig, seq_len: int | None = None,
                 sequences: int | None = None) -> None:
    """Raise one ValueError that lists every broken rule."""
    broken = layout_rules(layout, cfg, seq_len, sequences)
    if broken:
        raise ValueError(f"layout {layout.short()} does not fit {cfg.name}: " + "; ".join(broken))
