"""Spans: one record per worker call (role, rank, method, start, end, bytes in and out)."""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
from typing import Iterable


@dataclasses.dataclass(frozen=True)
class Span:
    """A worker call as the worker saw it; times are wall-clock seconds (``time.time()``)."""

    role: str
    rank: int
    method: str
    start: float
    end: float
    bytes_in: int = 0
    bytes_out: int = 0
    stage: str = ""
    pid: int = 0

    @property
    def seconds(self) -> float:
        """Return the call's duration in seconds."""
        return self.end - self.start


MAX_SPANS = 100_000  # the newest spans kept in memory (a long run's full record is the telemetry file)


class Timeline:
    """A thread-safe, append-only list of the newest ``max_spans`` spans, with listeners (the
    telemetry hub subscribes and keeps them all on disk)."""

    def __init__(self, max_spans: int = MAX_SPANS) -> None:
        self._spans: collections.deque[Span] = collections.deque(maxlen=max_spans)
        self._lock = threading.Lock()
        self._listeners: list = []
        self._local = threading.local()

    @property
    def stage(self) -> str:
        """The dataflow stage this thread is running (stamped on the worker calls it submits)."""
        return getattr(self._local, "stage", "")

    @stage.setter
    def stage(self, name: str) -> None:
        self._local.stage = name

    @contextlib.contextmanager
    def staged(self, name: str):
        """Within the block, this thread's worker calls belong to stage ``name``; yields nothing."""
        outer, self.stage = self.stage, name
        try:
            yield
        finally:
            self.stage = outer

    def add(self, spans: Iterable[Span]) -> None:
        """Append spans and hand them to every listener."""
        spans = list(spans)
        with self._lock:
            self._spans.extend(spans)
            listeners = list(self._listeners)
        for listener in listeners:
            listener(spans)

    def subscribe(self, listener) -> None:
        """Call ``listener(list_of_spans)`` for every batch of spans added from now on."""
        with self._lock:
            self._listeners.append(listener)

    def spans(self, role: str | None = None, method: str | None = None, since: float = 0.0) -> list[Span]:
        """Return the recorded spans, optionally only one role's, one method's, or newer ones."""
        with self._lock:
            return [s for s in self._spans if (role is None or s.role == role)
                    and (method is None or s.method == method) and s.start >= since]

    def ending_after(self, t: float, slack_s: float = 60.0) -> list[Span]:
        """Return the spans that ended after ``t``, reading from the newest back (spans arrive
        in about the order they end; ``slack_s`` covers batches that arrive late), so the cost
        is that of the recent spans, not of all that are kept."""
        out = []
        with self._lock:
            for s in reversed(self._spans):
                if s.end < t - slack_s:
                    break
                if s.end > t:
                    out.append(s)
        return out[::-1]

    def records(self) -> list[dict]:
        """Return all spans as plain dicts (for tables, JSON and the dashboard)."""
        return [dataclasses.asdict(s) for s in self.spans()]

    def clear(self) -> None:
        """Forget all spans."""
        with self._lock:
            self._spans.clear()
