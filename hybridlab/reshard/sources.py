"""What a trainer rank does in a weight sync, inside its own process (called by ActorWorker).

- ``local_slices``: this rank's shard of a bucket as HF-named slices, no collective at all
  (the separate placement: each TP rank sends its own rows or columns, the rollout rank joins
  them, exactly the pieces of ``plan_reshard``);
- ``gather_stage``: the TP all-gather of a stage into whole HF tensors (checkpoints, exports);
- ``stream_colocated``: the hybrid engine, where each process loads whole tensors into its own
  engine, so every rank gathers every bucket (and pipeline stages broadcast theirs).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

import torch

from hybridlab.reshard.plan import hf_shapes, split_dim, stage_of
from hybridlab.workers.train.convert import megatron_names, megatron_to_hf


def _stage_params(engine, hf_names: list[str]) -> dict[str, torch.Tensor]:
    params = dict(engine.model.named_parameters())
    ep, ps = getattr(engine, "ep", 1), engine.ps
    names = megatron_names(engine.spec, engine.pp, ps.get_pipeline_model_parallel_rank(), hf_names, ep,
                           ps.get_expert_model_parallel_rank() if ep > 1 else 0)
    return {n: params[n].detach() for n in names if n in params}


def all_experts(engine, named: dict[str, torch.Tensor], everyone: bool = True) -> dict[str, torch.Tensor]:
    """Return ``named`` (Megatron names) with the experts of every rank of this rank's expert-
    parallel group, numbered globally (``local_experts.{k}`` of EP rank r is expert
    ``r * experts / ep + k``), so the conversion sees whole layers; unchanged without EP. Not
    ``everyone``: only EP rank 0 (DP rank 0) gets them, the others none (checkpoints gather
    there: no rank holds the whole model's experts for nothing)."""
    import torch.distributed as dist

    ep = getattr(engine, "ep", 1)
    if ep == 1:
        return named
    group, per = engine.ps.get_expert_model_parallel_group(), engine.spec.moe.experts // ep
    root = engine.ps.get_expert_model_parallel_rank() == 0
    out = {name: t for name, t in named.items() if ".experts.local_experts." not in name}
    # Every rank of the group holds the same local names: sorted, they pair up in each collective.
    for name in sorted(set(named) - set(out)):
        tensor = named[name].contiguous()
        parts = [torch.empty_like(tensor) for _ in range(ep)] if everyone or root else None
        if everyone:
            dist.all_gather(parts, tensor, group=group)
        else:
            dist.gather(tensor, parts, dst=dist.get_process_group_ranks(group)[0], group=group)
        head, sep, tail = name.partition(".experts.local_experts.")
        k, rest = tail.split(".", 1)
        for r, part in enumerate(parts or ()):
            out[f"{head}{sep}{r * per + int(k)}.{rest}"] = part
    return out


def local_slices(engine, hf_names: list[str]) -> dict[str, torch.Tensor]:
    """Return this rank's slices of the HF tensors in ``hf_names`` that its pipeline stage holds,
    in HF names: rows (q, k, v, gate, up, embeddings, lm_head) or columns (o, down) of its TP
    shard; replicated tensors (norms) only from TP rank 0. No communication, except the experts'
    gather over the expert-parallel group when there is one (``all_experts``)."""
    ps, spec = engine.ps, engine.spec
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    # One shard of a tp-way split is itself a model with tp-times fewer heads: convert it alone.
    local = dataclasses.replace(spec, heads=spec.heads // tp, kv_heads=spec.kv_heads // tp)
    out = megatron_to_hf([all_experts(engine, _stage_params(engine, hf_names))], local, engine.pp,
                         ps.get_pipeline_model_parallel_rank())
    return {k: v for k, v in out.items() if k in hf_names and (tp_rank == 0 or split_dim(k) >= 0)}


def join_slices(parts: list[tuple[int, dict[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """Join ``(tp_rank, slices)`` from the TP ranks of the stages that feed one rollout rank into
    whole HF tensors (rows or columns in TP order; replicated tensors as sent)."""
    pieces: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for tp_rank, slices in parts:
        for name, tensor in slices.items():
            pieces.setdefault(name, []).append((tp_rank, tensor))
    out = {}
    for name, items in pieces.items():
        items.sort(key=lambda item: item[0])
        dim = split_dim(name)
        out[name] = items[0][1] if dim < 0 else torch.cat([t for _, t in items], dim=dim)
    return out


def gather_stage(engine, named: dict[str, torch.Tensor], everyone: bool = False) -> dict[str, torch.Tensor] | None:
    """All-gather the TP shards ``named`` (Megatron names) of this stage; return them as HF
    tensors on (tp 0, dp 0), or on every rank with ``everyone``; None elsewhere. A critic's
    value head comes back as ``value_head.linear.*``."""
    import torch.distributed as dist

    ps = engine.ps
    tp = ps.get_tensor_model_parallel_world_size()
    named = all_experts(engine, named, everyone)
    shards = [dict() for _ in range(tp)]
    for name, tensor in named.items():
        parts = [torch.empty_like(tensor) for _ in range(tp)] if tp > 1 else [tensor]
        if tp > 1:
            dist.all_gather(parts, tensor.contiguous(), group=ps.get_tensor_model_parallel_group())
        for r in range(tp):
            shards[r][name] = parts[r]
    if not everyone and (ps.get_tensor_model_parallel_rank() != 0 or ps.get_data_parallel_rank() != 0):
        return None
    hf_names = {k: v for k, v in named.items() if not k.startswith("output_layer.linear")}
    out = megatron_to_hf([{k: s[k] for k in hf_names} for s in shards], engine.spec, engine.pp,
                         ps.get_pipeline_model_parallel_rank())
    for k in ("weight", "bias"):
        if f"output_layer.linear.{k}" in named:
            out[f"value_head.linear.{k}"] = named[f"output_layer.linear.{k}"]
    return out


def stream_colocated(engine, buckets: list[list[str]], load: Callable[[list[tuple[str, torch.Tensor]]], object]) -> dict:
    """Gather each bucket on every rank (TP all-gather, then a broadcast from the stage that
    owns it) and hand it to ``load`` (the colocated engine) in memory, one bucket at a time;
    returns {"bytes", "buckets", "seconds"}."""
    import torch.distributed as dist

    ps = engine.ps
    shapes = hf_shapes(engine.spec)
    pp_ranks = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()) if engine.pp > 1 else None
    start, moved = time.perf_counter(), 0
    for bucket in buckets:
        named = gather_stage(engine, _stage_params(engine, bucket), everyone=True) or {}
        if engine.pp > 1:  # every process needs every stage's layers for its own engine
            for name in bucket:
                owner = stage_of(name, engine.spec, engine.pp)
                tensor = named[name] if owner == ps.get_pipeline_model_parallel_rank() else torch.empty(shapes[name])
                dist.broadcast(tensor, src=pp_ranks[owner], group=ps.get_pipeline_model_parallel_group())
                named[name] = tensor
        moved += sum(t.numel() * t.element_size() for t in named.values())
        load([(n, named[n]) for n in bucket])
        del named
    return {"bytes": moved, "buckets": len(buckets), "seconds": time.perf_counter() - start}
