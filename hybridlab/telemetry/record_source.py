"""RecordSource: the telemetry records a dashboard has not seen yet, from the live hub or the file.

In the process that runs the session it asks the live hub; elsewhere (a served page, a replay)
it reads the hub's append-only ``telemetry.jsonl`` from where it left off. A long run's history
is mostly device samples (one per worker process per second), which only the System section
and the memory alarm read. When a page opens on a history of more than ``BIG_HISTORY`` bytes,
everything else is parsed at once, so the curves show in a moment, and the device samples are
parsed in a background thread, a chunk at a time so the server's loop keeps answering; they are
handed over in a later poll, with the samples that arrived meanwhile. The thread starts at the
second poll, so that it does not hold the interpreter while the first one builds the page.
"""
from __future__ import annotations

import threading
from pathlib import Path

from hybridlab.telemetry.hub import find_hub, parse_lines, read_lines

BIG_HISTORY = 8 * 2**20            # bytes
DEVICE = b'{"kind": "device"'      # how the hub starts a device sample's line
CHUNK = 20_000                     # lines parsed at a time in the background


class RecordSource:
    """New telemetry records since the last poll: from the live hub, else from the run's file."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.hub = find_hub(self.run_dir)
        self.offset = 0        # bytes of the run's file covered by what was read (hub or file)
        self.history: list[dict] | None = None  # the deferred device samples, once parsed
        self.loader: threading.Thread | None = None
        self.held: list[dict] = []   # device samples that arrived while the history was parsed

    @property
    def loading(self) -> bool:
        """True while the history's device samples are still being parsed."""
        return self.loader is not None

    def poll(self) -> list[dict]:
        """Return the records that arrived since the previous call (and, once parsed, the
        history's device samples)."""
        if self.loader is not None and self.loader.ident is None:
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
        lines, self.offset = read_lines(self.run_dir, self.offset)
        if not first or self.offset < BIG_HISTORY:
            return parse_lines(lines)
        samples, rest = [], []
        for line in lines:
            (samples if line.startswith(DEVICE) else rest).append(line)
        self.loader = threading.Thread(target=self._parse, args=(samples,), name="telemetry-history", daemon=True)
        return parse_lines(rest)  # the loader starts at the next poll

    def _parse(self, lines: list[bytes]) -> None:
        out: list[dict] = []
        try:
            for i in range(0, len(lines), CHUNK):
                out += parse_lines(lines[i:i + CHUNK])
        except Exception as exc:  # a damaged sample: the page goes on without the history's samples
            import logging

            logging.getLogger(__name__).warning("telemetry history of %s: device samples unreadable: %s",
                                                self.run_dir, exc)
            out = []
        self.history = out
