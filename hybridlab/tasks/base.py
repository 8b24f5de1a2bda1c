"""Verifiable-reward tasks: the Sample type, the Task interface and the task registry."""
from __future__ import annotations

import dataclasses
import inspect
import random
from typing import Any, Callable

import yaml

from hybridlab.errors import UserError, unknown


@dataclasses.dataclass(frozen=True)
class Sample:
    """One prompt with its ground truth, in verl's column convention.

    ``answer`` is the worked target text a supervised warm start trains on (empty for
    datasets that only carry a ground truth).
    """

    prompt: str
    ground_truth: Any
    data_source: str
    answer: str = ""
    extra_info: dict = dataclasses.field(default_factory=dict)
    origin: str = dataclasses.field(default="", compare=False)  # "FILE: row N" for errors about it

    @property
    def conversational(self) -> bool:
        """True when the prompt is chat messages (rendered with the chat template)."""
        return self.extra_info.get("messages") is not None


class Task:
    """A family of prompts with a rule-based scorer, deterministic from a seed.

    Subclasses set ``name``, implement ``make_sample(rng)`` and ``check(response, ground_truth)``.
    """

    name: str = ""
    # True where the zoo's tokenizer (trained on arith, reverse and countdown) does not fit the
    # task's text: a zoo model for it gets a tokenizer trained on the task's own (models.zoo).
    own_tokenizer: bool = False
    # True where checking an answer runs it in the code sandbox: the reward worker then hands the
    # task the run's sandbox (``use_sandbox``) and scores its answers ``sandbox.parallel`` at once.
    needs_sandbox: bool = False
    # Reward for a response that is well formed but wrong (0 disables the format score).
    def __init__(self, format_score: float = 0.0):
        self.format_score = float(format_score)

    def make_sample(self, rng: random.Random) -> Sample:  # pragma: no cover - abstract
        """Return one random sample drawn with ``rng``."""
        raise NotImplementedError

    def check(self, response: str, ground_truth: Any) -> tuple[bool, bool]:  # pragma: no cover
        """Return (correct, well_formed) for a decoded response."""
        raise NotImplementedError

    def wrong_answer(self, sample: Sample, rng: random.Random) -> str:
        """Return a plausible wrong answer to ``sample``: well formed, close to the right one, and
        scored wrong by ``check`` (the rejected side of a preference pair)."""
        raise UserError(f"task {self.name!r} cannot write preference pairs: it has no wrong_answer")

    def split(self, split: str, n: int, seed: int = 0) -> list[Sample]:
        """Return ``n`` samples of ``split`` ("train" or "test"); test never overlaps train."""
        if split not in ("train", "test"):
            raise UserError(f"unknown split {split!r}; choose one of: test, train")
        if n < 1:
            raise UserError(f"number of samples must be at least 1, got {n}")
        # Disjoint streams: test prompts are drawn from their own seed and any prompt that the
        # train stream could also produce is kept out of train by the prompt hash parity.
        rng = random.Random(f"{self.name}:{split}:{seed}")
        want_parity = 0 if split == "train" else 1
        out: list[Sample] = []
        seen: set[str] = set()
        attempts = 0
        while len(out) < n:
            attempts += 1
            if attempts > 200 * n + 10_000:
                raise UserError(
                    f"task {self.name!r} cannot produce {n} distinct {split} prompts with these options;"
                    f" got {len(out)}: make the task larger (more digits, longer strings) or ask for fewer (e.g. --train-samples)")
            s = self.make_sample(rng)
            if s.prompt in seen or _parity(s.prompt) != want_parity:
                continue
            seen.add(s.prompt)
            out.append(s)
        return out

    def grade(self, response: str, ground_truth: Any) -> tuple[float, bool]:
        """Return (score, correct), checking the response once: the score is 1.0 for a correct
        response, ``format_score`` for a well-formed wrong one, else 0."""
        correct, well_formed = self.check(response, ground_truth)
        return (1.0 if correct else self.format_score if well_formed else 0.0), correct

    def score(self, response: str, ground_truth: Any) -> float:
        """Return the response's score (``grade``)."""
        return self.grade(response, ground_truth)[0]


def _parity(text: str) -> int:
    import zlib
    return zlib.crc32(text.encode()) & 1


# Filled as the package loads: importing any hybridlab.tasks module runs tasks/__init__.py first,
# which imports the built-in tasks, so no function here needs to import them.
TASKS: dict[str, Callable[..., Task]] = {}


def register_task(cls):
    """Class decorator: make a Task subclass available by its ``name``; returns the class."""
    TASKS[cls.name] = cls
    return cls


def get_task(task: str, /, **options) -> Task:
    """Return the task named ``task`` built with ``options`` (an option may be called ``name``);
    errors list the tasks and options allowed (a task taking ``**config`` checks its own)."""
    if task not in TASKS:
        raise unknown("task", task, TASKS)
    cls = TASKS[task]
    params = inspect.signature(cls.__init__).parameters
    allowed = [p for p, v in params.items() if p != "self" and v.kind != inspect.Parameter.VAR_KEYWORD]
    open_ended = any(v.kind == inspect.Parameter.VAR_KEYWORD for v in params.values())
    for key in options:
        if key not in allowed and not open_ended:
            raise UserError(f"task {task!r} has no option {key!r}; its options are: {', '.join(allowed)}")
    return cls(**options)


def parse_task_options(pairs: list[str]) -> dict[str, Any]:
    """Parse ``key=value`` strings into a dict, each value read as YAML as config overrides are
    (``3`` an int, ``true`` a bool, ``[1, 2]`` a list, ``abc`` a string); returns the dict."""
    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise UserError(f"task option {pair!r} must look like key=value")
        key, value = pair.split("=", 1)
        out[key.strip()] = _typed(value.strip())
    return out


def _typed(text: str) -> Any:
    try:
        value = yaml.safe_load(text) if text else ""
    except yaml.YAMLError:  # e.g. ops=* (YAML's alias mark)
        return text
    if isinstance(value, str):  # YAML 1.1 reads 1e-3 as text
        for kind in (int, float):
            try:
                return kind(value)
            except ValueError:
                pass
    return value


def task_for_source(data_source: str) -> Task:
    """Return the built-in task whose scorer serves ``data_source`` (``arith``, ``x/arith``...)."""
    name = data_source.rsplit("/", 1)[-1]
    if name not in TASKS:
        raise UserError(f"no built-in scorer for data_source {data_source!r}; built-in scorers are:"
                        f" {', '.join(sorted(TASKS))} (pass your own reward function for other data)")
    return TASKS[name]()
