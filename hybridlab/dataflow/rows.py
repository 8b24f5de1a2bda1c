"""A Batch as readable rows: decoded prompt and response, length, reward, log-prob means,
value and advantage (what ``RLSession.decoded`` returns and the notebook's BatchTable shows)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hybridlab.dataflow.pairs import PAIR_INPUTS
from hybridlab.dataflow.prompts import PROMPT_FIELDS
from hybridlab.protocol import Batch

if TYPE_CHECKING:
    from hybridlab.dataflow.graph import StepResult

# table column -> the Batch field it summarizes (reward: summed; the rest: mean over response tokens)
COLUMNS = {
    "reward": "token_level_scores",
    "rollout_logp": "rollout_log_probs",
    "old_logp": "old_log_probs",
    "ref_logp": "ref_log_prob",
    "value": "values",
    "advantage": "advantages",
}


def fields_after(result: "StepResult", stage: str | None) -> set[str] | None:
    """Return the fields the batch had once ``stage`` finished (None: every field); raises
    KeyError naming the stages of the step when ``stage`` is not one of them."""
    if stage is None:
        return None
    names = [name for name, _ in result.stages]
    if stage not in names:
        raise KeyError(f"stage {stage!r} did not run in step {result.step}; its stages: {', '.join(names)}")
    fields = {"prompt", "index", *PROMPT_FIELDS, *PAIR_INPUTS}  # what a step starts with: prompts or pairs
    for name, added in result.stages[:names.index(stage) + 1]:
        fields |= set(added)
    return fields


def batch_rows(batch: Batch, tokenizer: Any, fields: set[str] | None = None) -> list[dict]:
    """Return one dict per sample: prompt and response decoded, response length, reward, the
    mean log-probs and advantage over response tokens, each only if its field is in ``fields``."""
    have = lambda f: f in batch and (fields is None or f in fields)  # noqa: E731
    mask = batch["response_mask"].float() if have("response_mask") else None
    rows = []
    for i in range(len(batch)):
        row: dict[str, Any] = {"#": i}
        if "prompt" in batch:
            row["prompt"] = batch["prompt"][i]
        elif "prompt_ids" in batch:
            row["prompt"] = tokenizer.decode(batch["prompt_ids"][i], skip_special_tokens=True)
        elif "prompts" in batch:  # preference pairs: the left-padded prompt tokens only
            width = batch["prompts"].shape[1]
            real = batch["attention_mask"][i, :width].bool()
            row["prompt"] = tokenizer.decode(batch["prompts"][i][real].tolist(), skip_special_tokens=True)
        if have("responses") and mask is not None:
            n = int(mask[i].sum())
            row["response"] = tokenizer.decode(batch["responses"][i, :n].tolist(), skip_special_tokens=True)
            row["length"] = n
        for column, field in COLUMNS.items():
            if not have(field):
                continue
            values = batch[field][i].float()
            if field == "token_level_scores":
                row[column] = round(float(values.sum()), 4)
            elif mask is not None:
                row[column] = round(float((values * mask[i]).sum() / mask[i].sum().clamp(min=1)), 4)
        rows.append(row)
    return rows
