"""What the editors share: plain-words problems from a refused change, and applying a change
now or, while a background run is going, at its next step boundary without blocking the kernel."""
from __future__ import annotations

import html
import threading
import traceback
from typing import TYPE_CHECKING, Any, Callable

import ipywidgets as widgets

from hybridlab.errors import UserError

if TYPE_CHECKING:
    from hybridlab.dataflow.session_verbs import SessionVerbs

FOREGROUND_NOTE = ("While a cell of this notebook is running, Jupyter delivers clicks only after that"
                   " cell ends; during a background run (start_background) they apply at the next step.")


def problems_of(exc: BaseException) -> list[str]:
    """Return the problems a refused change names, one plain sentence each. An error that is
    not the user's (a worker failed) shows its first line; its traceback goes to the kernel log."""
    if not isinstance(exc, UserError):
        traceback.print_exception(exc)
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), exc.__class__.__name__)
        return [f"{exc.__class__.__name__}: {first} (the full traceback is in the kernel log)"]
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    items = [line[2:].strip() for line in lines if line.startswith("- ")]
    return items or lines or [exc.__class__.__name__]


def running_in_background(rl: "SessionVerbs") -> bool:
    """True while a background run of ``rl`` is going."""
    return rl.background is not None and not rl.background.done()


def stepping_in_background(rl: "SessionVerbs") -> bool:
    """True while a background run of ``rl`` is going and not held by ``pause()``."""
    return running_in_background(rl) and not rl.held


class Applier:
    """Runs one change at a time for a widget and shows what happened in ``status``.

    While a background run is going the change waits for the next step boundary in a thread,
    so the kernel stays free; ``wait()`` returns once it was applied (or refused).
    """

    def __init__(self, rl: "SessionVerbs", status: widgets.HTML):
        self.rl, self.status = rl, status
        self.thread: threading.Thread | None = None
        self.result: Any = None
        self.error: BaseException | None = None

    def busy(self) -> bool:
        """True while a change is waiting for its step boundary."""
        return self.thread is not None and self.thread.is_alive()

    def __call__(self, change: Callable[[], Any], done: Callable[[Any], str]) -> None:
        """Apply ``change()``; show ``done(result)`` (HTML) or the problems it raised."""
        if self.busy():
            self.status.value = _note("The previous change is still waiting for a step boundary.")
            return
        self.result, self.error = None, None

        def work() -> None:
            try:
                self.result = change()
                self.status.value = done(self.result)
            except Exception as exc:  # shown in the widget, in words
                self.error = exc
                if self.rl.broken:  # the change failed halfway: say what that means
                    self.status.value = problem_list("The session cannot continue:", [self.rl.broken])
                else:
                    self.status.value = problem_list("Not applied:", problems_of(exc))

        if stepping_in_background(self.rl):
            self.status.value = _note(f"Queued: applies at the next step boundary (step {self.rl.state.step_count + 1}"
                                      " is running).")
            self.thread = threading.Thread(target=work, name="hybridlab-widget-apply", daemon=True)
            self.thread.start()
        else:
            work()

    def wait(self, timeout: float | None = None) -> Any:
        """Wait for a queued change; returns its result (raises its error)."""
        if self.thread is not None:
            self.thread.join(timeout)
        if self.error is not None:
            raise self.error
        return self.result


def problem_list(title: str, problems: list[str]) -> str:
    """Return HTML: a red title and one bullet per problem."""
    items = "".join(f"<li>{html.escape(p)}</li>" for p in problems)
    return f"<div style='color:#b00020'><b>{html.escape(title)}</b><ul>{items}</ul></div>"


def ok(text: str) -> str:
    """Return HTML for a success message."""
    return f"<div style='color:#1b5e20'><b>{html.escape(text)}</b></div>"


def _note(text: str) -> str:
    return f"<div style='color:#8a6d00'>{html.escape(text)}</div>"
