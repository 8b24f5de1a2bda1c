"""PromptSource: batches of prompts for RL steps, from a task generator or verl-format files."""
from __future__ import annotations

import random
from pathlib import Path

from hybridlab.batching import PROMPT_WIDTH
from hybridlab.errors import UserError
from hybridlab.models.chat import as_chat, prompt_ids, template_file
from hybridlab.models.spec import ModelSpec
from hybridlab.protocol import Batch
from hybridlab.tasks import Sample, Task, get_task
from hybridlab.tasks.dataset import load_dataset

# what prompt_batch makes (extra_info: the row's extra_info, its chat messages included, as verl's reward functions get it)
PROMPT_FIELDS = ("prompt", "prompt_ids", "uid", "ground_truth", "data_source", "extra_info")


def data_files(value, key: str) -> list[str]:
    """Return the files of ``data.train_files`` or ``data.test_files`` (one path or a list of
    them) as a list; raises UserError naming ``key`` for a value of another type."""
    if not value:
        return []
    if isinstance(value, (str, Path)):
        return [str(value)]
    if isinstance(value, list) and all(isinstance(v, (str, Path)) for v in value):
        return [str(v) for v in value]
    raise UserError(f"{key}: expected a file path or a list of them, got {value!r}")


def data_problems(cfg) -> list[str]:
    """Return the problems of ``data.*`` (its files, its task, the chat template, and the warm
    start they allow), each naming its key."""
    data, p = cfg.data, []
    for split in ("train", "test"):  # 0 means every row of the files; a task's generator needs a count
        if not getattr(data, f"{split}_samples") and not data.train_files:
            p.append(f"data.{split}_samples: 0 (every row) needs data.train_files; a task makes as many as asked")
    if data.chat_template:
        try:
            template_file(data.chat_template)
        except UserError as exc:
            p.append(str(exc))
    for key in ("train_files", "test_files"):
        try:
            files = data_files(getattr(data, key), f"data.{key}")
        except UserError as exc:
            p.append(str(exc))
            continue
        p.extend(f"data.{key}: no file {path!r}" for path in files if not Path(path).is_file())
        if key == "train_files" and data.preferences and len(files) > 1:
            p.append("data.train_files: preference pairs are read from one file")
    if not data.train_files:
        try:
            task = get_task(data.task, **data.task_options)
            if data.preferences and type(task).wrong_answer is Task.wrong_answer:
                p.append(f"data.task: task {data.task!r} has no wrong_answer, so it cannot make preference pairs;"
                         " give them in data.train_files (TRL's columns)")
        except UserError as exc:
            p.append(f"data.task: {exc}")
    if cfg.warm_start.max_steps and data.train_files:
        p.append("warm_start.max_steps: the supervised warm start needs a task's worked answers; set it to 0 with"
                 " data.train_files")
    return p


def load_samples(cfg, split: str) -> list:
    """Return the config's ``split`` samples ("train" or "test") from its files (read in order,
    at most ``data.*_samples`` of them; 0: all) or its task."""
    files = data_files(cfg.data.train_files if split == "train" else cfg.data.test_files, f"data.{split}_files")
    n = cfg.data.train_samples if split == "train" else cfg.data.test_samples
    if files:
        samples = [s for path in files for s in load_dataset(path, limit=n or None)]
        return samples[:n] if n else samples
    if split == "test" and not has_test_prompts(cfg):
        return []

    samples = get_task(cfg.data.task, **cfg.data.task_options).split(split, n, seed=cfg.data.seed)
    return as_chat(samples) if cfg.data.chat else samples


def has_test_prompts(cfg) -> bool:
    """True unless the run reads its training data from files and names no test files (then the
    greedy evaluation has nothing to score)."""
    return bool(cfg.data.test_files or not cfg.data.train_files)


