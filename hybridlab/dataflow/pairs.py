"""PairSource: batches of preference pairs for offline DPO steps (``data.preferences``).

Pairs are tokenized as TRL's DPOTrainer does: a text pair's chosen and rejected responses end with
the end-of-sequence token (added when missing); a conversational pair is rendered with the chat
template (the prompt with the generation prompt, then prompt + response whole), and the response
starts where the tokenized prompt and prompt + response first differ. One difference: text is
tokenized without the tokenizer's extra special tokens (a BOS token on Llama tokenizers), as the
rollout sees prompts, so DPO trains on the context the model generates from.
"""
from __future__ import annotations

from hybridlab.algos.preference import CHOSEN_TOKENS
from hybridlab.batching import preference_batch
from hybridlab.dataflow.fields import SEQUENCE_FIELDS
from hybridlab.dataflow.prompts import PROMPT_FIELDS, ShuffledEpochs, data_files
from hybridlab.errors import UserError
from hybridlab.protocol import Batch
from hybridlab.tasks import get_task
from hybridlab.tasks.preferences import PreferencePair, load_preferences, shared_start, task_pairs

# What a PairSource batch holds: each pair's chosen row then its rejected row, one uid per pair.
PAIR_INPUTS = (*SEQUENCE_FIELDS, "prompts", "responses", CHOSEN_TOKENS, "uid", "@pairs")


def step_inputs(cfg) -> tuple[str, ...]:
    """Return the fields a step's batch starts with: preference pairs with ``data.preferences``,
    else prompts."""
    return PAIR_INPUTS if cfg.data.preferences else PROMPT_FIELDS


def load_pairs(cfg) -> list[PreferencePair]:
    """Return the run's training pairs: ``data.train_files`` in TRL's columns, else pairs made from
    ``data.task`` (its worked answers against plausible wrong ones), ``data.train_samples`` at most."""
    d = cfg.data
    if d.train_files:
        return load_preferences(data_files(d.train_files, "data.train_files")[0], limit=d.train_samples or None)
    return task_pairs(get_task(d.task, **d.task_options), "train", d.train_samples, seed=d.seed, chat=d.chat)


def pair_ids(tokenizer, pair: PreferencePair) -> tuple[list[int], list[int], list[int]]:
    """Return (prompt, chosen, rejected) token ids of one pair (the module's docstring says how)."""
    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False).input_ids

    if pair.conversational:
        def render(messages: list, generation: bool = False) -> list[int]:
            return ids(tokenizer.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False))
        prompt = render(pair.prompt, generation=True)
        chosen, rejected = render(pair.prompt + pair.chosen), render(pair.prompt + pair.rejected)
    else:
        eos = tokenizer.eos_token
        prompt = ids(pair.prompt)
        chosen = ids(pair.prompt + pair.chosen + ("" if pair.chosen.endswith(eos) else eos))
        rejected = ids(pair.prompt + pair.rejected + ("" if pair.rejected.endswith(eos) else eos))
    start = min(shared_start(prompt, chosen), shared_start(prompt, rejected))
    return prompt[:start], chosen[start:], rejected[start:]


class PairSource(ShuffledEpochs):
    """Shuffled epochs over preference pairs, ``per_step`` pairs at a time. Every pair is tokenized
    and checked against the model's ``context`` once, when the source is made (chat pairs need a
    chat template: ``models.chat.check_chat`` first)."""

    def __init__(self, pairs: list[PreferencePair], tokenizer, per_step: int, seed: int = 0,
                 context: int | None = None):
        if not pairs:
            raise ValueError("no training pairs")
        super().__init__(len(pairs), seed)
        self.per_step, self.pad_id = per_step, tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = tokenizer.eos_token_id
        text = next((p for p in pairs if not p.conversational), None)
        if text is not None and tokenizer.eos_token is None:
            raise UserError(f"{text.origin or 'the task pairs'}: a text pair's responses end with the end-of-sequence"
                            " token (as TRL's), but the tokenizer has no eos_token")
        self.ids = []
        for i, pair in enumerate(pairs):
            where = pair.origin or f"pair {i}"
            try:
                prompt, chosen, rejected = pair_ids(tokenizer, pair)
            except Exception as exc:  # a template error, invalid Unicode...
                raise UserError(f"{where}: the pair cannot be tokenized ({type(exc).__name__}: {exc})") from None
            for field, response in (("chosen", chosen), ("rejected", rejected)):
                if not response:
                    raise UserError(f"{where}: field {field!r} tokenizes to nothing after the prompt")
                if context is not None and len(prompt) + len(response) > context:
                    raise UserError(f"{where}: the prompt and {field!r} response have {len(prompt) + len(response)}"
                                    f" tokens, more than the model's context of {context}")
            self.ids.append((prompt, chosen, rejected))

    def next(self) -> Batch:
        """Return the next ``per_step`` pairs as a preference batch (rows chosen, rejected, ...),
        each pair's two rows under one fresh uid."""
        first = self.drawn
        picked = [self.ids[i] for i in self.take(self.per_step)]
        batch = preference_batch(*zip(*picked), pad_id=self.pad_id)
        batch.objects["uid"] = [u for u in range(first, self.drawn) for _ in range(2)]
        return batch
