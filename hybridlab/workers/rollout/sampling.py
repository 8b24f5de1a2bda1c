"""Sampling settings shared by the rollout backends, and prompt-length checks."""
from __future__ import annotations

import dataclasses
from typing import Sequence


@dataclasses.dataclass
class SamplingConfig:
    """How responses are drawn. ``temperature=0`` means greedy."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0              # 0: no top-k cut
    max_tokens: int = 32
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False    # generate max_tokens whatever the model says (benchmarks)

    def validate(self) -> "SamplingConfig":
        """Raise ValueError naming the first impossible field; returns self."""
        if self.n < 1:
            raise ValueError(f"sampling n must be at least 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"sampling temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"sampling top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"sampling max_tokens must be at least 1, got {self.max_tokens}")
        return self


def fit_prompts(prompts: Sequence[Sequence[int]], max_tokens: int, context: int, truncate: bool,
                indices: Sequence | None = None) -> list[list[int]]:
    """Return the prompts, left-truncated to fit ``context - max_tokens`` when ``truncate``;
    otherwise raise ValueError naming the first prompt that does not fit."""
    room = context - max_tokens
    if room < 1:
        raise ValueError(f"max_tokens={max_tokens} leaves no room for a prompt in a context of {context}")
    out = []
    for i, p in enumerate(prompts):
        if len(p) > room:
            if not truncate:
                where = indices[i] if indices is not None else f"{i} of this chunk"
                raise ValueError(f"prompt {where} has {len(p)} tokens; with max_tokens={max_tokens} it does not fit"
                                 f" the model's context of {context} (set truncate_prompts=True to keep its last"
                                 f" {room} tokens)")
            p = p[-room:]
        out.append(list(p))
    return out
