"""The dashboard's MoE panel: how an MoE actor's routers spread tokens over the experts
(``actor/moe/*`` metrics of ``workers/train/moe.py``): the load-balancing loss and the
busiest expert's load per step, and the tokens each expert received in the latest update."""
from __future__ import annotations

from hybridlab.telemetry.panels import COMMON, ROLLOVER

WAITING = "*no MoE metrics: this run's actor has no routed experts (Qwen3-MoE checkpoints report them per update)*"
PREFIX = "actor/moe/"
TOKENS = PREFIX + "expert_tokens/"


class MoEPanel:
    """Two plots, shown once a step reports MoE metrics (until then, one line says why)."""

    kinds = ("metrics",)  # the records it reads (the dashboard hands it only these)

    def __init__(self):
        import panel as pn
        from bokeh.models import ColumnDataSource

        self.source = ColumnDataSource({"step": [], "loss": [], "load_max": []})
        self.experts = ColumnDataSource({"expert": [], "tokens": []})
        self.note = pn.pane.Markdown(WAITING, name="moe note")
        row = dict(sizing_mode="stretch_width")
        self.figures = pn.Row(visible=False, **row)  # built at the first MoE step: most runs have none
        self.layout = pn.Column(pn.pane.Markdown("### Routed experts"), self.note, self.figures, **row)

    def _build(self) -> None:
        """Draw the two plots into ``figures``."""
        from bokeh.plotting import figure

        self.balance = figure(title="MoE routing per step: load-balancing loss and the busiest expert's tokens over"
                                    " the mean (both 1.0 when even)", x_axis_label="step", **COMMON)
        self.balance.line("step", "loss", source=self.source, color="#4e79a7", legend_label="load-balancing loss")
        self.balance.line("step", "load_max", source=self.source, color="#e15759", legend_label="busiest expert load")
        self.balance.legend.location = "top_left"
        self.tokens = figure(title="tokens per expert in the latest update (sum over sparse layers)",
                             x_axis_label="expert", **COMMON)
        self.tokens.vbar(x="expert", top="tokens", width=0.8, source=self.experts, color="#76b7b2")
        self.figures[:] = [self.balance, self.tokens]

    def feed(self, records: list[dict]) -> None:
        """Stream the MoE metrics of new steps; the first such step shows the plots."""
        rows = [r for r in records if r.get("kind") == "metrics" and PREFIX + "expert_load_max" in r]
        if not rows:
            return
        if not self.figures.visible:
            self._build()
            self.note.visible, self.figures.visible = False, True
        self.source.stream({"step": [r["step"] for r in rows],
                            "loss": [r.get(PREFIX + "load_balancing_loss", float("nan")) for r in rows],
                            "load_max": [r[PREFIX + "expert_load_max"] for r in rows]}, rollover=ROLLOVER["moe"])
        latest = rows[-1]
        experts = sorted(int(k[len(TOKENS):]) for k in latest if k.startswith(TOKENS))
        self.experts.data = {"expert": experts, "tokens": [latest[f"{TOKENS}{e}"] for e in experts]}
