"""LiveReporter: a thread in the controller that tells the dashboard what is running now.

Once a second it sends a ``running`` record (the calls in flight from the session's CallWatch:
role, ranks, method, stage, start time, deadline) whenever the set of calls changed or a call
went past its deadline, so a viewer in another process can show each call's age and flag the
late ones in red. It also answers the page's run controls: a page (inline or served, in any
process) asks by creating ``RUN_DIR/control/ACTION``; the reporter carries the action out and
sends a record saying how it went. ``stacks`` writes every worker's stacks through the
stuck-call detector's dump (a ``stacks`` record names the files); ``pause``, ``resume`` and
``stop`` hold, release or end a training run between steps (a ``control`` record).
"""
from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Callable

ACTIONS = ("pause", "resume", "stop", "stacks")
CONTROL_DIR = "control"


def request_action(run_dir: str | Path, action: str) -> Path:
    """Ask the run's controller to carry out ``action`` (one of ``ACTIONS``); returns the request file."""
    if action not in ACTIONS:
        raise ValueError(f"unknown run control {action!r}: one of {', '.join(ACTIONS)}")
    path = Path(run_dir) / CONTROL_DIR / action
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    return path


class LiveReporter:
    """See the module docstring; ``running()`` is CallWatch.running, ``actions`` maps each
    action the run offers to what carries it out (``stacks`` returns the files it wrote;
    ``paused()``, when given, says whether the run is paused), ``emit(kind, record)`` sends to the hub."""

    def __init__(self, run_dir: Path, running: Callable[[], list[dict]], actions: dict[str, Callable],
                 emit: Callable[[str, dict], None], period_s: float = 1.0,
                 paused: Callable[[], bool] | None = None):
        self.requests = Path(run_dir) / CONTROL_DIR
        self.running, self.actions, self.emit, self.period = running, actions, emit, period_s
        self.paused = paused
        self._last: tuple = ()
        self._paused = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="live-reporter", daemon=True)

    def start(self) -> "LiveReporter":
        """Start reporting in the background; returns self."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop reporting (a last empty ``running`` record says nothing is in flight)."""
        self._stop.set()
        self._thread.join(timeout=5)
        if self._last:
            self.emit("running", {"calls": []})

    def tick(self) -> None:
        """Send the calls in flight if they changed, and carry out pending control requests."""
        calls = self.running()
        key = tuple((c["role"], c["method"], c["stage"], c["start"], c["late"]) for c in calls)
        if key != self._last:
            self._last = key
            self.emit("running", {"calls": calls})
        for request in self._pending():  # in the order they were clicked
            request.unlink(missing_ok=True)
            self._carry_out(request.name)
        paused = self.paused() if self.paused is not None else False
        if paused != self._paused:  # paused or let go from the notebook, too
            self._paused = paused
            self.emit("control", {"action": None, "ok": True, "paused": paused})

    def _pending(self) -> list[Path]:
        """Return the waiting request files, oldest first."""
        found = []
        for action in ACTIONS:
            try:
                found.append((os.stat(self.requests / action).st_mtime_ns, self.requests / action))
            except FileNotFoundError:
                continue
        return [path for _, path in sorted(found)]

    def _carry_out(self, action: str) -> None:
        """Run one requested action and report it; a failure is reported, never raised."""
        do = self.actions.get(action)
        try:
            if do is None:
                raise RuntimeError(f"this run does not offer {action!r}")
            result = do()
        except Exception as exc:  # a worker in trouble, or no run to pause: say so on the page
            kind = "stacks" if action == "stacks" else "control"
            self.emit(kind, {"action": action, "files": [], "ok": False, "error": str(exc) or repr(exc)})
            return
        if action == "stacks":
            self.emit("stacks", {"files": [str(f) for f in result]})
        else:
            self._paused = self.paused() if self.paused is not None else action == "pause"
            self.emit("control", {"action": action, "ok": True, "paused": self._paused})

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.tick()
            except Exception:  # the session is shutting down under us: try again next time
                continue
