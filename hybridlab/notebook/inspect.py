"""A step's Batch as a table a student can read and sort: decoded prompt and response, reward,
log-prob means, advantage and length, limited to what existed after a chosen stage."""
from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets

from hybridlab.protocol import Batch

if TYPE_CHECKING:
    from hybridlab.dataflow.session import RLSession, StepResult

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
    fields = {"prompt", "prompt_ids", "uid", "index", "ground_truth", "data_source"}
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


class BatchTable(widgets.VBox):
    """A sortable table of ``batch_rows``: pick the column to sort by and the direction."""

    def __init__(self, rows: list[dict], title: str = ""):
        self.rows = rows
        columns = list(dict.fromkeys(k for row in rows for k in row))
        self.sort_by = widgets.Dropdown(options=columns, value="#" if "#" in columns else None,
                                        description="sort by")
        self.descending = widgets.Checkbox(value=False, description="descending")
        self.table = widgets.HTML()
        self.sort_by.observe(lambda _: self.render(), "value")
        self.descending.observe(lambda _: self.render(), "value")
        self.render()
        super().__init__([widgets.HTML(f"<b>{html.escape(title)}</b>"),
                          widgets.HBox([self.sort_by, self.descending]), self.table])

    def sorted_rows(self) -> list[dict]:
        """Return the rows in the chosen order (rows lacking the column last)."""
        key = self.sort_by.value
        present = [r for r in self.rows if key in r]
        absent = [r for r in self.rows if key not in r]
        return sorted(present, key=lambda r: r[key], reverse=self.descending.value) + absent

    def render(self) -> None:
        """Redraw the HTML table."""
        columns = list(dict.fromkeys(k for row in self.rows for k in row))
        head = "".join(f"<th style='text-align:left;padding:2px 8px'>{html.escape(c)}</th>" for c in columns)
        body = "".join("<tr>" + "".join(f"<td style='padding:2px 8px'>{html.escape(str(r.get(c, '')))}</td>"
                                        for c in columns) + "</tr>" for r in self.sorted_rows())
        self.table.value = f"<table style='border-collapse:collapse'><tr>{head}</tr>{body}</table>"


def inspect(rl: "RLSession", result: "StepResult | Batch", stage: str | None = None, limit: int = 64) -> BatchTable:
    """Return a BatchTable of the first ``limit`` samples of a step's batch as it was after
    ``stage`` (default: after the whole step), or of a Batch."""
    from hybridlab.dataflow.session import StepResult

    if isinstance(result, StepResult):
        batch, fields = result.batch, fields_after(result, stage)
        title = f"step {result.step}" + (f", after stage {stage!r}" if stage else "")
    else:
        if stage is not None:
            raise ValueError("stage= needs a StepResult (a Batch does not record which stage added what)")
        batch, fields, title = result, None, "batch"
    return BatchTable(batch_rows(batch[:limit], rl.tokenizer, fields), title)

