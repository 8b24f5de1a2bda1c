"""Micro-batches for the training engine: by row count or by a token budget, padded or packed.

A batch arrives in verl's layout, every row padded to one width (left-padded prompt + right-
padded response). Two settings change how the engine cuts it into micro-batches (verl's
``use_dynamic_bsz`` and ``use_remove_padding``):

- ``tokens`` > 0: each micro-batch holds as many rows as fit in that many tokens instead of a
  fixed row count. Packed, a row costs its real length (first fit, longest rows first). Padded,
  every row costs the batch width, so the budget is a row count (``tokens // width``) and all
  micro-batches keep one shape, as Megatron's pipeline schedule wants.
- ``packed``: the real tokens of a micro-batch's rows are laid end to end in one sequence,
  with ``cu_seqlens`` marking where each row starts. Attention stays inside each row (the
  engine's attention runs one causal kernel per segment), and RoPE restarts per row, so every
  log-prob equals the padded computation's; only the padding's matmuls are gone.

``padded_share`` reports the share of the tokens the model computed that were padding.

A batch whose ``meta[GROUP_ROWS]`` is g > 1 (preference pairs: chosen, rejected) keeps each run
of g consecutive rows in one micro-batch, whatever the setting: its loss needs all of them.
"""
from __future__ import annotations

import dataclasses

import torch

from hybridlab.batching import GROUP_ROWS  # consecutive rows that must share a micro-batch


@dataclasses.dataclass
class MicroBatch:
    """One micro-batch: per-row tensors of its rows, and where they sit in the batch."""

    tensors: dict[str, torch.Tensor]  # rows of the batch (padded layout), as the loss sees them
    rows: list[int]                   # their indices in the batch
    computed_tokens: int              # tokens the model runs on (padding included)
    packed: dict | None = None        # pack()'s model inputs when packed


def plan(lengths: list[int], width: int, rows: int, tokens: int = 0, packed: bool = False) -> list[list[int]]:
    """Return the row indices of each micro-batch.

    ``tokens`` 0: consecutive runs of ``rows`` rows. Otherwise rows are placed longest first into
    the first micro-batch with room for them under ``tokens``, a row costing ``width`` (padded)
    or its real length (packed); a row longer than the budget gets a micro-batch of its own.
    """
    n = len(lengths)
    if tokens <= 0:
        size = max(1, min(rows, n))
        return [list(range(i, min(i + size, n))) for i in range(0, n, size)]
    cost = [length if packed else width for length in lengths]
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(n), key=lambda r: -cost[r]):
        slot = next((b for b, free in enumerate(room) if free >= cost[i]), None)
        if slot is None:
            bins.append([i])
            room.append(tokens - cost[i])
        else:
            bins[slot].append(i)
            room[slot] -= cost[i]
    return [sorted(b) for b in bins]