class PromptFit:
    """How long a prompt may be: the model's context minus the tokens generated after it."""

    def __init__(self, context: int, max_new_tokens: int, truncate: bool = False, windowed: bool = False):
        self.context, self.max_new_tokens, self.truncate = context, max_new_tokens, truncate
        self.room = context - max_new_tokens
        self.what = "sliding window" if windowed else "context"

    @classmethod
    def of(cls, cfg, model: "str | Path | PromptFit") -> "PromptFit":
        """Return the limits of a run: its model's context (a sliding window when shorter: the
        training attention is exact within it; ``model`` a checkpoint directory or an earlier
        fit of it), rollout.max_new_tokens, data.truncate_prompts."""
        if not isinstance(model, PromptFit):
            spec = ModelSpec.read(model)
            model = cls(spec.context, 0, windowed=spec.context < spec.max_positions)
        return cls(model.context, cfg.rollout.max_new_tokens, cfg.data.truncate_prompts,
                   windowed=model.what == "sliding window")


def tokenize_prompts(samples: list[Sample], tokenizer, fit: PromptFit | None = None) -> list[list[int]]:
    """Return each sample's prompt token ids, the longer ones left-truncated when ``fit.truncate``;
    raises UserError naming the first sample (file and row for a dataset) whose prompt is empty,
    cannot be tokenized, or does not fit the context."""
    out = []
    for i, sample in enumerate(samples):
        where = sample.origin or f"sample {i}"
        if not isinstance(sample.prompt, str) or not sample.prompt:
            raise UserError(f"{where}: the prompt is empty; every row needs a prompt to generate from")
        try:
            ids = prompt_ids(tokenizer, sample)
        except Exception as exc:  # e.g. a lone surrogate (invalid Unicode) in the text
            raise UserError(f"{where}: the prompt cannot be tokenized ({type(exc).__name__}: {exc})") from None
        if not ids:
            raise UserError(f"{where}: the prompt tokenizes to nothing")
        if fit is not None and len(ids) > fit.room:
            if not fit.truncate:
                raise UserError(
                    f"{where}: the prompt has {len(ids)} tokens, more than the {fit.room} that fit (the model's"
                    f" {fit.what} of {fit.context} minus rollout.max_new_tokens={fit.max_new_tokens}); shorten it, or"
                    f" set data.truncate_prompts=true to keep its last {fit.room} tokens")
            ids = ids[-fit.room:]
        out.append(ids)
    return out


def prompt_batch(samples: list[Sample], tokenizer, uids: list, fit: PromptFit | None = None,
                 ids: list[list[int]] | None = None) -> Batch:
    """Return a Batch of prompts: object fields prompt, prompt_ids (``ids`` if given, else
    tokenized and checked against ``fit``), uid, ground_truth, data_source, extra_info; ``meta`` holds the
    longest prompt's length, the width every rollout rank pads its part to."""
    ids = ids if ids is not None else tokenize_prompts(samples, tokenizer, fit)
    return Batch(objects={"prompt": [s.prompt for s in samples], "prompt_ids": ids, "uid": list(uids),
                          "ground_truth": [s.ground_truth for s in samples],
                          "data_source": [s.data_source for s in samples],
                          "extra_info": [dict(s.extra_info) for s in samples]},
                 meta={PROMPT_WIDTH: max((len(p) for p in ids), default=0)})


