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
    def dataflow(self) -> Dataflow: ...

    @property
    def paused(self) -> bool: ...

    @property
    def held(self) -> bool: ...

    def step(self) -> StepResult: ...

    def start_background(self, steps: int | None = None) -> Any: ...

    def pause(self) -> None: ...

    def unpause(self) -> None: ...

    def wait_until_held(self, timeout: float | None = None) -> bool: ...

    def update(self, *overrides: str) -> RunConfig: ...

    def check_update(self, *overrides: str) -> list[str]: ...

    def remap(self, mapping: DeviceMapping | dict | str) -> Any: ...

    def check_remap(self, mapping: DeviceMapping | dict | str) -> None: ...

    def suggest_mapping(self, profile: Any = None) -> Any: ...
