"""LiveReporter: a thread in the controller that tells the dashboard what is running now.

Once a second it sends a ``running`` record (the calls in flight from the session's CallWatch:
role, ranks, method, stage, start time, deadline) whenever the set of calls changed or a call
went past its deadline, so a viewer in another process can show each call's age and flag the
late ones in red. It also answers stack requests: a page (inline or served) asks by creating
``RUN_DIR/stacks/request``; the reporter writes every worker's stacks through the stuck-call
detector's dump and sends a ``stacks`` record naming the files.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

STACK_REQUEST = "request"


def request_stacks(run_dir: str | Path) -> Path:
    """Ask the run's controller to write every worker's stacks; returns the request file."""
    path = Path(run_dir) / "stacks" / STACK_REQUEST
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    return path


class LiveReporter:
    """See the module docstring; ``running()`` is CallWatch.running, ``stacks()`` writes the
    stack files and returns them, ``emit(kind, record)`` sends to the hub."""

    def __init__(self, run_dir: Path, running: Callable[[], list[dict]], stacks: Callable[[], list[Path]],
                 emit: Callable[[str, dict], None], period_s: float = 1.0):
        self.request = Path(run_dir) / "stacks" / STACK_REQUEST
        self.running, self.stacks, self.emit, self.period = running, stacks, emit, period_s
        self._last: tuple = ()
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
        """Send the calls in flight if they changed, and answer a pending stack request."""
        calls = self.running()
        key = tuple((c["role"], c["method"], c["stage"], c["start"], c["late"]) for c in calls)
        if key != self._last:
            self._last = key
            self.emit("running", {"calls": calls})
        if self.request.exists():
            self.request.unlink(missing_ok=True)
            try:
                files = self.stacks()
                self.emit("stacks", {"files": [str(f) for f in files]})
            except Exception as exc:  # a worker in trouble: say so on the page, keep reporting
                self.emit("stacks", {"files": [], "error": repr(exc)})

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.tick()
            except Exception:  # the session is shutting down under us: try again next time
                continue