class ShuffledEpochs:
    """Indices into ``size`` items, drawn in shuffled epochs from a seed; its position saves and
    restores as plain data (for checkpoints), and it can go back to before any of its last
    ``MARKS`` draws (``state_before``: rollouts generated ahead and then thrown away are drawn
    again). The position after ``p`` items depends on ``p`` alone, however they were grouped."""

    MARKS = 16  # at least trainer.max_staleness + 2 (RolloutAhead raises it for a deeper queue)

    def __init__(self, size: int, seed: int = 0):
        self.size, self.rng = size, random.Random(seed)
        self.order: list[int] = []
        self.drawn = 0
        self.marks: dict[int, dict] = {}  # items drawn -> the position then, for the newest MARKS draws
        self.pin: int | None = None       # a uid whose draw's mark is kept however old (a prompt still in flight)
        self.skip: set[int] = set()       # uids to pass over when drawn again: trained before a rewind

    def take(self, n: int) -> list[int]:
        """Return the next ``n`` indices (a new shuffled epoch starts when one runs out)."""
        self.marks[self.drawn] = self.state()
        pinned = max((d for d in self.marks if d <= self.pin), default=None) if self.pin is not None else None
        for old in sorted(self.marks)[:-self.MARKS]:
            if pinned is None or old < pinned:
                del self.marks[old]
        picked = []
        while len(picked) < n:
            if not self.order:
                self.order = list(range(self.size))
                self.rng.shuffle(self.order)
            picked.append(self.order.pop())
        self.drawn += n
        return picked

    def state(self) -> dict:
        """Return the stream's position as plain data (for checkpoints)."""
        version, internal, gauss = self.rng.getstate()
        return {"rng": [version, list(internal), gauss], "order": list(self.order), "drawn": self.drawn,
                "size": self.size}

    def draw_start(self, uid: int) -> int:
        """Return the first position of the draw (among the kept marks) that holds ``uid``;
        raises ValueError when that draw's mark is no longer kept."""
        starts = [d for d in self.marks if d <= uid < self.drawn]
        if not starts:
            raise ValueError(f"the prompt stream keeps its position before its last {self.MARKS} draws only (and"
                             f" before a prompt still in flight); item {uid} is not in them")
        return max(starts)

    def state_before(self, uid: int) -> dict:
        """Return the position before the draw that holds ``uid`` (a batch's first uid, or any of
        its uids: a draw may pass over uids in ``skip``)."""
        return self.marks[self.draw_start(uid)]

    def set_state(self, state: dict) -> None:
        """Go back to a position ``state()`` returned; raises UserError when the stream it came from
        had another number of items (the training data changed since the checkpoint)."""
        if state.get("size", self.size) != self.size:  # checkpoints before the size was kept: not checked
            raise UserError(f"the checkpoint's training stream drew from {state['size']} items, but this run's data"
                            f" has {self.size}: the training data (data.train_files, data.train_samples, the task)"
                            " changed since the checkpoint, so the run cannot continue where it stopped")
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self.order, self.drawn = list(state["order"]), state["drawn"]

    def restart(self, state: dict) -> None:
        """Go back to ``state`` (a ``state()`` of this stream) and forget every draw after it: no
        uid to pass over, no older draw to go back before; returns nothing. Only with no prompt
        pending (no stream rows, no batch ahead: their uids would be drawn again): ``bench async``
        starts each mode of one session on the same prompts."""
        self.set_state(state)
        self.marks, self.pin, self.skip = {}, None, set()


class PromptSource(ShuffledEpochs):
    """Shuffled epochs over the training samples, ``per_step`` prompts at a time. Every prompt is
    tokenized and checked against ``fit`` once, when the source is made."""

    def __init__(self, samples: list[Sample], tokenizer, per_step: int, seed: int = 0, fit: PromptFit | None = None):
        if not samples:
            raise ValueError("no training prompts")
        super().__init__(len(samples), seed)
        self.samples, self.tokenizer, self.per_step = samples, tokenizer, per_step
        self.ids = tokenize_prompts(samples, tokenizer, fit)

    def next(self) -> Batch:
        """Return the next ``per_step`` prompts, each with a fresh uid (its group id: its position
        in the stream), passing over the uids in ``skip`` (trained before the stream went back)."""
        picked, uids = [], []
        while len(picked) < self.per_step:
            first = self.drawn
            for uid, index in enumerate(self.take(self.per_step - len(picked)), start=first):
                if uid in self.skip:
                    self.skip.discard(uid)
                else:
                    picked.append(index)
                    uids.append(uid)
        return prompt_batch([self.samples[i] for i in picked], self.tokenizer, uids, ids=[self.ids[i] for i in picked])
