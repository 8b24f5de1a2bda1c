"""The dashboard's training panel: how the update went each step (the ``actor/`` and ``critic/``
metrics of the update stages) and where the step's seconds went, stage by stage."""
from __future__ import annotations

import functools

from hybridlab.telemetry.panels import COMMON, ROLLOVER

# (metric, label, figure): the update's curves, on three plots by scale
CURVES = (("actor/pg_loss", "policy loss", "loss"), ("actor/kl_loss", "KL loss", "loss"),
          ("critic/vf_loss", "value loss", "loss"),
          ("actor/entropy", "entropy (nats per token)", "policy"), ("actor/ppo_kl", "KL to the old policy", "policy"),
          ("actor/pg_clipfrac", "clipped share", "policy"),
          ("actor/grad_norm", "actor grad norm", "grad"), ("critic/grad_norm", "critic grad norm", "grad"))
COLORS = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f")
TIMING = "timing/"
BARS_UP_TO = 500  # steps drawn as stacked bars; a longer history as stacked areas


def stage_seconds(record: dict) -> dict[str, float]:
    """Return a metrics record's seconds per dataflow stage (``timing/STAGE_s``; the whole step's
    ``timing/step_s`` left out)."""
    return {stage: v for stage, k in _stage_keys(tuple(record)) if isinstance(v := record[k], (int, float))}


@functools.lru_cache(maxsize=256)
def _stage_keys(keys: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """Return (stage, key) of a metrics record's stage timings (steps log the same keys: once per key set)."""
    return tuple((k[len(TIMING):-2], k) for k in keys if k.startswith(TIMING) and k.endswith("_s")
                 and k != "timing/step_s")


class TrainingPanel:
    """Losses, policy statistics and gradient norms per step, and the step's seconds by stage."""

    kinds = ("metrics",)  # the records it reads (the dashboard hands it only these)

    def __init__(self):
        import panel as pn
        from bokeh.models import ColumnDataSource
        from bokeh.plotting import figure

        self.source = ColumnDataSource({"step": [], **{key: [] for key, _, _ in CURVES}})
        titles = {"loss": "update losses per step (mean over mini-batches)",
                  "policy": "policy per step: entropy (nats/token), KL to the old policy, clipped share of tokens",
                  "grad": "gradient norm per step (before clipping)"}
        self.figs = {name: figure(title=title, x_axis_label="step", **COMMON) for name, title in titles.items()}
        for i, (key, label, name) in enumerate(CURVES):
            self.figs[name].line("step", key, source=self.source, color=COLORS[i % len(COLORS)], legend_label=label)
        for fig in self.figs.values():
            fig.legend.location = "top_left"
        self.stages: list[str] = []
        self.bars = True  # the stages drawn as bars (else areas: see _draw)
        self.timing = ColumnDataSource({"step": []})
        self.time_fig = figure(title="seconds per step by stage (stacked)", x_axis_label="step",
                               y_axis_label="seconds", **COMMON)
        row = dict(sizing_mode="stretch_width")
        self.layout = pn.Column(pn.Row(self.figs["loss"], self.figs["policy"], **row), self.figs["grad"], **row)

    def feed(self, records: list[dict]) -> None:
        """Stream the update metrics and stage seconds of new steps."""
        rows = [r for r in records if r.get("kind") == "metrics"]
        if not rows:
            return
        nan = float("nan")
        self.source.stream({"step": [r["step"] for r in rows], **{key: [r.get(key, nan) for r in rows]
                                                                  for key, _, _ in CURVES}},
                           rollover=ROLLOVER["training"])
        seconds = [stage_seconds(r) for r in rows]
        new = sorted({s for row in seconds for s in row} - set(self.stages))
        if new:
            self._add_stages(new)
        self.timing.stream({"step": [r["step"] for r in rows],
                            **{s: [row.get(s, 0.0) for row in seconds] for s in self.stages}},
                           rollover=ROLLOVER["training"])
        if (len(self.timing.data["step"]) <= BARS_UP_TO) != self.bars:
            self._draw()

    def _add_stages(self, new: list[str]) -> None:
        """Add stages to the stacked plot (a stage first seen now reads 0 s in earlier steps)."""
        data = dict(self.timing.data)
        for stage in new:
            data[stage] = [0.0] * len(data["step"])
        self.stages += new
        self.timing.data = data
        self._draw()

    def _draw(self) -> None:
        """Draw the stages stacked: a bar per step, or past ``BARS_UP_TO`` steps an area per stage
        (a long run's tens of thousands of bars take seconds to draw and to update)."""
        self.bars = len(self.timing.data["step"]) <= BARS_UP_TO
        self.time_fig.renderers = []
        if self.time_fig.legend:
            self.time_fig.legend.items = []
        colors = [COLORS[i % len(COLORS)] for i in range(len(self.stages))]
        if self.bars:
            self.time_fig.vbar_stack(self.stages, x="step", width=0.8, source=self.timing, color=colors,
                                     legend_label=list(self.stages))
        else:
            self.time_fig.varea_stack(self.stages, x="step", source=self.timing, color=colors,
                                      legend_label=list(self.stages))
        self.time_fig.legend.location = "top_left"
