"""The resharding plan: which slices of which tensors each rollout rank needs, from where.

Both Megatron and vLLM shard every tensor of a Qwen2/3(-MoE), Llama or Mistral model as a contiguous range of
its HF form along one dimension (rows of q/k/v/gate/up/embeddings/lm_head, columns of o/down;
norms whole). So a plan is interval arithmetic: for each rollout rank and tensor, the range it
needs, cut into pieces by the trainer ranks that hold them. Pure functions, no processes.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict

from hybridlab.models.spec import ModelSpec

ROW_SPLIT = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
COL_SPLIT = ("o_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class TrainerLayout:
    """Megatron layout; ranks are ordered tp fastest, then dp, then pp (megatron's default)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1

    def rank(self, tp: int, pp: int, dp: int) -> int:
        """Return the global rank of the (tp, pp, dp) coordinates."""
        return tp + self.tp * (dp + self.dp * pp)


@dataclasses.dataclass(frozen=True)
class RolloutLayout:
    """vLLM layout: ``replicas`` engines of ``tp`` ranks each; rank = replica * tp + tp_rank."""

    tp: int = 1
    replicas: int = 1


@dataclasses.dataclass(frozen=True)
class Piece:
    """Rows or columns [start, stop) of HF tensor ``name`` along ``dim`` (dim -1: the whole tensor),
    copied from trainer rank ``src`` to rollout rank ``dst``."""

    dst: int
    src: int
    name: str
    dim: int
    start: int
    stop: int
    nbytes: int


@dataclasses.dataclass
class ReshardPlan:
    """Every piece that moves, with byte totals per rollout rank."""

    trainer: TrainerLayout
    rollout: RolloutLayout
    pieces: list[Piece]
    whole: bool = False  # every rollout rank receives whole tensors (its engine cuts its shard)

    def bytes_to(self, dst: int) -> int:
        """Return the bytes rollout rank ``dst`` receives."""
        return sum(p.nbytes for p in self.pieces if p.dst == dst)

    @property
    def total_bytes(self) -> int:
        """Return the bytes moved in all."""
        return sum(p.nbytes for p in self.pieces)

    def summary(self) -> dict:
        """Return a JSON-friendly summary: layouts, pieces, bytes per rollout rank and sender."""
        sent: dict[int, int] = defaultdict(int)
        pairs: dict[str, int] = defaultdict(int)
        for p in self.pieces:
            sent[p.src] += p.nbytes
            pairs[f"{p.src}->{p.dst}"] += p.nbytes
        return {"trainer": dataclasses.asdict(self.trainer), "rollout": dataclasses.asdict(self.rollout),
                "whole_tensors": self.whole, "pieces": len(self.pieces), "total_bytes": self.total_bytes,
                "bytes_to_rollout_rank": {d: self.bytes_to(d) for d in range(self.rollout.tp * self.rollout.replicas)},
                "bytes_from_trainer_rank": dict(sorted(sent.items())),
                "bytes_per_pair": dict(sorted(pairs.items()))}  # "trainer rank->rollout rank"


def hf_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Return every HF tensor name of the model with its shape."""
    if not spec.converted:  # read from the checkpoint's files
        return dict(spec.tensor_shapes)
    h, d = spec.hidden, spec.head_dim
    shapes = {"model.embed_tokens.weight": (spec.vocab_size, h), "model.norm.weight": (h,)}
    if not spec.tied:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (spec.heads * d, h),
                       p + "self_attn.k_proj.weight": (spec.kv_heads * d, h),
                       p + "self_attn.v_proj.weight": (spec.kv_heads * d, h),
                       p + "self_attn.o_proj.weight": (h, spec.heads * d)})
        mlps = [(p + "mlp.", spec.intermediate)]
        if spec.is_sparse(i):
            shapes[p + "mlp.gate.weight"] = (spec.moe.experts, h)
            mlps = [(f"{p}mlp.experts.{e}.", spec.moe.intermediate) for e in range(spec.moe.experts)]
        for m, width in mlps:
            shapes.update({m + "gate_proj.weight": (width, h), m + "up_proj.weight": (width, h),
                           m + "down_proj.weight": (h, width)})
        if spec.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
        if spec.qkv_bias:
            shapes.update({p + f"self_attn.{x}_proj.bias": ((spec.heads if x == "q" else spec.kv_heads) * d,)
                           for x in "qkv"})
    return shapes


def split_dim(name: str) -> int:
    """Return the dimension along which TP shards ``name`` (-1: replicated)."""
    short = name.split(".")[-2]
    if short in ROW_SPLIT:
        return 0
    if short in COL_SPLIT:
        return 1
    return -1


def stage_of(name: str, spec: ModelSpec, pp: int) -> int:
    """Return the pipeline stage that holds HF tensor ``name`` (tied embeddings: the first)."""
    if name.startswith("model.layers."):
        return int(name.split(".")[2]) // (spec.layers // pp)
    if name == "model.embed_tokens.weight":
        return 0
    return pp - 1  # final norm, lm_head


def buckets(spec: ModelSpec, bucket_bytes: int, itemsize: int = 4) -> list[list[str]]:
    """Return HF tensor names grouped into buckets of about ``bucket_bytes`` (full tensors).

    The engine fuses q/k/v and gate/up when loading, so those travel together, and it holds a
    layer's experts in one fused tensor that a reload re-creates whole, so all of a layer's
    experts travel together; only such a group larger than the limit on its own makes a bucket
    exceed it.
    """
    import math

    shapes = hf_shapes(spec)
    groups: dict[str, list[str]] = {}
    for name in shapes:
        short = name.split(".")[-2]
        prefix = name.rsplit(".", 2)[0]
        key = name.split(".experts.")[0] + ".experts" if ".mlp.experts." in name else \
            f"{prefix}.qkv" if short in ("q_proj", "k_proj", "v_proj") else \
            f"{prefix}.gate_up" if short in ("gate_proj", "up_proj") else name
        groups.setdefault(key, []).append(name)
    out, current, size = [], [], 0
    for names in groups.values():
        group_bytes = sum(math.prod(shapes[n]) * itemsize for n in names)
        if current and size + group_bytes > bucket_bytes:
            out.append(current)
            current, size = [], 0
        current += names
        size += group_bytes
    if current:
        out.append(current)
    return out


def _range(size: int, parts: int, index: int, spec: ModelSpec, name: str) -> tuple[int, int]:
    """The [start, stop) of shard ``index`` of ``parts`` along a dim of ``size``."""
    short = name.split(".")[-2]
    if short in ("k_proj", "v_proj") and parts > spec.kv_heads:  # vLLM replicates KV heads
        heads = spec.kv_heads
        head = index * heads // parts
        return head * spec.head_dim, (head + 1) * spec.head_dim
    per = size // parts
    return index * per, (index + 1) * per


def plan_reshard(spec: ModelSpec, trainer: TrainerLayout, rollout: RolloutLayout, itemsize: int = 4,
                 whole: bool = False) -> ReshardPlan:
    """Return the plan that gives every rollout rank its shard of every tensor (``whole``: every
    tensor whole, for engines that cut their shard themselves on load, as vLLM's loader does).

    Each rollout replica reads from one trainer data-parallel replica (replica % dp), so the
    sending load spreads over DP replicas.
    """
    spec.check_layout(trainer.tp, trainer.pp)
    pieces = []
    for name, shape in hf_shapes(spec).items():
        dim = split_dim(name)
        row_bytes = itemsize * (1 if len(shape) == 1 else (shape[1] if dim == 0 else shape[0]))
        for replica in range(rollout.replicas):
            dp = replica % trainer.dp
            for r_tp in range(rollout.tp):
                dst = replica * rollout.tp + r_tp
                stage = stage_of(name, spec, trainer.pp)
                if dim < 0:
                    numel = 1
                    for s in shape:
                        numel *= s
                    pieces.append(Piece(dst, trainer.rank(0, stage, dp), name, -1, 0, shape[0], numel * itemsize))
                    continue
                lo, hi = (0, shape[dim]) if whole else _range(shape[dim], rollout.tp, r_tp, spec, name)
                per = shape[dim] // trainer.tp
                for t_tp in range(lo // per, (hi - 1) // per + 1):
                    a, b = max(lo, t_tp * per), min(hi, (t_tp + 1) * per)
                    pieces.append(Piece(dst, trainer.rank(t_tp, stage, dp), name, dim, a, b, (b - a) * row_bytes))
    return ReshardPlan(trainer, rollout, pieces, whole)
