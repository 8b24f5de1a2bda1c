"""The dashboard's streaming panel (``trainer.streaming``, dataflow/stream.py): per step, the
engines' occupancy against the groups in flight and finished, each side's idle time, the
staleness of the trained tokens with the partial and preempted samples, and over the run the
staleness histogram of every trained token."""
from __future__ import annotations

from hybridlab.telemetry.panels import COMMON, ROLLOVER

WAITING = "*no streaming metrics: this run generates a batch per step (trainer.streaming=true streams)*"
STALE = "rollout/stale_tokens/"  # trained tokens per staleness (updates behind the trainer)
CURVES = {"occupancy": "rollout/occupancy", "in_flight": "rollout/in_flight_groups", "buffer": "rollout/buffer_groups",
          "engine_idle": "rollout/engine_idle_share", "trainer_wait": "rollout/trainer_wait_s",
          "staleness": "rollout/staleness", "staleness_mean": "rollout/staleness_mean",
          "partial": "rollout/partial_share", "preempted": "rollout/preempted", "samples": "rollout/samples"}


class StreamPanel:
    """Three plots, shown once a step reports streaming metrics (until then, one line says why)."""

    kinds = ("metrics",)  # the records it reads (the dashboard hands it only these)

    def __init__(self):
        import panel as pn
        from bokeh.models import ColumnDataSource

        self.source = ColumnDataSource({"step": [], **{name: [] for name in CURVES}, "partial_pct": [],
                                        "preempted_pct": [], "engine_idle_pct": []})
        self.histogram = ColumnDataSource({"staleness": [], "tokens": []})
        self.counts: dict[int, int] = {}
        self.note = pn.pane.Markdown(WAITING, name="stream note")
        row = dict(sizing_mode="stretch_width")
        self.figures = pn.Column(visible=False, **row)  # built at the first streaming step: most runs have none
        self.layout = pn.Column(pn.pane.Markdown("### Streaming rollouts"), self.note, self.figures, **row)

    def _build(self) -> None:
        """Draw the three plots into ``figures``."""
        import panel as pn
        from bokeh.plotting import figure

        engines = figure(title="engines per step: running sequences (mean over engine steps), groups in flight and"
                               " finished waiting", x_axis_label="step", **COMMON)
        for name, color, label in (("occupancy", "#4e79a7", "running sequences"),
                                   ("in_flight", "#f28e2b", "groups in flight"), ("buffer", "#59a14f", "groups ready")):
            engines.line("step", name, source=self.source, color=color, legend_label=label)
        shares = figure(title="per step: tokens' staleness (updates), partial and preempted samples %, idle time",
                        x_axis_label="step", **COMMON)
        for name, color, label in (("staleness", "#e15759", "staleness, max"),
                                   ("staleness_mean", "#ff9da7", "staleness, mean"),
                                   ("partial_pct", "#76b7b2", "partial samples %"),
                                   ("preempted_pct", "#b07aa1", "preempted samples %"),
                                   ("engine_idle_pct", "#9c755f", "engine idle %"),
                                   ("trainer_wait", "#edc948", "trainer waiting (s)")):
            shares.line("step", name, source=self.source, color=color, legend_label=label)
        histogram = figure(title="trained tokens by staleness (updates behind the trainer), whole run",
                           x_axis_label="staleness", **COMMON)
        histogram.vbar(x="staleness", top="tokens", width=0.8, source=self.histogram, color="#4e79a7")
        self.figures[:] = [pn.Row(engines, shares, sizing_mode="stretch_width"), histogram]

    def feed(self, records: list[dict]) -> None:
        """Stream the streaming metrics of new steps; the first such step shows the plots."""
        rows = [r for r in records if r.get("kind") == "metrics" and CURVES["occupancy"] in r]
        if not rows:
            return
        if not self.figures.visible:
            self._build()
            self.note.visible, self.figures.visible = False, True
        nan = float("nan")
        data = {"step": [r["step"] for r in rows], **{name: [r.get(key, nan) for r in rows] for name, key in CURVES.items()}}
        data["partial_pct"] = [100 * v for v in data["partial"]]
        data["preempted_pct"] = [100 * p / s if s else nan for p, s in zip(data["preempted"], data["samples"])]
        data["engine_idle_pct"] = [100 * v for v in data["engine_idle"]]
        self.source.stream(data, rollover=ROLLOVER["stream"])
        for r in rows:
            for key in (k for k in r if k.startswith(STALE)):
                self.counts[int(key[len(STALE):])] = self.counts.get(int(key[len(STALE):]), 0) + int(r[key])
        ages = sorted(self.counts)
        self.histogram.data = {"staleness": ages, "tokens": [self.counts[a] for a in ages]}
