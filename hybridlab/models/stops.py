"""Where a response ends: at any end-of-sequence id the checkpoint lists.

Chat models list their end-of-turn tokens, often several, as ``eos_token_id`` in
``generation_config.json``; ``config.json`` and the tokenizer name one more. vLLM stops at all
of them, so every other path (the transformers backend, evaluation, the warm start's data)
uses the same list, and responses, rewards and response masks agree on where a response ends.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def stop_ids(*sources: Any) -> list[int]:
    """Return the distinct ids of ``sources`` in order (each an id, a list of ids, or None)."""
    out: list[int] = []
    for source in sources:
        for token in source if isinstance(source, (list, tuple)) else [source]:
            if token is not None and int(token) not in out:
                out.append(int(token))
    return out


def checkpoint_stop_ids(model_dir: str | Path, tokenizer: Any = None) -> list[int]:
    """Return every id that ends a response of the checkpoint in ``model_dir``:
    generation_config.json's ``eos_token_id``, then config.json's, then the tokenizer's."""
    def eos_of(name: str) -> Any:
        path = Path(model_dir) / name
        return json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None

    return stop_ids(eos_of("generation_config.json"), eos_of("config.json"),
                    getattr(tokenizer, "eos_token_id", None))


def model_stop_ids(model: Any, tokenizer: Any) -> list[int]:
    """Return the same list for a loaded transformers model (its generation and model configs)."""
    generation = getattr(model, "generation_config", None)
    return stop_ids(getattr(generation, "eos_token_id", None), model.config.eos_token_id, tokenizer.eos_token_id)


def end_of_response(tokenizer: Any, stops: list[int]) -> int:
    """Return the id a worked answer ends with: the tokenizer's end-of-sequence token when the
    checkpoint stops there (a chat model's tokenizer names its end-of-turn), else the first."""
    return tokenizer.eos_token_id if tokenizer.eos_token_id in stops else stops[0]
