"""reasoning-gym's procedurally generated tasks (the ``reasoning-gym`` package) as a hybridlab task:
``data.task=reasoning_gym`` with ``data.task_options={name: chain_sum, min_terms: 2, ...}``, the
dataset's name and its config as ``reasoning_gym.create_dataset(name, **config)`` takes them.

- **Prompts**: reasoning-gym's system prompt ``system_prompt`` (a key of its ``SYSTEM_PROMPTS``;
  ``direct`` by default, its shortest: answer between ``<answer>`` tags, no reasoning), then the
  question; ``none``: the question alone, for a model whose warm start teaches it the tags (its
  ~40 tokens of instructions are most of a zoo model's prompt). With ``data.chat=true`` they are
  a system and a user message, rendered with the model's chat template; otherwise one text.
- **Scores**: reasoning-gym's own ``score_answer`` on the last ``<answer>`` tag's content (its
  ``extract_answer``) and the whole entry, metadata included: partial credit counts (an answer
  that contains the oracle gets ``len(oracle) / len(answer)``). The entry travels as the
  ground truth (JSON text), so a verl parquet written by ``hybridlab data`` scores the same.
- **Splits**: entries come from ``Random(seed + index)`` for the indices of a pool of ``pool``
  (20,000); each split draws its indices from its own stream, and train and test are disjoint by
  question text (``Task.split``).
- Datasets without an oracle answer are refused by name.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import random
from typing import Any

from hybridlab.errors import UserError
from hybridlab.tasks.base import Sample, Task, register_task

SOURCE = "reasoning_gym"


def _gym():
    try:
        import reasoning_gym  # a heavy import (about a hundred generators): only when the task is used
    except ImportError:
        raise UserError("data.task=reasoning_gym needs the reasoning-gym package (pip install reasoning-gym;"
                        " make install installs it)") from None
    return reasoning_gym


@functools.lru_cache(maxsize=None)
def _score_fn(name: str):
    return _gym().get_score_answer_fn(name)


@register_task
class ReasoningGym(Task):
    """One reasoning-gym dataset; ``config`` is its config's fields (``min_terms``, ...)."""

    name = SOURCE
    own_tokenizer = True  # its fixed prompt text costs ~100 zoo tokens, ~40 with its own

    def __init__(self, name: str | None = None, system_prompt: str = "direct", pool: int = 20_000,
                 format_score: float = 0.0, **config: Any):
        super().__init__(format_score)
        self.dataset_name, self.config = name, config
        self.dataset = None
        self.system = ""
        if name is None:  # scoring rows needs no dataset: each entry names its own
            return
        gym = _gym()
        datasets = gym.factory.DATASETS
        if name not in datasets:
            raise UserError(f"reasoning-gym has no dataset {name!r}; it has: {', '.join(sorted(datasets))}")
        fields = [f.name for f in dataclasses.fields(datasets[name][1]) if f.name not in ("seed", "size")]
        unknown = sorted(set(config) - set(fields))
        if unknown:
            raise UserError(f"reasoning-gym's {name} has no option {unknown[0]!r}; its options are: {', '.join(fields)}")
        prompts = gym.utils.SYSTEM_PROMPTS
        if system_prompt != "none" and system_prompt not in prompts:
            raise UserError(f"system_prompt {system_prompt!r} is none of reasoning-gym's ({', '.join(prompts)}) or"
                            " 'none' (the question alone)")
        self.system = "" if system_prompt == "none" else prompts[system_prompt].strip()
        try:
            # a bounded pool: some generators build all their entries up front (gsm_symbolic, acre)
            self.dataset = gym.create_dataset(name, seed=0, size=pool, **config)
        except (AssertionError, ValueError, TypeError) as exc:
            raise UserError(f"reasoning-gym's {name} refuses its options {config}: {exc}") from None
        if self.dataset[0].get("answer") is None:
            raise UserError(f"reasoning-gym's {name} has no oracle answer for its entries (it scores answers by"
                            " its own rules only): hybridlab needs one for the warm start and the checks; choose"
                            " another dataset")

    def split(self, split: str, n: int, seed: int = 0) -> list[Sample]:
        """Return ``n`` samples of ``split`` (see ``Task.split``); a pool too small for them is named."""
        try:
            return super().split(split, n, seed)
        except UserError as exc:
            if "cannot produce" not in str(exc) or self.dataset is None:
                raise
            raise UserError(f"{exc}; or draw from a larger pool of entries (task option pool, now"
                            f" {self.dataset.size})") from None

    def make_sample(self, rng: random.Random) -> Sample:
        if self.dataset is None:
            raise UserError("data.task_options: reasoning_gym needs the dataset's name, e.g. {name: chain_sum}")
        entry = json.loads(json.dumps(self.dataset[rng.randrange(self.dataset.size)], default=list))
        question = entry["question"]
        prompt = f"{self.system}\n\n{question}\n" if self.system else f"{question}\n"
        return Sample(prompt=prompt, ground_truth=json.dumps(entry), data_source=SOURCE,
                      answer=f"<answer>{entry['answer']}</answer>",
                      extra_info={"system": self.system, "question": question})

    def check(self, response: str, ground_truth: Any) -> tuple[bool, bool]:
        score, found = self._graded(response, ground_truth)
        return score == 1.0, found

    def grade(self, response: str, ground_truth: Any) -> tuple[float, bool]:
        """Return (reasoning-gym's score of the last ``<answer>`` in ``response`` for the entry,
        whether it is 1)."""
        score = self._graded(response, ground_truth)[0]
        return score, score == 1.0

    def _graded(self, response: str, ground_truth: Any) -> tuple[float, bool]:
        """(the score, ``format_score`` for a tagged answer scoring 0; whether an answer tag was found)."""
        entry = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
        found = _gym().utils.extract_answer(response)
        score = float(_score_fn(entry["metadata"]["source_dataset"])(found, entry))
        return (score if score > 0 or found is None else max(score, self.format_score)), found is not None
