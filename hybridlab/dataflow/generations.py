"""A step's trained samples written to disk (``trainer.rollout_data_dir``, verl's key of that
name): ``DIR/{step}.jsonl``, one JSON line per sample.

Each line has verl's fields (``input``: the prompt; ``output``: the response, for an agent the
whole trajectory after the prompt, tool replies included; ``gts``: the ground truth; ``score``:
the sequence's reward; ``step``) and hybridlab's: ``uid`` (the prompt's place in the prompt
stream; a group's n samples share it), ``data_source`` and, when the rollout recorded them,
``versions``: the oldest and newest policy version that sampled the response's tokens
(off-policy and streaming runs). A step run again after a resume or a roll-back writes its
file again, so the directory holds what each step finally trained. Files are written aside and
renamed: a reader sees the old file or the new one, never half of one.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hybridlab.atomic import write_text
from hybridlab.protocol import Batch


def generations_dir(setting: str, run_dir: str | os.PathLike) -> Path:
    """Return where ``trainer.rollout_data_dir`` puts the files: the path as given, or under
    the run directory when relative."""
    path = Path(setting).expanduser()
    return path if path.is_absolute() else Path(run_dir) / path


def generation_rows(batch: Batch, tokenizer: Any, step: int) -> list[dict]:
    """Return one dict per sample of a step's batch (the fields of the module docstring)."""
    mask = batch["response_mask"].bool()  # the sampled tokens (an agent's tool replies are 0)
    real = batch["attention_mask"][:, batch["prompts"].shape[1]:].bool()  # the whole response, tool replies too
    scores = batch["token_level_scores"].sum(-1).tolist() if "token_level_scores" in batch else [None] * len(batch)
    versions = batch["rollout_versions"] if "rollout_versions" in batch else None
    rows = []
    for i in range(len(batch)):
        ids = batch["responses"][i][real[i]].tolist()
        row = {"input": batch["prompt"][i], "output": tokenizer.decode(ids, skip_special_tokens=True),
               "gts": batch["ground_truth"][i], "score": scores[i], "step": step, "uid": int(batch["uid"][i]),
               "data_source": batch["data_source"][i]}
        if versions is not None and mask[i].any():
            sampled = versions[i][mask[i]]
            row["versions"] = [int(sampled.min()), int(sampled.max())]
        rows.append(row)
    return rows


def write_generations(directory: Path, step: int, rows: list[dict]) -> Path:
    """Write ``rows`` to ``directory/{step}.jsonl`` (aside, then renamed); returns the path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{step}.jsonl"
    write_text(path, "".join(json.dumps(row, ensure_ascii=False, default=str) + "\n" for row in rows))
    return path
