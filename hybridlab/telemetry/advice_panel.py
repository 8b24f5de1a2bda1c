"""AdvicePanel: the mapping advisor's latest ``advice`` record on the dashboard (section Mapping
and resharding): the measured step against the prediction for the current mapping, the
trainers' and the generator's busy fractions measured and predicted, and, when another mapping
is predicted at least 15% faster, the proposal with a button that asks the run to remap onto it
(a ``remap`` run control: the controller remaps at the next step boundary). After a remap the
record covers only the steps since, so it checks the prediction against what followed.
"""
from __future__ import annotations

import html
import json
from pathlib import Path

from hybridlab.telemetry.live import request_action

NO_ADVICE = ("*The mapping advisor compares the measured step with its prediction every"
             " `trainer.advise_every` steps (it needs a device profile: `hybridlab calibrate`).*")


def advice_text(r: dict) -> str:
    """Return one advice record as Markdown."""
    if "failed" in r:
        return f"**Mapping advisor** (step {r['step']}): no advice: {html.escape(r['failed'].splitlines()[0])}"
    steps = f"steps {r['step'] - r['steps'] + 1}-{r['step']}"
    after = f", since the remap after step {r['since_step']}" if r.get("after_remap") else ""
    lines = [f"**Mapping advisor** (profile {r['profile']}, {steps}{after})",
             f"Measured {r['measured_s']:.3f} s per step; predicted {r['predicted_s']:.3f} s for this mapping"
             + (f" ({r['error']:+.0%})." if r.get("error") is not None else "."),
             "Devices busy, measured / predicted: " + "; ".join(
                 f"{group}s {b['measured']:.0%} / {b['predicted']:.0%}" for group, b in r["busy"].items())]
    best = r["best"]
    if r["propose"]:
        lines.append(f"**Proposal:** {html.escape(best['label'])}: predicted {best['predicted_s']:.3f} s per step"
                     f" ({r['speedup']:.2f}x faster).")
    else:
        lines.append(f"No mapping is predicted at least 15% faster (the best: {html.escape(best['label'])},"
                     f" {best['predicted_s']:.3f} s).")
    return "\n\n".join(lines)


class AdvicePanel:
    """The advisor's text, and (for pages that may control the run) the button that remaps."""

    kinds = ("advice",)  # the records it reads (the dashboard hands it only these)

    def __init__(self, run_dir: str | Path, control: bool):
        import panel as pn

        self.run_dir = Path(run_dir)
        self.latest: dict | None = None
        self.text = pn.pane.Markdown(NO_ADVICE, name="advice", sizing_mode="stretch_width")
        self.button = pn.widgets.Button(label="Remap to the proposal", color="primary", visible=False,
                                        description="remap the run onto the proposed mapping at its next step boundary")
        self.button.on_click(lambda _event: self.request())
        self.control = control
        self.layout = pn.Column(self.text, self.button, sizing_mode="stretch_width")

    def request(self) -> None:
        """Ask the run's controller to remap onto the latest proposal."""
        if self.latest and self.latest.get("propose"):
            request_action(self.run_dir, "remap", json.dumps(self.latest["best"]["mapping"]))
            self.button.visible = False
            self.text.object = advice_text(self.latest) + "\n\n*Remap asked of the controller.*"

    def feed(self, records: list[dict]) -> None:
        """Show the newest advice among ``records``."""
        for r in records:
            self.latest = r
        if records:
            self.text.object = advice_text(self.latest)
            self.button.visible = self.control and bool(self.latest.get("propose"))
