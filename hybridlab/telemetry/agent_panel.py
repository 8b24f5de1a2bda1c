"""The dashboard's agent panel: what multi-turn rollouts did each step (``agent/*`` metrics of
``dataflow/agent_stages.py``): turns per trajectory, tokens by source, calls, errors and
latency per tool, and the share of model calls whose prompt had to be re-tokenized."""
from __future__ import annotations

from hybridlab.telemetry.panels import COMMON, ROLLOVER

WAITING = ("*no agent metrics yet: runs with agent rollouts (`rollout.tools`, `rollout.agent` or `rollout.env`)"
           " show them here after their first step*")
TOOL_PREFIX = "agent/tool/"


def tool_names(record: dict) -> list[str]:
    """Return the tools a step's metrics record reports (``agent/tool/NAME/calls``), sorted."""
    return sorted(k[len(TOOL_PREFIX):-len("/calls")] for k in record
                  if k.startswith(TOOL_PREFIX) and k.endswith("/calls"))


class AgentPanel:
    """Four plots per step, shown once a step reports agent metrics (until then, one line says why)."""

    kinds = ("metrics",)  # the records it reads (the dashboard hands it only these)

    def __init__(self):
        import panel as pn
        from bokeh.models import ColumnDataSource

        self.source = ColumnDataSource({"step": [], "turns_mean": [], "turns_max": [], "retokenized_pct": [],
                                        "model_tokens": [], "context_tokens": []})
        self.tools: dict[str, ColumnDataSource] = {}
        self.note = pn.pane.Markdown(WAITING, name="agent note")
        row = dict(sizing_mode="stretch_width")
        self.figures = pn.Column(visible=False, **row)  # built at the first agent step: most runs have none
        self.layout = pn.Column(pn.pane.Markdown("### Agent rollouts"), self.note, self.figures, **row)

    def _build(self) -> None:
        """Draw the four plots into ``figures``."""
        import panel as pn
        from bokeh.models import LinearAxis, Range1d
        from bokeh.plotting import figure

        self.turns = figure(title="turns per trajectory: mean, max (left); re-tokenized model calls, % (right)",
                            x_axis_label="step", **COMMON)
        self.turns.line("step", "turns_mean", source=self.source, color="#4e79a7", legend_label="turns, mean")
        self.turns.scatter("step", "turns_max", source=self.source, color="#4e79a7", size=4, legend_label="turns, max")
        self.turns.extra_y_ranges = {"pct": Range1d(0, 100)}
        self.turns.add_layout(LinearAxis(y_range_name="pct", axis_label="%"), "right")
        self.turns.line("step", "retokenized_pct", source=self.source, y_range_name="pct", color="#e15759",
                        legend_label="re-tokenized %")
        self.turns.legend.location = "top_left"
        self.tokens = figure(title="tokens per step by source: the model's (trained) and tool, environment and"
                                   " user turns (context)", x_axis_label="step", **COMMON)
        self.tokens.vbar_stack(["model_tokens", "context_tokens"], x="step", width=0.8, source=self.source,
                               color=["#4e79a7", "#f28e2b"], legend_label=["model", "tool / env / user"])
        self.tokens.legend.location = "top_left"
        self.calls = figure(title="tool calls per step (solid) and failed calls (dashed), per tool",
                            x_axis_label="step", **COMMON)
        self.latency = figure(title="tool latency per step (ms per call, mean), per tool", x_axis_label="step",
                              **COMMON)
        row = dict(sizing_mode="stretch_width")
        self.figures[:] = [pn.Row(self.turns, self.tokens, **row), pn.Row(self.calls, self.latency, **row)]

    def feed(self, records: list[dict]) -> None:
        """Stream the agent metrics of new steps; the first such step shows the plots."""
        rows = [r for r in records if r.get("kind") == "metrics" and "agent/turns_mean" in r]
        if not rows:
            return
        if not self.figures.visible:
            self._build()
            self.note.visible, self.figures.visible = False, True
        self.source.stream({"step": [r["step"] for r in rows],
                            "turns_mean": [r["agent/turns_mean"] for r in rows],
                            "turns_max": [r.get("agent/turns_max", float("nan")) for r in rows],
                            "retokenized_pct": [100 * r.get("agent/retokenized_share", 0.0) for r in rows],
                            "model_tokens": [r.get("agent/model_tokens", 0.0) for r in rows],
                            "context_tokens": [r.get("agent/tool_tokens", 0.0) for r in rows]},
                           rollover=ROLLOVER["agent"])
        first = {}  # a tool's line starts at the first step that called it, however the steps were polled
        for i, r in enumerate(rows):
            for name in tool_names(r):
                first.setdefault(name, i)
        for name in sorted(set(first) - set(self.tools)):
            self._add_tool(name)
        for name, source in self.tools.items():  # a step that did not call the tool: 0 calls, no latency
            key, own = f"{TOOL_PREFIX}{name}/", rows[first.get(name, 0) if not source.data["step"] else 0:]
            calls = [r.get(key + "calls", 0.0) for r in own]
            source.stream({"step": [r["step"] for r in own], "calls": calls,
                           "errors": [r.get(key + "errors", 0.0) for r in own],
                           "latency_ms": [1000 * r[key + "latency_s"] if c else float("nan")
                                          for r, c in zip(own, calls)]}, rollover=ROLLOVER["agent"])

    def _add_tool(self, name: str) -> None:
        from bokeh.models import ColumnDataSource
        from bokeh.palettes import Category10_10

        self.tools[name] = source = ColumnDataSource({"step": [], "calls": [], "errors": [], "latency_ms": []})
        color = Category10_10[(len(self.tools) - 1) % 10]
        self.calls.line("step", "calls", source=source, color=color, legend_label=name)
        self.calls.line("step", "errors", source=source, color=color, line_dash="dashed",
                        legend_label=f"{name} failed")
        self.latency.line("step", "latency_ms", source=source, color=color, legend_label=name)