def pack(tensors: dict[str, torch.Tensor], pad_to: int = 0, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Return the packed model inputs of one micro-batch: ``input_ids`` [1, T] (its rows' real
    tokens end to end), ``cu_seqlens`` (int32, row starts plus T), ``max_seqlen`` and
    ``response_index`` [rows, response_len]: where in the packed sequence sits the logit that
    predicts each response token; ``real_tokens``: T. ``pad_to`` > T appends a padding segment
    up to that length (pipeline stages exchange activations of one fixed shape)."""
    mask = tensors["attention_mask"].bool()
    lengths = mask.sum(1)
    ids = tensors["input_ids"][mask]  # row-major: row 0's real tokens, then row 1's, ...
    where = (mask.flatten().long().cumsum(0) - 1).clamp(min=0).view(mask.shape)
    resp_len = tensors["responses"].shape[1]
    response_index = where[:, -resp_len - 1:-1]
    real_tokens = ids.numel()
    if pad_to > ids.numel():
        extra = pad_to - ids.numel()
        ids = torch.cat([ids, ids.new_full((extra,), pad_id)])
        lengths = torch.cat([lengths, lengths.new_tensor([extra])])
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0)
    return {"input_ids": ids.unsqueeze(0), "cu_seqlens": cu, "max_seqlen": int(lengths.max()),
            "response_index": response_index, "real_tokens": real_tokens}


def grouped_plan(lengths: list[int], width: int, rows: int, tokens: int, packed: bool, group: int) -> list[list[int]]:
    """``plan`` over units of ``group`` consecutive rows (a unit costs its rows' sum); returns row indices."""
    if group <= 1:
        return plan(lengths, width, rows, tokens, packed)
    if len(lengths) % group:
        raise ValueError(f"{len(lengths)} rows do not split into groups of {group} (meta {GROUP_ROWS!r})")
    units = [sum(lengths[i:i + group]) for i in range(0, len(lengths), group)]
    bins = plan(units, width * group, max(1, rows // group), tokens, packed)
    return [[u * group + k for u in b for k in range(group)] for b in bins]


def micro_batches(tensors: dict[str, torch.Tensor], rows: int, tokens: int = 0, packed: bool = False,
                  one_length: bool = False, group: int = 1) -> list[MicroBatch]:
    """Return the micro-batches of a batch's tensors. Padded, all have one shape (the last is
    filled with repeats of row 0, masked out of the loss); packed with ``one_length``, every
    pack is padded to the longest, as Megatron's pipeline schedule wants at PP > 1. ``group``
    keeps runs of that many consecutive rows together (``GROUP_ROWS``)."""
    mask = tensors["attention_mask"]
    n, width = mask.shape
    if not packed and tokens > 0:  # padded, every row costs the width: the budget is a row count
        rows, tokens = max(1, tokens // width), 0
    groups = grouped_plan(mask.sum(1).tolist(), width, rows, tokens, packed, group)
    if not packed and n % len(groups[0]):
        tensors = pad_rows(tensors, len(groups) * len(groups[0]))
        groups[-1] = list(range(groups[-1][0], len(groups) * len(groups[0])))
    parts = [{k: v.index_select(0, torch.as_tensor(g)) for k, v in tensors.items()} for g in groups]
    if not packed:
        return [MicroBatch(part, group, len(group) * width) for part, group in zip(parts, groups)]
    pad_to = max(int(p["attention_mask"].sum()) for p in parts) if one_length else 0
    out = []
    for part, group in zip(parts, groups):
        inputs = pack(part, pad_to)
        out.append(MicroBatch(part, group, inputs["input_ids"].shape[1], inputs))
    return out


def pad_rows(tensors: dict[str, torch.Tensor], total: int) -> dict[str, torch.Tensor]:
    """Return the rows with filler rows appended up to ``total``: copies of row 0 that are all
    padding (attention and response masks 0), so no loss, routing or count ever sees them."""
    n = len(tensors["attention_mask"])
    if total <= n:
        return tensors
    out = {k: torch.cat([v, v[:1].expand(total - n, *v.shape[1:])]) for k, v in tensors.items()}
    for key in ("attention_mask", "response_mask"):
        if key in out:
            out[key][n:] = 0
    return out


def even_micro_batches(tensors: dict[str, torch.Tensor], rows: int, total: int, group: int = 1) -> list[MicroBatch]:
    """Return ``ceil(total / rows)`` padded micro-batches of at most ``rows`` rows each (the fewest
    that hold ``total`` rows): the batch's rows spread over them in consecutive runs (runs of
    ``group`` rows kept whole), the rest filler rows that are all padding (placed after the real
    rows in the index, so ``gather_rows`` drops them). Ranks holding different row counts, up to
    ``total``, then run micro-batches of one count and shape, as expert parallelism's all-gathers
    need, each with real rows while there are enough."""
    n, width = tensors["attention_mask"].shape
    count = -(-total // rows)
    runs = -(-total // group)  # the most runs of ``group`` rows a rank of the group holds
    rows = -(-runs // count) * group  # the fewest rows that hold them: fillers only even the ranks out
    blank = pad_rows({k: v[:1] for k, v in tensors.items()}, 2)
    blank = {k: v[1:] for k, v in blank.items()}  # one row of padding only
    out, fillers = [], n
    for run in torch.tensor_split(torch.arange(n // group), count):
        real = (run.unsqueeze(1) * group + torch.arange(group)).reshape(-1)
        extra = rows - len(real)
        part = {k: torch.cat([v.index_select(0, real), blank[k].expand(extra, *v.shape[1:])])
                for k, v in tensors.items()}
        out.append(MicroBatch(part, real.tolist() + list(range(fillers, fillers + extra)), rows * width))
        fillers += extra
    return out


def padded_share(micros: list[MicroBatch], real_tokens: int) -> float:
    """Return the share of computed tokens that were padding (0 when every token was real)."""
    computed = sum(m.computed_tokens for m in micros)
    return 1.0 - real_tokens / computed if computed else 0.0


def gather_rows(values: list[torch.Tensor], micros: list[MicroBatch], n: int) -> torch.Tensor:
    """Return the per-row outputs of every micro-batch put back in batch order (first ``n`` rows)."""
    rows = torch.as_tensor([r for m in micros for r in m.rows])
    stacked = torch.cat(values)
    out = stacked.new_zeros((int(rows.max()) + 1, *stacked.shape[1:]))
    out[rows] = stacked
    return out[:n]


def spread(named: dict[str, torch.Tensor], real: torch.Tensor) -> dict[str, torch.Tensor]:
    """Return per-token outputs of a packed micro-batch (one value per real response token, in
    row-major order) laid out as [rows, response_len], zeros at the padding (``real`` False)."""
    out = {}
    for key, values in named.items():
        out[key] = values.new_zeros(real.shape)
        out[key][real] = values
    return out
