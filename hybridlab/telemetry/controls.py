"""The run controls of the dashboard: pause, resume, stop and a stack dump of every worker.

A click writes a request file that the run's controller answers within a second (see
``telemetry.live``), so the buttons work from an inline dashboard and from a page served by
another process alike. The controller's answer (a ``control`` or ``stacks`` record) shows
under the buttons, and the page's status says when the run is paused. Only pages that may
control the run get the buttons (``serving.control_allowed``).
"""
from __future__ import annotations

from pathlib import Path

from hybridlab.telemetry.live import request_action

BUTTONS = (("pause", "Pause", "warning", "hold the run at its next step boundary"),
           ("resume", "Resume", "success", "let a paused run go on"),
           ("stop", "Stop", "danger", "end the run after its current step (it still evaluates and saves)"),
           ("stacks", "Write every worker's stacks", "light", "dump each worker's Python stacks to RUN_DIR/stacks"))


class RunControls:
    """The control buttons and the line that reports the controller's answer."""

    kinds = ("control", "stacks")  # the records it reads (the dashboard hands it only these)

    def __init__(self, run_dir: str | Path):
        import panel as pn

        self.run_dir = Path(run_dir)
        self.paused = False
        self.buttons = {}
        for action, label, color, tip in BUTTONS:
            button = pn.widgets.Button(label=label, color=color, description=tip, width=230)
            button.on_click(lambda _event, action=action: self.request(action))
            self.buttons[action] = button
        self.message = pn.pane.Markdown("", name="control message", width=240)
        self.layout = pn.Column(pn.pane.Markdown("**Run controls**"), *self.buttons.values(), self.message)

    def request(self, action: str) -> None:
        """Ask the run's controller to carry out ``action`` (answered within a second)."""
        request_action(self.run_dir, action)
        self.message.object = f"*{action} asked of the controller*"

    def feed(self, records: list[dict]) -> None:
        """Show the controller's answers among ``records``; track whether the run is paused."""
        for r in records:
            if r.get("kind") == "control":
                if r.get("ok"):
                    self.paused = bool(r.get("paused"))
                if r.get("ok") and r.get("action"):
                    self.message.object = {"pause": "paused: the run holds at its next step boundary",
                                           "resume": "resumed", "stop": "stopping after the current step",
                                           "remap": "remapping at the next step boundary"
                                           }.get(r.get("action"), r.get("action", ""))
                elif not r.get("ok"):
                    self.message.object = f"<span style='color:#c62828'>{r.get('action')}: {r.get('error')}</span>"
            elif r.get("kind") == "stacks" and r.get("error"):
                self.message.object = f"<span style='color:#c62828'>stacks: {r.get('error')}</span>"
            elif r.get("kind") == "stacks":
                self.message.object = f"{len(r.get('files', []))} stack files written (section Stuck calls)"
