"""The dashboard's service panel: what a served API (``hybridlab serve tinker``) is doing.

It reads ``service`` records, one per finished call (``tinker/service.py`` sends them): the call's
kind, its seconds, the session it came from and, for training calls, the loss the user's loop
produced. It shows the sessions and clients, calls per second by kind over the last minute, the
seconds of each call by kind, and the losses; the devices' utilization is the System section's.
Totals are kept as the calls arrive, so a poll costs its new records only.
"""
from __future__ import annotations

import collections
import dataclasses

from hybridlab.telemetry.panels import COMMON

WAITING = "*no service calls yet: a `hybridlab serve tinker` run shows its calls here*"
WINDOW_S = 60.0  # calls per second are counted over the last minute of calls
KINDS = ("forward_backward", "forward", "optim_step", "sample", "save", "load", "create_model")
COLORS = dict(zip(KINDS, ("#4e79a7", "#76b7b2", "#e15759", "#f28e2b", "#59a14f", "#b07aa1", "#9c755f")))
REGISTRATIONS = {"create_session": "session", "create_sampler": "sampler"}  # counted, not timed


@dataclasses.dataclass
class ServiceTotals:
    """What the table shows, kept up to date call by call."""

    sessions: set = dataclasses.field(default_factory=set)
    models: set = dataclasses.field(default_factory=set)
    samplers: set = dataclasses.field(default_factory=set)
    calls: dict = dataclasses.field(default_factory=lambda: collections.defaultdict(lambda: [0, 0.0]))
    recent: collections.deque = dataclasses.field(default_factory=collections.deque)  # (time, kind), last minute

    def add(self, r: dict) -> None:
        """Count one ``service`` record."""
        if r["call"] in REGISTRATIONS:
            getattr(self, REGISTRATIONS[r["call"]] + "s").add(r[REGISTRATIONS[r["call"]]])
            return
        if r.get("model"):
            self.models.add(r["model"])
        count = self.calls[r["call"]]
        count[0], count[1] = count[0] + 1, count[1] + r["seconds"]
        self.recent.append((r["time"], r["call"]))
        while self.recent and self.recent[0][0] < r["time"] - WINDOW_S:
            self.recent.popleft()

    def table(self) -> str:
        """Return the Markdown table: sessions and clients, then per kind the calls, their mean
        seconds and the calls per second over the last ``WINDOW_S`` before the latest call."""
        lines = [f"**{len(self.sessions)}** sessions, **{len(self.models)}** training clients,"
                 f" **{len(self.samplers)}** sampling clients", "",
                 "| call | calls | mean s | calls/s (last minute) |", "|---|---|---|---|"]
        recent = collections.Counter(kind for _, kind in self.recent)
        for kind in sorted(self.calls, key=lambda k: (KINDS.index(k) if k in KINDS else len(KINDS), k)):
            count, seconds = self.calls[kind]
            lines.append(f"| {kind} | {count} | {seconds / count:.3f} | {recent[kind] / WINDOW_S:.2f} |")
        return "\n".join(lines)


class ServicePanel:
    """A table of sessions and calls, and two plots: seconds per call by kind, and the losses;
    built at the first call (most runs are training runs, with none)."""

    kinds = ("service",)  # the records it reads (the dashboard hands it only these)

    def __init__(self):
        import panel as pn

        self.totals = ServiceTotals()
        self.table = pn.pane.Markdown(WAITING, name="service calls")
        self.times: dict = {}
        self.losses = None
        row = dict(sizing_mode="stretch_width")
        self.figures = pn.Row(visible=False, **row)
        self.layout = pn.Column(pn.pane.Markdown("### Service"), self.table, self.figures, **row)

    def _build(self) -> None:
        from bokeh.models import ColumnDataSource
        from bokeh.plotting import figure

        self.times = {kind: ColumnDataSource({"time": [], "seconds": []}) for kind in KINDS}
        self.losses = ColumnDataSource({"call": [], "loss": []})
        time_fig = figure(title="seconds per call, by kind", x_axis_type="datetime", **COMMON)
        for kind, source in self.times.items():
            time_fig.scatter("time", "seconds", source=source, color=COLORS[kind], legend_label=kind, size=5)
        time_fig.legend.location = "top_left"
        loss_fig = figure(title="loss:sum of each forward_backward", x_axis_label="training call", **COMMON)
        loss_fig.line("call", "loss", source=self.losses, color="#4e79a7")
        self.figures[:] = [time_fig, loss_fig]
        self.figures.visible = True

    def feed(self, records: list[dict]) -> None:
        """Add new service calls to the table and the plots."""
        rows = [r for r in records if r.get("kind") == "service"]
        if not rows:
            return
        if self.losses is None:
            self._build()
        for r in rows:
            self.totals.add(r)
        self.table.object = self.totals.table()
        for kind, source in self.times.items():
            mine = [r for r in rows if r["call"] == kind]
            if mine:
                source.stream({"time": [1000 * r["time"] for r in mine], "seconds": [r["seconds"] for r in mine]})
        losses = [r["loss_sum"] for r in rows if r.get("loss_sum") is not None and r["call"] == "forward_backward"]
        if losses:
            start = len(self.losses.data["call"])
            self.losses.stream({"call": list(range(start, start + len(losses))), "loss": losses})
