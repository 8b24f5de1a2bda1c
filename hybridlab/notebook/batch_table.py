"""BatchTable: a step's Batch as a table a student can read and sort (rows from
``hybridlab.dataflow.rows``), limited to what existed after a chosen stage."""
from __future__ import annotations

import html
from typing import TYPE_CHECKING

import ipywidgets as widgets

from hybridlab.dataflow.graph import StepResult
from hybridlab.dataflow.rows import batch_rows, fields_after
from hybridlab.notebook.trajectories import TrajectoryView
from hybridlab.protocol import Batch

if TYPE_CHECKING:
    from hybridlab.dataflow.session_verbs import SessionVerbs


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


def inspect(rl: "SessionVerbs", result: "StepResult | Batch", stage: str | None = None,
            limit: int = 64) -> "BatchTable | AgentInspector":
    """Return a BatchTable of the first ``limit`` samples (the title says how many of how many)
    of a step's batch as it was after ``stage`` (default: after the whole step), or of a Batch;
    for agent trajectories, with a TrajectoryView of them below it (``AgentInspector``)."""
    if isinstance(result, StepResult):
        batch, fields = result.batch, fields_after(result, stage)
        title = f"step {result.step}" + (f", after stage {stage!r}" if stage else "")
    else:
        if stage is not None:
            raise ValueError("stage= needs a StepResult (a Batch does not record which stage added what)")
        batch, fields, title = result, None, "batch"
    if len(batch) > limit:
        title += f" (first {limit} of {len(batch)} samples)"
    table = BatchTable(batch_rows(batch[:limit], rl.tokenizer, fields), title)
    if "token_sources" not in batch or (fields is not None and "token_sources" not in fields):
        return table

    return AgentInspector(table, TrajectoryView(batch[:limit], rl.tokenizer))


class AgentInspector(widgets.VBox):
    """An agent step's batch: the table of rows, then the trajectory chosen, token by token."""

    def __init__(self, table: BatchTable, trajectories):
        self.table, self.trajectories = table, trajectories
        super().__init__([table, trajectories])

    @property
    def rows(self) -> list[dict]:
        """The table's rows (as ``BatchTable.rows``)."""
        return self.table.rows

