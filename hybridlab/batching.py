"""Build the RL Batch layout from token ids: left-padded prompts + right-padded responses."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from hybridlab.algos.preference import CHOSEN_TOKENS
from hybridlab.protocol import Batch

PROMPT_WIDTH = "prompt_width"  # Batch.meta key: the width rollout ranks left-pad their prompts to
GROUP_ROWS = "group_rows"  # Batch.meta key: consecutive rows the trainer keeps in one micro-batch


def sequences_batch(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int,
                    response_len: int | None = None, prompt_len: int | None = None) -> Batch:
    """Return a Batch with ``prompts``, ``responses``, ``input_ids``, ``attention_mask``,
    ``position_ids`` and ``response_mask`` (verl's layout).

    Prompts are left-padded to the longest prompt (at least ``prompt_len``: data-parallel ranks
    pad their parts of one batch to the same width, so the parts concatenate), responses
    right-padded to ``response_len`` (default: the longest response), so every response starts
    at the same column.
    """
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    p_len = max(prompt_len or 0, max(len(p) for p in prompts))
    r_len = response_len or max(1, max(len(r) for r in responses))
    n = len(prompts)
    # filled row by row in numpy: a slice assignment there costs a tenth of torch's (a step's take
    # builds a batch of every sample on the controller, between the actor's calls)
    prompt_ids, prompt_mask = np.full((n, p_len), pad_id, dtype=np.int64), np.zeros((n, p_len), dtype=np.int64)
    response_ids, response_mask = np.full((n, r_len), pad_id, dtype=np.int64), np.zeros((n, r_len), dtype=np.int64)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        if len(r) > r_len:
            raise ValueError(f"response {i} has {len(r)} tokens, more than response_len={r_len}")
        if len(p):
            prompt_ids[i, p_len - len(p):] = p
            prompt_mask[i, p_len - len(p):] = 1
        if len(r):
            response_ids[i, :len(r)] = r
            response_mask[i, :len(r)] = 1
    prompt_ids, prompt_mask = torch.from_numpy(prompt_ids), torch.from_numpy(prompt_mask)
    response_ids, response_mask = torch.from_numpy(response_ids), torch.from_numpy(response_mask)
    mask = torch.cat([prompt_mask, response_mask], dim=1)
    return Batch({"prompts": prompt_ids, "responses": response_ids,
                  "input_ids": torch.cat([prompt_ids, response_ids], dim=1), "attention_mask": mask,
                  "position_ids": (mask.cumsum(-1) - 1).clamp(min=0), "response_mask": response_mask})


def right_padded(rows: Sequence[Sequence[float]], width: int, dtype: type = np.float32,
                 fill: float = 0) -> torch.Tensor:
    """Return a [len(rows), width] tensor of ``dtype`` with each row's values from column 0 and
    ``fill`` after them: per-token values (behaviour log-probs, policy versions) laid out under
    the right-padded responses of ``sequences_batch``."""
    out = np.full((len(rows), width), fill, dtype=dtype)
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return torch.from_numpy(out)


def on_last_token(values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Return [batch, response_len] zeros with each sample's value on its last response token
    (how outcome rewards are laid out per token): the last column where ``response_mask`` is 1,
    so a multi-turn trajectory's reward lands on the model's last token, not a tool's."""
    out = torch.zeros(response_mask.shape, dtype=torch.float32)
    width = response_mask.shape[-1]
    last = (width - 1 - response_mask.flip(-1).bool().int().argmax(-1)) * response_mask.bool().any(-1)
    out[torch.arange(len(values)), last] = values.float()
    return out


PROMPT_SIDE = ("prompts", "input_ids", "attention_mask", "position_ids")  # fields that start with the prompt


def concat_sequences(batches: Sequence[Batch]) -> Batch:
    """Return ``Batch.concat`` of sequence batches whose prompts were padded to different widths
    (separate generate calls), left-padding the narrower ones' prompt-side fields with zeros
    (masked out: attention 0, position 0, token 0) to the widest prompt."""
    width = max(b["prompts"].shape[1] for b in batches)
    padded = []
    for b in batches:
        extra = width - b["prompts"].shape[1]
        if extra:
            b = b.select(list(b.keys()))
            for key in PROMPT_SIDE:
                if key in b.tensors:
                    t = b.tensors[key]
                    b.tensors[key] = torch.cat([t.new_zeros(t.shape[0], extra), t], dim=1)
        padded.append(b)
    return Batch.concat(padded)


def preference_batch(prompts: Sequence[Sequence[int]], chosen: Sequence[Sequence[int]],
                     rejected: Sequence[Sequence[int]], pad_id: int) -> Batch:
    """Return preference pairs in verl's layout, each pair's chosen row followed by its rejected
    one, marked as pairs (``as_pairs``)."""
    rows = [p for p in prompts for _ in range(2)]
    responses = [r for pair in zip(chosen, rejected) for r in pair]
    return as_pairs(sequences_batch(rows, responses, pad_id))


def as_pairs(batch: Batch) -> Batch:
    """Return ``batch`` (rows chosen, rejected, chosen, ...) marked as preference pairs: kept
    together through micro-batching (``meta[GROUP_ROWS]`` 2), with the chosen responses' token
    total on every row (``chosen_tokens_total``, for the ``sft`` term)."""
    batch.tensors[CHOSEN_TOKENS] = torch.full((len(batch),), float(batch["response_mask"][0::2].sum()))
    batch.meta[GROUP_ROWS] = 2
    return batch
