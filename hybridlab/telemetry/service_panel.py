"""The dashboard's service panel: what a served API (``hybridlab serve tinker``) is doing.

It reads ``service`` records, one per finished call (``tinker/server.py`` sends them): the call's
kind, its seconds, the session it came from and, for training calls, the loss the user's loop
produced. It shows the sessions and clients, calls per second by kind over the last minute, the
seconds of each call by kind, and the losses; the devices' utilization is the System section's.
"""
from __future__ import annotations

import collections

from hybridlab.telemetry.panels import COMMON

WAITING = "*no service calls yet: a `hybridlab serve tinker` run shows its calls here*"
WINDOW_S = 60.0  # calls per second are counted over the last minute of calls
KINDS = ("forward_backward", "forward", "optim_step", "sample", "save", "load", "create_model")
COLORS = dict(zip(KINDS, ("#4e79a7", "#76b7b2", "#e15759", "#f28e2b", "#59a14f", "#b07aa1", "#9c755f")))


def summary(records: list[dict], now: float) -> str:
    """Return the panel's Markdown table of ``records`` (every service call so far): sessions,
    clients, and per kind the calls, their mean seconds and the calls per second over the last
    ``WINDOW_S`` before ``now``."""
    sessions = {r["session"] for r in records if r.get("session")}
    models = {r["model"] for r in records if r.get("model")}
    samplers = {r["sampler"] for r in records if r["call"] == "create_sampler"}
    by_kind: dict[str, list[dict]] = collections.defaultdict(list)
    for r in records:
        by_kind[r["call"]].append(r)
    lines = [f"**{len(sessions)}** sessions, **{len(models)}** training clients, **{len(samplers)}** sampling"
             " clients", "", "| call | calls | mean s | calls/s (last minute) |", "|---|---|---|---|"]
    for kind in sorted(by_kind, key=lambda k: (KINDS.index(k) if k in KINDS else len(KINDS), k)):
        if kind in ("create_session", "create_sampler"):  # counted above
            continue
        calls = by_kind[kind]
        recent = sum(1 for r in calls if r["time"] >= now - WINDOW_S)
        mean = sum(r["seconds"] for r in calls) / len(calls)
        lines.append(f"| {kind} | {len(calls)} | {mean:.3f} | {recent / WINDOW_S:.2f} |")
    return "\n".join(lines)


class ServicePanel:
    """A table of sessions and calls, and two plots: seconds per call by kind, and the losses."""

    kinds = ("service",)  # the records it reads (the dashboard hands it only these)

    def __init__(self):
        import panel as pn
        from bokeh.models import ColumnDataSource
        from bokeh.plotting import figure

        self.records: list[dict] = []
        self.table = pn.pane.Markdown(WAITING, name="service calls")
        self.times = {kind: ColumnDataSource({"time": [], "seconds": []}) for kind in KINDS}
        self.losses = ColumnDataSource({"call": [], "loss": []})
        self.time_fig = figure(title="seconds per call, by kind", x_axis_type="datetime", **COMMON)
        for kind, source in self.times.items():
            self.time_fig.scatter("time", "seconds", source=source, color=COLORS[kind], legend_label=kind, size=5)
        self.time_fig.legend.location = "top_left"
        self.loss_fig = figure(title="loss:sum of each forward_backward", x_axis_label="training call",
                               **COMMON)
        self.loss_fig.line("call", "loss", source=self.losses, color="#4e79a7")
        row = dict(sizing_mode="stretch_width")
        self.layout = pn.Column(pn.pane.Markdown("### Service"), self.table,
                                pn.Row(self.time_fig, self.loss_fig, **row), **row)

    def feed(self, records: list[dict]) -> None:
        """Add new service calls to the table and the plots."""
        rows = [r for r in records if r.get("kind") == "service"]
        if not rows:
            return
        self.records += rows
        self.table.object = summary(self.records, rows[-1]["time"])
        for kind, source in self.times.items():
            mine = [r for r in rows if r["call"] == kind]
            if mine:
                source.stream({"time": [1000 * r["time"] for r in mine], "seconds": [r["seconds"] for r in mine]})
        losses = [r["loss_sum"] for r in rows if r.get("loss_sum") is not None and r["call"] == "forward_backward"]
        if losses:
            start = len(self.losses.data["call"])
            self.losses.stream({"call": list(range(start, start + len(losses))), "loss": losses})
