"""StepBoundary: steps and edits of a running session never overlap.

A step (or an evaluation) holds the lock. An edit (``update``, ``remap``, a new dataflow) is
queued and applied between steps, in the order the edits were made: by the stepping thread
before its next step, or by the caller itself as soon as no step holds the lock (the run
ended, or none is going). The caller waits until its edit was applied and gets its result or
its error. An edit whose caller was interrupted before it started is dropped, not applied
later behind the user's back.
"""
from __future__ import annotations

import contextlib
import queue
import threading
import time
from typing import Any, Callable, Iterator


class _Edit:
    """One change waiting for a step boundary, and its outcome."""

    def __init__(self, fn: Callable[[], Any]):
        self.fn, self.done, self.result, self.error = fn, threading.Event(), None, None
        self._state = "queued"           # queued -> running -> done, or queued -> cancelled
        self._state_lock = threading.Lock()

    def run(self) -> None:
        """Apply the edit unless it was cancelled; keep its result or error for the caller."""
        with self._state_lock:
            if self._state != "queued":
                return
            self._state = "running"
        try:
            self.result = self.fn()
        except BaseException as exc:  # handed to the waiting caller
            self.error = exc
        finally:
            self._state = "done"
            self.done.set()

    def cancel(self) -> None:
        """Drop the edit if it has not started (its caller gave up waiting)."""
        with self._state_lock:
            if self._state == "queued":
                self._state = "cancelled"


class StepBoundary:
    """The lock that steps hold, and the queue of edits that wait for a boundary."""

    def __init__(self):
        self.lock = threading.RLock()
        self._edits: queue.Queue[_Edit] = queue.Queue()
        self._stepping: int | None = None   # the thread running a step, if any
        self._running = threading.Event()   # cleared while paused
        self._running.set()
        self.held = threading.Event()       # set while a training loop waits, paused, between steps

    # ------------------------------------------------------------- pausing
    @property
    def paused(self) -> bool:
        """True between ``pause()`` and ``resume()``."""
        return not self._running.is_set()

    def pause(self) -> None:
        """Hold training loops at their next step boundary (the step under way finishes)."""
        self._running.clear()

    def resume(self) -> None:
        """Let paused training loops go on."""
        self._running.set()

    def wait_while_paused(self) -> float:
        """Block a training loop between steps while paused, applying edits made meanwhile (the
        caller applies them itself: no step holds the lock); returns the seconds waited."""
        start = time.perf_counter()
        self.held.set()
        try:
            while not self._running.wait(0.05):
                pass
        finally:
            self.held.clear()
        return time.perf_counter() - start

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Hold the boundary for one step; edits queued before it apply first."""
        with self.lock:
            self.run_pending()
            self._stepping = threading.get_ident()
            try:
                yield
            finally:
                self._stepping = None

    def run(self, edit: Callable[[], Any], poll_s: float = 0.05) -> Any:
        """Apply ``edit()`` at the next step boundary (now, if no step runs); returns its result
        or raises its error. Raises RuntimeError when called from inside a step."""
        if self._stepping == threading.get_ident():
            raise RuntimeError("a session edit (update, remap, a new dataflow) cannot run inside a step:"
                               " call it between steps")
        request = _Edit(edit)
        self._edits.put(request)
        try:
            while not request.done.is_set():
                if self.lock.acquire(blocking=False):  # no step holds it: apply the queue in order
                    try:
                        self.run_pending()
                    finally:
                        self.lock.release()
                request.done.wait(poll_s)
        except BaseException:
            request.cancel()
            raise
        if request.error is not None:
            raise request.error
        return request.result

    def run_pending(self) -> None:
        """Apply every queued edit in order (the caller holds the lock)."""
        while True:
            try:
                request = self._edits.get_nowait()
            except queue.Empty:
                return
            request.run()
