"""Chat prompts: a sample's messages rendered with the tokenizer's chat template, as verl does.

A prompt given as chat messages (a dataset's ``prompt`` column holding ``{"role", "content"}``
dicts, or a task's prompt with ``data.chat=true``) becomes the template's text with the
generation prompt, tokenized without extra special tokens; those ids are what the rollout and
the trainer see. A plain-text prompt is tokenized as it is.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from hybridlab.errors import UserError
from hybridlab.tasks import Sample


def as_chat(samples: list[Sample]) -> list[Sample]:
    """Return the samples with each prompt given as chat messages (a task's chat form): one user
    message, after a system message where the task gives one (``extra_info``'s ``system`` and
    ``question``: reasoning-gym's)."""
    def messages(s: Sample) -> list[dict]:
        system = [{"role": "system", "content": s.extra_info["system"]}] if s.extra_info.get("system") else []
        return system + [{"role": "user", "content": s.extra_info.get("question", s.prompt)}]

    return [Sample(s.prompt, s.ground_truth, s.data_source, s.answer, {**s.extra_info, "messages": messages(s)},
                   s.origin) for s in samples]


def prompt_ids(tokenizer: Any, sample: Sample) -> list[int]:
    """Return the token ids of a sample's prompt: its messages rendered with the chat template
    and the generation prompt, or its text."""
    messages = sample.extra_info.get("messages")
    if messages is None:
        return tokenizer(sample.prompt, add_special_tokens=False).input_ids
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


def end_of_turn(tokenizer: Any, stops: list[int]) -> int | None:
    """Return the id the chat template ends an assistant turn with (ChatML's ``<|im_end|>``)
    when the checkpoint stops there (``stops``), else None: a chat warm start ends its answers
    with it, so that a multi-turn conversation rendered later extends the sampled tokens."""
    if not tokenizer.chat_template:
        return None
    probe = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}]
    head = tokenizer(tokenizer.apply_chat_template(probe[:1], add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False).input_ids
    whole = tokenizer(tokenizer.apply_chat_template(probe, tokenize=False), add_special_tokens=False).input_ids
    body = tokenizer("2", add_special_tokens=False).input_ids
    end = len(head) + len(body)
    if whole[:len(head)] == head and whole[len(head):end] == body and len(whole) > end and whole[end] in stops:
        return whole[end]
    return None


def template_file(template: str) -> Path | None:
    """Return the file a ``data.chat_template`` value names, or None when it is the Jinja text
    itself; raises UserError when it is neither."""
    if "{" in template:
        return None
    path = Path(template).expanduser()
    if not path.is_file():
        raise UserError(f"data.chat_template: no file {template!r} (give a template file or the Jinja template itself)")
    return path


def use_template(tokenizer: Any, template: str | None) -> Any:
    """Give ``tokenizer`` the run's chat template (a file's path or the template itself; None
    keeps the model's own); returns the tokenizer."""
    if template:
        path = template_file(template)
        tokenizer.chat_template = path.read_text() if path else template
    return tokenizer


def check_chat(tokenizer: Any, items: Iterable, model_dir: str | Path) -> None:
    """Raise UserError naming the data (file and row) when chat prompts meet a tokenizer without
    a chat template; ``items`` are Samples or PreferencePairs (anything ``conversational``)."""
    if tokenizer.chat_template:
        return
    chat = next((s for s in items if s.conversational), None)
    if chat is not None:
        where = chat.origin or "the task's prompts (data.chat=true)"
        raise UserError(f"{where}: the prompt is a list of chat messages, but the tokenizer of {model_dir} has no"
                        " chat template (no chat_template in its tokenizer_config.json or chat_template.jinja);"
                        " set data.chat_template to a template file or a Jinja template string")
