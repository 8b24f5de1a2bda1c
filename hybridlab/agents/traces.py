"""Warm starts on tool-use conversations: a task's worked ``trace`` as the exact tokens and
loss mask an agent rollout produces, and the share of held-out traces a model reproduces.

A trace is tokenized through ``Conversation``, the same record the rollout keeps, so the
warm start trains on the layout RL samples from: the model's turns (each ending with the
template's end-of-turn) are trained, the prompt, tool answers and turn markers are context.
"""
from __future__ import annotations

from typing import Any, Sequence

from hybridlab.agents.conversation import Conversation
from hybridlab.evaluate import greedy_ids


def encode_trace(tokenizer: Any, messages: Sequence[dict], end: int,
                 tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
    """Return (token ids, loss mask) of a conversation: 1 on each assistant turn's tokens and
    its ``end`` id, 0 elsewhere."""
    conversation = Conversation(tokenizer, tools)
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            conversation.prompt(messages[:i])
            reply = tokenizer(message["content"], add_special_tokens=False).input_ids + [end]
            conversation.record_reply(reply, [0.0] * len(reply), version=0)
    trajectory = conversation.trajectory
    return trajectory.all_ids(), [0] * len(trajectory.prompt_ids) + trajectory.response_mask()


def model_turns(mask: Sequence[int]) -> list[tuple[int, int]]:
    """Return the (start, stop) spans where ``mask`` is 1."""
    spans, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def trace_accuracy(model: Any, tokenizer: Any, examples: Sequence[tuple[list[int], list[int]]]) -> float:
    """Return the share of encoded traces whose every model turn greedy decoding reproduces from
    the trace before it. With a deterministic tool this is the share the model answers right
    on its own: a right call gets the trace's tool answer, so the next turn sees the trace."""
    prompts, targets, owner = [], [], []
    for k, (ids, mask) in enumerate(examples):
        for start, stop in model_turns(mask):
            prompts.append(ids[:start])
            targets.append(ids[start:stop])
            owner.append(k)
    longest = max(len(t) for t in targets)
    right = [True] * len(examples)
    for k, target, got in zip(owner, targets, greedy_ids(model, tokenizer, prompts, longest)):
        right[k] = right[k] and got[:len(target)] == target
    return sum(right) / len(examples)
