"""RunTelemetry: the controller's side of a run's telemetry, in one place.

It owns the run's hub actor (started before the warm start, so workers can send it device
samples), streams the controller's call spans to it, runs the LiveReporter (calls in flight,
the page's run controls) and stops the inline dashboards it handed out. Without ``trainer.telemetry``
nothing is started and ``emit`` does nothing.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Callable

from hybridlab.telemetry.dashboard import build_dashboard
from hybridlab.telemetry.hub import ENV_HUB, hub_name, start_hub
from hybridlab.telemetry.live import LiveReporter


class RunTelemetry:
    """See the module docstring; ``hub`` is the actor handle once ``start`` ran, else None."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.hub = None
        self.reporter = None
        self.dashboards: list = []

    def start(self, env: dict, run_record: dict) -> None:
        """Start the hub, name it in ``env`` (the workers' environment) and send ``run_record``."""
        self.hub = start_hub(self.run_dir)
        env[ENV_HUB] = hub_name(self.run_dir)
        self.emit("run", run_record)

    def watch(self, session, actions: dict[str, Callable], paused: Callable[[], bool] | None = None) -> None:
        """Send every call span of the controller ``session`` to the hub and start reporting its
        calls in flight; ``actions`` carry out the dashboard's run controls (``live.ACTIONS``:
        pause, resume, stop, stacks), ``paused()`` says whether the run is paused."""
        if self.hub is None:
            return

        session.timeline.subscribe(lambda spans: self.hub.add.remote("span", [dataclasses.asdict(s) for s in spans]))
        warm = session.warm  # the kernel's warm pool: its memory on the System section
        self.reporter = LiveReporter(self.run_dir, session.watch.running, actions, self.emit, paused=paused,
                                     samples=warm.samples if warm is not None else None).start()

    def emit(self, kind: str, record: dict) -> None:
        """Send one record of ``kind`` to the hub, stamped with the time (no-op without a hub)."""
        if self.hub is not None:
            self.hub.add.remote(kind, [{"time": time.time(), **record}])

    def flush(self) -> None:
        """Wait until every record this process has sent is in the telemetry file (``emit``
        does not wait; the hub writes one process's records in the order sent)."""
        if self.hub is not None:
            import ray

            ray.get(self.hub.size.remote())

    def mark_checkpoint(self, step: int) -> int | None:
        """Mark a checkpoint in the telemetry file; returns the file's size after the mark."""
        if self.hub is None:
            return None
        import ray

        return ray.get(self.hub.add.remote("checkpoint", [{"step": step, "time": time.time()}]))

    def dashboard(self):
        """Return the live dashboard layout of the run; its poller stops with ``stop_watching``."""
        layout = build_dashboard(self.run_dir)
        self.dashboards.append(layout.dashboard)
        return layout

    def stop_watching(self) -> None:
        """Stop the reporter and the inline dashboards' pollers (before the workers go)."""
        if self.reporter is not None:
            self.reporter.stop()
            self.reporter = None
        for board in self.dashboards:
            board.stop()
        self.dashboards.clear()

    def close(self) -> None:
        """Flush and stop the hub (the telemetry file stays)."""
        if self.hub is not None:
            import ray

            ray.get(self.hub.close.remote())  # everything sent so far is on disk
            ray.kill(self.hub)
            self.hub = None
