"""RecordSource: the telemetry records a dashboard has not seen yet, from the live hub or the file.

In the process that runs the session it asks the live hub; elsewhere (a served page, a replay)
it reads the hub's append-only ``telemetry.jsonl`` from where it left off. A long run's history
is mostly device samples (one per worker process per second), which only the System section
and the memory alarm read. When a page opens on a history of more than ``BIG_HISTORY`` bytes,
everything else is parsed at once, so the curves show in a moment, and the device samples are
parsed in a background thread, a chunk at a time so the server's loop keeps answering; they are
handed over in a later poll, with the samples that arrived meanwhile. The thread starts at the
second poll, so that it does not hold the interpreter while the first one builds the page; a
served page holds it (``hold_polls``) until the browser has drawn the page, since parsing would
take the cores the browser and the server's first reply need.
"""
from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from hybridlab.telemetry.hub import find_hub, parse_lines, read_bytes

BIG_HISTORY = 8 * 2**20            # bytes
DEVICE = b'{"kind": "device"'      # how the hub starts a device sample's line
CHUNK = 20_000                     # lines parsed at a time in the background
SCAN_BLOCK = 4 * 2**20             # bytes searched for newlines at a time


class RecordSource:
    """New telemetry records since the last poll: from the live hub, else from the run's file."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.hub = find_hub(self.run_dir)
        self.offset = 0        # bytes of the run's file covered by what was read (hub or file)
        self.history: list[dict] | None = None  # the deferred device samples, once parsed
        self.loader: threading.Thread | None = None
        self.held: list[dict] = []   # device samples that arrived while the history was parsed
        self.hold_polls = 0          # polls the loader waits for besides the first (release_history ends it)

    @property
    def loading(self) -> bool:
        """True while the history's device samples are still being parsed."""
        return self.loader is not None

    def poll(self) -> list[dict]:
        """Return the records that arrived since the previous call (and, once parsed, the
        history's device samples)."""
        if self.loader is not None and self.loader.ident is None:
            if self.hold_polls > 0:
                self.hold_polls -= 1
            else:
                self.loader.start()  # after the first poll: its parsing would slow the first page down
        records = self._new()
        if self.loader is None:
            return records
        self.held += [r for r in records if r.get("kind") == "device"]
        records = [r for r in records if r.get("kind") != "device"]
        if self.history is not None:  # parsed: hand over the history, then what came meanwhile
            records = self.history + self.held + records
            self.loader, self.history, self.held = None, None, []
        return records

    def release_history(self) -> None:
        """Let the next poll start parsing the history's device samples (the page is drawn)."""
        self.hold_polls = 0

    def _new(self) -> list[dict]:
        if self.hub is not None:
            import ray
            from ray.exceptions import GetTimeoutError, RayActorError

            try:  # short wait: this runs on the page's event loop
                records, self.offset = ray.get(self.hub.since.remote(self.offset), timeout=1)
                return records
            except GetTimeoutError:
                return []
            except RayActorError:  # the run ended and its hub is gone: continue from the file
                self.hub = None
        first = self.offset == 0
        data, self.offset = read_bytes(self.run_dir, self.offset)
        if not first or self.offset < BIG_HISTORY:
            return parse_lines(data.splitlines())
        starts, ends = line_bounds(data)
        device = starts_with(data, starts, DEVICE)
        self.loader = threading.Thread(target=self._parse, args=(data, starts[device], ends[device]),
                                       name="telemetry-history", daemon=True)
        return parse_lines([data[a:b] for a, b in zip(starts[~device].tolist(), ends[~device].tolist())])

    def _parse(self, data: bytes, starts: np.ndarray, ends: np.ndarray) -> None:
        out: list[dict] = []
        try:
            for i in range(0, len(starts), CHUNK):
                chunk = zip(starts[i:i + CHUNK].tolist(), ends[i:i + CHUNK].tolist())
                out += parse_lines([data[a:b] for a, b in chunk])
        except Exception as exc:  # a damaged sample: the page goes on without the history's samples
            import logging

            logging.getLogger(__name__).warning("telemetry history of %s: device samples unreadable: %s",
                                                self.run_dir, exc)
            out = []
        self.history = out


def line_bounds(data: bytes) -> tuple[np.ndarray, np.ndarray]:
    """Return the start and end offsets of the lines of ``data`` (complete lines, each ending in a
    newline), found with numpy: a long history has hundreds of thousands."""
    raw = np.frombuffer(data, dtype=np.uint8)
    # in blocks: one comparison of the whole file would allocate (and page in) a mask as large as the
    # file, which took 0.3 s of a 156 MB history's first page against 0.07 s for all of this
    ends = np.concatenate([np.flatnonzero(raw[i:i + SCAN_BLOCK] == ord("\n")) + i
                           for i in range(0, len(raw), SCAN_BLOCK)] or [np.zeros(0, dtype=np.int64)])
    return np.concatenate(([0], ends[:-1] + 1))[:len(ends)], ends


def starts_with(data: bytes, starts: np.ndarray, prefix: bytes) -> np.ndarray:
    """Return which of the lines starting at ``starts`` begin with ``prefix``."""
    raw = np.frombuffer(data, dtype=np.uint8)
    if len(raw) < len(prefix):
        return np.zeros(len(starts), dtype=bool)
    windows = np.lib.stride_tricks.sliding_window_view(raw, len(prefix))  # a view: row i is raw[i:i + len]
    last = len(windows) - 1  # a line starting after it is shorter than the prefix
    heads = windows[np.minimum(starts, last)]
    return (heads == np.frombuffer(prefix, dtype=np.uint8)).all(axis=1) & (starts <= last)
