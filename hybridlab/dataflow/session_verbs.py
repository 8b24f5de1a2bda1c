"""SessionVerbs: what the notebook widgets and the mapping advisor use of a running session.

``RLSession`` (dataflow/session.py) is one; the widgets and the advisor are typed against this
protocol, so they import nothing above them while the session builds them on demand
(``rl.controls()``, ``rl.suggest_mapping()``...).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Protocol

from hybridlab.config import RunConfig
from hybridlab.controller.mapping import DeviceMapping
from hybridlab.controller.worker_set import WorkerSet
from hybridlab.dataflow.graph import Dataflow, StepResult
from hybridlab.dataflow.run_state import RunState


class SessionVerbs(Protocol):
    """A running RL session as its notebook widgets and the mapping advisor see it."""

    cfg: RunConfig
    state: RunState
    mapping: DeviceMapping
    workers: WorkerSet | None
    model_dir: Path
    run_dir: Path
    tokenizer: Any
    background: Any            # the latest start_background() run (done(), stop(), wait())
    broken: str | None         # why the session cannot step (a change failed halfway)
    step_callbacks: list[Callable[[StepResult], None]]

    @property
    def dataflow(self) -> Dataflow:
        """The stages each step runs."""

    @property
    def paused(self) -> bool:
        """True between pause() and unpause()."""

    @property
    def held(self) -> bool:
        """True while a paused run waits at a step boundary."""

    def step(self) -> StepResult:
        """Run one step; returns its result."""

    def start_background(self, steps: int | None = None) -> Any:
        """Train in a thread; returns its handle."""

    def pause(self) -> None:
        """Hold a running train() at its next step boundary."""

    def unpause(self) -> None:
        """Let a paused run go on."""

    def wait_until_held(self, timeout: float | None = None) -> bool:
        """Wait until a paused run is held; returns whether it is."""

    def update(self, *overrides: str) -> RunConfig:
        """Apply key=value settings between steps; returns the new config."""

    def check_update(self, *overrides: str) -> list[str]:
        """Validate an update; returns the stages it would run."""

    def remap(self, mapping: DeviceMapping | dict | str) -> Any:
        """Move onto another device mapping; returns the RemapReport."""

    def check_remap(self, mapping: DeviceMapping | dict | str) -> None:
        """Validate a remap (raises on every problem)."""

    def suggest_mapping(self, profile: Any = None) -> Any:
        """Returns the mapping advisor's Suggestion."""
