"""Controls: Start, Pause, Resume, Step and Stop buttons over a session, with a progress bar and
the latest step's metrics."""
from __future__ import annotations

import html
import threading
from typing import TYPE_CHECKING

import ipywidgets as widgets

from hybridlab.notebook.apply import FOREGROUND_NOTE, ok, problem_list, problems_of, running_in_background

if TYPE_CHECKING:
    from hybridlab.dataflow.session_verbs import SessionVerbs
    from hybridlab.dataflow.graph import StepResult

SHOWN = ("reward/mean", "accuracy", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "response_length/mean",
         "timing/step_s")


class Controls(widgets.VBox):
    """Buttons that call ``start_background``, ``pause``, ``resume``, ``step`` and ``stop``."""

    def __init__(self, rl: "SessionVerbs", steps: int | None = None):
        self.rl = rl
        self.steps = widgets.BoundedIntText(value=steps or rl.cfg.trainer.steps, min=1, max=10**7,
                                            description="steps", layout=widgets.Layout(width="180px"))
        self.buttons = {name: widgets.Button(description=name, icon=icon) for name, icon in (
            ("Start", "play"), ("Pause", "pause"), ("Resume", "step-forward"), ("Step", "forward"), ("Stop", "stop"))}
        for name, button in self.buttons.items():
            button.on_click(lambda _, name=name: getattr(self, name.lower())())
        self.progress = widgets.IntProgress(value=0, min=0, max=1, description="step")
        self.metrics = widgets.HTML()
        self.status = widgets.HTML()
        self._first_step = rl.state.step_count
        self._thread: threading.Thread | None = None
        rl.step_callbacks.append(self._on_step)
        super().__init__([widgets.HBox([self.steps, *self.buttons.values()]), self.progress, self.metrics,
                          self.status, widgets.HTML(f"<small>{html.escape(FOREGROUND_NOTE)}</small>")])

    # ------------------------------------------------------------- buttons
    def start(self) -> None:
        """Start ``steps`` steps in the background (the kernel stays free)."""
        if running_in_background(self.rl):
            self.status.value = problem_list("Not started:", ["a background run is going (Resume it if it is"
                                                              " paused, or Stop it first)"])
            return
        self._first_step = self.rl.state.step_count
        self.progress.min, self.progress.max, self.progress.value = 0, self.steps.value, 0
        try:
            run = self.rl.start_background(self.steps.value)
        except Exception as exc:
            self.status.value = problem_list("Cannot start:", problems_of(exc))
            return
        self.status.value = ok(f"Running {self.steps.value} steps in the background.")
        self._thread = threading.Thread(target=self._when_done, args=(run,), daemon=True)
        self._thread.start()

    def pause(self) -> None:
        """Hold the run at its next step boundary."""
        if not running_in_background(self.rl):
            self.status.value = ok("No run to pause.")
            return
        self.rl.pause()
        self.status.value = ok("Pausing: the step under way finishes, then the run waits at the step boundary."
                               " Edits and Step work while it waits.")
        threading.Thread(target=self._say_when_held, daemon=True).start()

    def _say_when_held(self) -> None:
        while self.rl.paused and running_in_background(self.rl):
            if self.rl.wait_until_held(0.2):
                self.status.value = ok(f"Paused after step {self.rl.state.step_count}. Edits and Step work now;"
                                       " Resume goes on.")
                return

    def resume(self) -> None:
        """Let a paused run go on."""
        self.rl.unpause()
        self.status.value = ok("Resumed.")

    def step(self) -> None:
        """Run one step now (while a background run is going, only when it is paused and held)."""
        if running_in_background(self.rl) and not self.rl.held:
            self.status.value = problem_list("Not stepped:", ["a background run is stepping; Pause it first"])
            return
        try:
            result = self.rl.step()
        except Exception as exc:
            self.status.value = problem_list(f"Step {self.rl.state.step_count + 1} failed:", problems_of(exc))
            return
        self._on_step(result)
        self.status.value = ok(f"Ran step {result.step}.")

    def stop(self) -> None:
        """Stop the background run after its current step; it evaluates and writes its summary."""
        if not running_in_background(self.rl):
            self.status.value = ok("No background run is going.")
            return
        self.rl.background.stop()
        self.status.value = ok("Stopping after the current step; the summary is written when it ends.")

    # ------------------------------------------------------------- updates
    def wait(self, timeout: float | None = None) -> None:
        """Wait until the background run this widget started has ended and the widget says so."""
        if self._thread is not None:
            self._thread.join(timeout)

    def _when_done(self, run) -> None:
        try:
            summary = run.wait()
        except Exception as exc:
            self.status.value = problem_list("The run failed:", problems_of(exc))
            return
        self.status.value = ok(f"Finished at step {summary['steps']} ({summary['stopped_by']});"
                               f" summary written to {self.rl.run_dir / 'summary.json'}.")

    def _on_step(self, result: "StepResult") -> None:
        done = result.step - self._first_step
        self.progress.max = max(self.progress.max, done)  # steps run from code count too
        self.progress.value = done
        cells = "".join(f"<td style='padding:0 8px'>{html.escape(k)}<br><b>{result.metrics[k]:.4g}</b></td>"
                        for k in SHOWN if isinstance(result.metrics.get(k), (int, float)))
        self.metrics.value = f"<table><tr><td>step<br><b>{result.step}</b></td>{cells}</tr></table>"

    def close(self) -> None:
        """Stop following the session, then close the widget."""
        if self._on_step in self.rl.step_callbacks:
            self.rl.step_callbacks.remove(self._on_step)
        super().close()
