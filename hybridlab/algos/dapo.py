"""DAPO's data-side tricks: dynamic sampling (keep only groups whose rewards differ) and the
soft overlong penalty."""
from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import torch


def informative_groups(uids: Sequence, scores: torch.Tensor) -> list:
    """Return the group ids (in first-seen order) whose samples' scores are not all equal: a group
    where every sample earned the same reward has zero advantage and teaches nothing. Groups of
    one are kept (as verl does): their advantage is the raw score."""
    by_uid: dict = defaultdict(list)
    for uid, s in zip(uids, scores.tolist()):
        by_uid[uid].append(s)
    return [uid for uid, values in by_uid.items() if len(values) == 1 or max(values) > min(values)]


def overlong_penalty(response_lengths: torch.Tensor, max_response_length: int, buffer_len: int,
                     penalty_factor: float = 1.0) -> torch.Tensor:
    """Return DAPO's soft length penalty per sample (<= 0): zero up to
    ``max_response_length - buffer_len`` tokens, then falling linearly to ``-penalty_factor`` at
    the maximum length."""
    expected = max_response_length - buffer_len
    exceed = response_lengths.float() - expected
    return torch.clamp(-exceed / buffer_len * penalty_factor, max=0.0)
