"""One trajectory as one token sequence: the prompt, then turns tagged by who wrote them.

The trainer sees a trajectory as verl's multi-turn layout: the first prompt left-padded, then
everything after it as the "response", where the model's own tokens have ``response_mask`` 1
(trained, with the log-probs they were sampled with) and tool, environment and user tokens
have 0 (context only). Every token is attended to.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from hybridlab.batching import sequences_batch
from hybridlab.protocol import Batch

MODEL, TOOL, ENV, USER, TEMPLATE = "model", "tool", "env", "user", "template"  # sources of response tokens
SOURCES = ("", MODEL, TOOL, ENV, USER, TEMPLATE)  # the codes of ``token_sources`` (0: padding)


@dataclasses.dataclass
class Segment:
    """A run of tokens from one source; model segments carry their log-probs and the weight
    version that sampled each token (a turn generated across a weight sync has two)."""

    ids: list[int]
    source: str
    logprobs: list[float] | None = None
    versions: list[int] | None = None


@dataclasses.dataclass
class Trajectory:
    """The token record of one agent run, built only from sampled and tokenized ids."""

    prompt_ids: list[int]
    segments: list[Segment] = dataclasses.field(default_factory=list)
    reward: float | None = None
    info: dict = dataclasses.field(default_factory=dict)   # numbers the agent returned beside its reward
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    retokenized: int = 0      # calls whose rendered prompt did not extend the recorded tokens (of ``turns``)
    error: str = ""           # the agent raised: its message (the trajectory scores error_score)
    final_text: str = ""      # the last model turn's text (what a rule reward scores)
    tools_used: dict = dataclasses.field(default_factory=dict)   # tool name -> [calls, errors, seconds]

    def add_model(self, ids: Sequence[int], logprobs: Sequence[float], version: int | Sequence[int]) -> None:
        """Append a model turn's sampled ids with their log-probs and the version that sampled
        them (one for the turn, or one per token)."""
        versions = [version] * len(ids) if isinstance(version, int) else list(version)
        if not len(ids) == len(logprobs) == len(versions):
            raise ValueError(f"{len(ids)} sampled ids but {len(logprobs)} log-probs and {len(versions)} versions")
        self.segments.append(Segment(list(ids), MODEL, list(logprobs), versions))
        self.turns += 1

    def add_context(self, ids: Sequence[int], source: str) -> None:
        """Append tokens the model did not write (a tool's answer, the template's turn markers)."""
        if ids:
            self.segments.append(Segment(list(ids), source))

    def all_ids(self) -> list[int]:
        """Return the whole sequence: the prompt, then every segment."""
        return [*self.prompt_ids, *self.response_ids()]

    def response_ids(self) -> list[int]:
        """Return the tokens after the prompt."""
        return [t for s in self.segments for t in s.ids]

    def response_mask(self) -> list[int]:
        """Return 1 for each model token after the prompt, 0 for context tokens."""
        return [int(s.source == MODEL) for s in self.segments for _ in s.ids]

    def response_logprobs(self) -> list[float]:
        """Return the sampled log-prob of each model token after the prompt, 0 for context."""
        return [lp for s in self.segments for lp in (s.logprobs if s.source == MODEL else [0.0] * len(s.ids))]

    def response_versions(self) -> list[int]:
        """Return the weight version of each model token after the prompt, -1 for context."""
        return [v for s in self.segments for v in (s.versions if s.source == MODEL else [-1] * len(s.ids))]

    def tokens_by_source(self) -> dict[str, int]:
        """Return how many tokens after the prompt each source wrote."""
        out: dict[str, int] = {}
        for s in self.segments:
            out[s.source] = out.get(s.source, 0) + len(s.ids)
        return out

    def truncate(self, budget: int) -> None:
        """Cut the tokens after the prompt to at most ``budget`` (the trajectory's token budget)."""
        kept, room = [], budget
        for s in self.segments:
            if room <= 0:
                break
            if len(s.ids) > room:
                s = Segment(s.ids[:room], s.source, s.logprobs[:room] if s.logprobs else None,
                            s.versions[:room] if s.versions else None)
            kept.append(s)
            room -= len(s.ids)
        self.segments = kept


def trajectories_batch(trajectories: Sequence[Trajectory], pad_id: int, response_len: int,
                       prompt_len: int | None = None) -> Batch:
    """Return the trajectories in verl's layout (``hybridlab.batching``): ``prompts``,
    ``responses``, ``input_ids``, ``attention_mask`` (every real token), ``position_ids``,
    ``response_mask`` (the model's tokens), ``rollout_log_probs``, ``rollout_versions`` and
    ``token_sources`` (each response token's source, coded by ``SOURCES``)."""
    responses = [t.response_ids() for t in trajectories]
    out = sequences_batch([t.prompt_ids for t in trajectories], responses, pad_id, response_len=response_len,
                          prompt_len=prompt_len)
    shape = out["responses"].shape
    mask, logprobs = torch.zeros(shape, dtype=torch.long), torch.zeros(shape, dtype=torch.float32)
    versions = torch.full(shape, -1, dtype=torch.long)
    sources = torch.zeros(shape, dtype=torch.int8)
    for i, t in enumerate(trajectories):
        n = len(responses[i])
        mask[i, :n] = torch.tensor(t.response_mask(), dtype=torch.long)
        logprobs[i, :n] = torch.tensor(t.response_logprobs(), dtype=torch.float32)
        versions[i, :n] = torch.tensor(t.response_versions(), dtype=torch.long)
        sources[i, :n] = torch.tensor([SOURCES.index(s.source) for s in t.segments for _ in s.ids], dtype=torch.int8)
    out.tensors.update(response_mask=mask, rollout_log_probs=logprobs, rollout_versions=versions,
                       token_sources=sources)
    return out
