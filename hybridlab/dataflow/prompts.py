"""PromptSource: batches of prompts for RL steps, from a task generator or verl-format files."""
from __future__ import annotations

import random

from hybridlab.protocol import Batch
from hybridlab.tasks import Sample

PROMPT_FIELDS = ("prompt", "prompt_ids", "uid", "ground_truth", "data_source")  # what prompt_batch makes


def load_samples(cfg, split: str) -> list:
    """Return the config's ``split`` samples ("train" or "test") from its files or its task."""
    files = cfg.data.train_files if split == "train" else cfg.data.test_files
    n = cfg.data.train_samples if split == "train" else cfg.data.test_samples
    if files:
        from hybridlab.tasks.dataset import load_dataset

        return load_dataset(files, limit=n)
    if cfg.data.train_files and split == "test":
        return []
    from hybridlab.tasks import get_task

    return get_task(cfg.data.task, **cfg.data.task_options).split(split, n, seed=cfg.data.seed)


def prompt_batch(samples: list[Sample], tokenizer, uids: list) -> Batch:
    """Return a Batch of prompts: object fields prompt, prompt_ids, uid, ground_truth, data_source."""
    return Batch(objects={
        "prompt": [s.prompt for s in samples],
        "prompt_ids": [tokenizer(s.prompt, add_special_tokens=False).input_ids for s in samples],
        "uid": list(uids), "ground_truth": [s.ground_truth for s in samples],
        "data_source": [s.data_source for s in samples]})


class PromptSource:
    """Shuffled epochs over the training samples, ``per_step`` prompts at a time."""

    def __init__(self, samples: list[Sample], tokenizer, per_step: int, seed: int = 0):
        if not samples:
            raise ValueError("no training prompts")
        self.samples, self.tokenizer, self.per_step = samples, tokenizer, per_step
        self.rng = random.Random(seed)
        self.order: list[int] = []
        self.drawn = 0

    def next(self) -> Batch:
        """Return the next ``per_step`` prompts, each with a fresh uid (its group id)."""
        picked = []
        while len(picked) < self.per_step:
            if not self.order:
                self.order = list(range(len(self.samples)))
                self.rng.shuffle(self.order)
            picked.append(self.samples[self.order.pop()])
        uids = list(range(self.drawn, self.drawn + len(picked)))
        self.drawn += len(picked)
        return prompt_batch(picked, self.tokenizer, uids)

    def state(self) -> dict:
        """Return the stream's position as plain data (for checkpoints)."""
        version, internal, gauss = self.rng.getstate()
        return {"rng": [version, list(internal), gauss], "order": list(self.order), "drawn": self.drawn}

    def set_state(self, state: dict) -> None:
        """Go back to a position ``state()`` returned."""
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self.order, self.drawn = list(state["order"]), state["drawn"]
