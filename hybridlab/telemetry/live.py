"""LiveReporter: a thread in the controller that tells the dashboard what is running now.

Once a second it sends a ``running`` record (the calls in flight from the session's CallWatch:
role, ranks, method, stage, start time, deadline) whenever the set of calls changed or a call
went past its deadline, so a viewer in another process can show each call's age and flag the
late ones in red. It also answers the page's run controls: a page (inline or served, in any
process) asks by creating a file ``RUN_DIR/control/<time>-<pid>-<n>.ACTION`` (one per click);
the reporter carries the actions out in the order they were asked and sends a record saying how
each went. ``stacks`` writes every worker's stacks through the
stuck-call detector's dump (a ``stacks`` record names the files); ``pause``, ``resume`` and
``stop`` hold, release or end a training run between steps, ``remap`` (the request file holds the
mapping as JSON) moves the run onto another mapping at its next step boundary (a ``control``
record; the remap itself sends a ``remap`` record).
"""
from __future__ import annotations

import itertools
import os
import threading
import time
from pathlib import Path
from typing import Callable

ACTIONS = ("pause", "resume", "stop", "stacks", "remap")
WITH_PAYLOAD = ("remap",)  # their request file holds what they act on (remap: the mapping as JSON)
CONTROL_DIR = "control"
_COUNT = itertools.count()


def request_action(run_dir: str | Path, action: str, payload: str = "") -> Path:
    """Ask the run's controller to carry out ``action`` (one of ``ACTIONS``; ``remap`` takes the
    mapping as JSON in ``payload``); returns the request file."""
    if action not in ACTIONS:
        raise ValueError(f"unknown run control {action!r}: one of {', '.join(ACTIONS)}")
    # one file per click, named by the time it was asked (then the process and a count: unique):
    # two clicks are two requests, carried out in the order they were made
    folder = Path(run_dir) / CONTROL_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{time.time_ns():020d}-{os.getpid()}-{next(_COUNT)}.{action}"
    tmp = folder / f".{path.name}.tmp"
    tmp.write_text(payload)
    tmp.replace(path)  # whole: the reporter never reads half a mapping
    return path


class LiveReporter:
    """See the module docstring; ``running()`` is CallWatch.running, ``actions`` maps each
    action the run offers to what carries it out (``stacks`` returns the files it wrote;
    ``paused()``, when given, says whether the run is paused), ``emit(kind, record)`` sends to the hub."""

    def __init__(self, run_dir: Path, running: Callable[[], list[dict]], actions: dict[str, Callable],
                 emit: Callable[[str, dict], None], period_s: float = 1.0,
                 paused: Callable[[], bool] | None = None, samples: Callable[[], list[dict]] | None = None):
        self.requests = Path(run_dir) / CONTROL_DIR
        self.running, self.actions, self.emit, self.period = running, actions, emit, period_s
        self.paused = paused
        self.samples = samples  # device samples of the controller's own (the kernel's warm pool)
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
            action = request.suffix[1:]
            try:
                payload = request.read_text() if action in WITH_PAYLOAD else ""
                request.unlink()
            except FileNotFoundError:  # another reporter of the same run took it
                continue
            self._carry_out(action, payload)
        for sample in self.samples() if self.samples is not None else []:
            self.emit("device", sample)
        paused = self.paused() if self.paused is not None else False
        if paused != self._paused:  # paused or let go from the notebook, too
            self._paused = paused
            self.emit("control", {"action": None, "ok": True, "paused": paused})

    def _pending(self) -> list[Path]:
        """Return the waiting request files of known actions, oldest first (their names sort so)."""
        try:
            names = sorted(os.listdir(self.requests))
        except FileNotFoundError:
            return []
        return [self.requests / n for n in names if not n.startswith(".") and n.rpartition(".")[2] in ACTIONS]

    def _carry_out(self, action: str, payload: str = "") -> None:
        """Run one requested action and report it; a failure is reported, never raised."""
        do = self.actions.get(action)
        try:
            if do is None:
                raise RuntimeError(f"this run does not offer {action!r}")
            result = do(payload) if action in WITH_PAYLOAD else do()
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
