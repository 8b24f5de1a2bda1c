"""Chat messages to the exact tokens of a trajectory.

An agent speaks in messages; the trainer needs tokens. Re-tokenizing a conversation's text
after the fact breaks training (the model's own sampled tokens come back different: TRL
#5144, slime #2263, verl's multi-turn docs), so a ``Conversation`` never re-tokenizes what
is recorded. Its record starts with the first prompt's ids; each model turn appends the ids the
engine sampled; each later call's messages add only the new text (tool answers, the template's
turn markers and generation prompt), tokenized on its own.

The new text is found by rendering the whole conversation with the chat template and cutting
off the recorded text, when the rendering starts with it (a prefix-stable template: ChatML,
Llama 3 and most others on plain turns). Where it does not (a template that rewrites earlier
turns, such as Qwen3's dropping of earlier reasoning, or an agent that edited its history),
the recorded tokens are kept, as verl's and SkyRL's token-in-token-out agent loops do, and
only the messages after the call's last assistant message are rendered, after a fixed
two-message base that is then cut off (or alone, where the template renders the base
differently when more follows); the call is counted in ``Trajectory.retokenized``
(``agent/retokenized_share``). We keep the tokens the model actually saw rather than the
re-rendered text because training on anything else is training on what the model did not
sample.
"""
from __future__ import annotations

from typing import Any, Sequence

from hybridlab.agents.trajectory import TEMPLATE, TOOL, USER, Trajectory

_BASE = [{"role": "user", "content": "base"}, {"role": "assistant", "content": "base"}]
_SOURCES = {"tool": TOOL, "user": USER}


class Conversation:
    """The token record of one trajectory, extended call by call from chat messages."""

    def __init__(self, tokenizer: Any, tools: Sequence[dict] | None = None):
        self.tokenizer, self.tools = tokenizer, list(tools or []) or None
        self.trajectory: Trajectory | None = None
        self.text = ""        # the recorded ids' text
        self.answered = 0     # messages the record covers, the model's last reply included

    def render(self, messages: Sequence[dict], generation_prompt: bool) -> str:
        """Return the chat template's text for ``messages`` (with the tools' schemas)."""
        return self.tokenizer.apply_chat_template(list(messages), tools=self.tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def prompt(self, messages: Sequence[dict], source: str | None = None) -> list[int]:
        """Return the ids a model call on ``messages`` continues: the record, extended by the
        messages after the model's last reply (tagged ``source``; by default after the last
        message's role: tool or user)."""
        text = self.render(messages, True)
        if self.trajectory is None:
            self.trajectory, self.text, self.answered = Trajectory(self._ids(text)), text, len(messages)
            return list(self.trajectory.prompt_ids)
        if text.startswith(self.text):
            new, delta = list(messages[self.answered:]), text[len(self.text):]
        else:
            self.trajectory.retokenized += 1
            new = _after_last_reply(messages)
            delta = self._render_alone(new)
        role = new[-1].get("role") if new else None
        self.trajectory.add_context(self._ids(delta), source or _SOURCES.get(role, TEMPLATE))
        self.text += delta
        self.answered = len(messages)
        return self.trajectory.all_ids()

    def _render_alone(self, new: list[dict]) -> str:
        """Return the text of ``new`` messages and the generation prompt, rendered after a fixed
        base conversation that is then cut off (a template that changes the base when more follows,
        such as Qwen3's reasoning on the last turn: the new messages rendered alone)."""
        whole, base = self.render([*_BASE, *new], True), self.render(_BASE, False)
        return whole[len(base):] if whole.startswith(base) else self.render(new, True)

    def record_reply(self, ids: Sequence[int], logprobs: Sequence[float], version: int | Sequence[int]) -> str:
        """Record a model turn's sampled ids; returns its text (special tokens dropped), the
        content of the assistant message that the next call's messages are expected to carry."""
        self.trajectory.add_model(ids, logprobs, version)
        self.text += self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        self.answered += 1
        return self.tokenizer.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)


def _after_last_reply(messages: Sequence[dict]) -> list[dict]:
    """Return the messages after the last assistant message (all of them when there is none)."""
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=-1)
    return list(messages[last + 1:])
