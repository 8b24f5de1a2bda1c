"""Preference pairs in TRL's columns: read, write, and made from a task.

A row holds ``chosen`` and ``rejected`` and, usually, ``prompt``; each is text or a list of chat
messages (``{"role", "content"}``). Without ``prompt`` the two share it: the prompt is their
longest common start, in messages or in characters (TRL's implicit prompt, ``extract_prompt``).
Files are parquet or JSONL, as for prompt datasets (``tasks.dataset``); errors name the file, the
row (1-based; a JSONL file's line) and the field.
"""
from __future__ import annotations

import dataclasses
import os
import random
from pathlib import Path
from typing import Any, Iterable, Sequence

from hybridlab.errors import UserError
from hybridlab.models.chat import as_chat
from hybridlab.tasks.base import Task
from hybridlab.tasks.dataset import parse_rows, write_rows

PAIR_COLUMNS = ("prompt", "chosen", "rejected")


@dataclasses.dataclass(frozen=True)
class PreferencePair:
    """One preference: a prompt with a chosen and a rejected response, all text or all messages."""

    prompt: Any        # str, or a list of messages
    chosen: Any
    rejected: Any
    origin: str = dataclasses.field(default="", compare=False)  # "FILE: row N" for errors about it

    @property
    def conversational(self) -> bool:
        """True when the pair is made of chat messages (rendered with the chat template)."""
        return isinstance(self.chosen, list)


def _messages(value: Any, where: str, field: str) -> list[dict]:
    if not value:
        raise UserError(f"{where}: field {field!r} is an empty list of messages")
    for i, msg in enumerate(value):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) \
                or not isinstance(msg.get("content"), str):
            raise UserError(f"{where}: field {field!r}[{i}] must be a message with string 'role' and 'content'")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def shared_start(a: Sequence, b: Sequence) -> int:
    """Return how many leading items (characters, messages, token ids) ``a`` and ``b`` share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _implicit_prompt(chosen, rejected, where: str) -> tuple:
    """TRL's ``extract_prompt``: the prompt is what ``chosen`` and ``rejected`` share at the start
    (messages, or characters: a space before the first difference goes with the responses)."""
    shared = shared_start(chosen, rejected)
    if isinstance(chosen, str) and shared < min(len(chosen), len(rejected)) and shared and chosen[shared - 1] == " ":
        shared -= 1
    unit = "text" if isinstance(chosen, str) else "first message"
    if shared == 0:
        raise UserError(f"{where}: no field 'prompt', and 'chosen' and 'rejected' share no {unit} to take it from"
                        " (give a 'prompt' column, or start both with the prompt)")
    if shared == len(chosen) or shared == len(rejected):
        raise UserError(f"{where}: no field 'prompt', and one of 'chosen'/'rejected' has nothing after what they"
                        " share (nothing left to prefer)")
    return chosen[:shared], chosen[shared:], rejected[shared:]


def pair_from_row(row: dict, where: str) -> PreferencePair:
    """Return the PreferencePair of one TRL-column row; raises UserError naming ``where`` and the
    field that is missing or malformed."""
    for field in ("chosen", "rejected"):
        if row.get(field) is None:
            hint = (" (this row has verl's prompt columns: data.preferences=true reads preference pairs in TRL's"
                    " columns prompt, chosen, rejected)") if "reward_model" in row or "data_source" in row else ""
            raise UserError(f"{where}: missing field {field!r}{hint}")
    chosen, rejected, prompt = row["chosen"], row["rejected"], row.get("prompt")
    if isinstance(chosen, str) != isinstance(rejected, str):
        raise UserError(f"{where}: fields 'chosen' and 'rejected' must both be text or both chat messages")
    if isinstance(chosen, str):
        if prompt is None:
            prompt, chosen, rejected = _implicit_prompt(chosen, rejected, where)
        elif not isinstance(prompt, str):
            raise UserError(f"{where}: field 'prompt' is a {type(prompt).__name__}, not text; text pairs need a text"
                            " prompt")
        for field, value in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
            if not value:
                raise UserError(f"{where}: field {field!r} is empty")
        return PreferencePair(prompt, chosen, rejected, where)
    for field, value in (("chosen", chosen), ("rejected", rejected)):
        if not isinstance(value, (list, tuple)):
            raise UserError(f"{where}: field {field!r} must be text or a list of chat messages,"
                            f" got {type(value).__name__}")
    chosen, rejected = _messages(chosen, where, "chosen"), _messages(rejected, where, "rejected")
    if prompt is None:
        prompt, chosen, rejected = _implicit_prompt(chosen, rejected, where)
    elif isinstance(prompt, (list, tuple)):
        prompt = _messages(prompt, where, "prompt")
    else:
        raise UserError(f"{where}: field 'prompt' must be a list of chat messages like 'chosen',"
                        f" got {type(prompt).__name__}")
    return PreferencePair(prompt, chosen, rejected, where)


def load_preferences(path: str | os.PathLike, limit: int | None = None) -> list[PreferencePair]:
    """Return the preference pairs of a parquet or JSONL file in TRL's columns (at most ``limit``)."""
    return parse_rows(path, limit, pair_from_row)


def save_preferences(pairs: Iterable[PreferencePair], path: str | os.PathLike) -> Path:
    """Write pairs in TRL's columns as parquet or JSONL (atomically); returns the path."""
    return write_rows([{"prompt": p.prompt, "chosen": p.chosen, "rejected": p.rejected} for p in pairs], path)


def task_pairs(task: Task, split: str, n: int, seed: int = 0, chat: bool = False) -> list[PreferencePair]:
    """Return ``n`` pairs from a task's ``split``: each prompt's worked answer (chosen) against a
    plausible wrong one (rejected, ``task.wrong_answer``); with ``chat``, as one user message and
    one assistant message each."""
    rng = random.Random(f"{task.name}:pairs:{split}:{seed}")
    samples = task.split(split, n, seed=seed)
    if not chat:
        return [PreferencePair(s.prompt, s.answer, task.wrong_answer(s, rng)) for s in samples]
    said = (lambda text: [{"role": "assistant", "content": text}])  # noqa: E731
    return [PreferencePair(s.extra_info["messages"], said(s.answer), said(task.wrong_answer(s, rng)))
            for s in as_chat(samples)]
