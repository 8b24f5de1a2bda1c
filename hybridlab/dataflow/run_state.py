"""RunState: what an RL run's steps read and write on the controller, as one value.

The session holds one (``rl.state``); a step's context, the training loop, recovery, remaps and
checkpoints read and change it. Checkpoints save it whole (``record``) and resume loads it whole
(``load``); the trainers' weights and the RNGs are saved beside it (dataflow/checkpoints.py).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

from hybridlab.algos.kl import AdaptiveKLController, FixedKLController
from hybridlab.dataflow.ahead import RolloutAhead
from hybridlab.dataflow.pairs import PairSource
from hybridlab.dataflow.prompts import PromptSource
from hybridlab.dataflow.stream import RolloutStream

HISTORY_STEPS = 1000  # the newest steps' metrics kept in memory (and in checkpoints)


@dataclasses.dataclass
class TrainProgress:
    """Where ``train()`` stands: the evaluation before the run and the latest one, the evaluation
    curve, and the run time (checkpoints carry it, so a resumed run goes on from it)."""

    before: dict
    last: dict
    curve: list[dict]
    seconds: float = 0.0   # the run time before this train() call (a resumed run's)
    started: float = dataclasses.field(default=0.0, compare=False)  # perf_counter() when the run's clock read 0

    def start_clock(self) -> None:
        """Start this train() call's clock where the run's time stands."""
        self.started = time.perf_counter() - self.seconds

    def elapsed(self) -> float:
        """Return the run time so far, in seconds (paused time excluded: see ``hold``)."""
        return time.perf_counter() - self.started

    def hold(self, seconds: float) -> None:
        """Leave ``seconds`` (held paused) out of the run time."""
        self.started += seconds

    def record(self) -> dict:
        """Return the progress as plain data (a checkpoint's ``session.json["train"]``)."""
        return {"before": self.before, "last": self.last, "curve": list(self.curve), "seconds": self.elapsed()}

    @classmethod
    def from_record(cls, train: dict) -> "TrainProgress | None":
        """Return the progress a checkpoint saved (None for one saved outside ``train()``)."""
        return cls(train["before"], train["last"], list(train["curve"]), train["seconds"]) if train else None


@dataclasses.dataclass
class RunState:
    """The run's counters, prompt stream, KL controller, off-policy queue, histories and error counts."""

    kl_ctrl: FixedKLController | AdaptiveKLController
    prompts: PromptSource | PairSource | None = None  # the training prompts (or pairs), once started
    step_count: int = 0
    actor_version: int = 0    # updates of the actor's weights: stages writing @actor_updated that changed them
    rollout_version: int = 0  # the actor_version the rollout engines hold (set by each sync)
    history: list[dict] = dataclasses.field(default_factory=list)  # the newest HISTORY_STEPS steps' metrics
    ahead: RolloutAhead = dataclasses.field(default_factory=RolloutAhead)  # off-policy rollouts submitted ahead
    stream: RolloutStream = dataclasses.field(default_factory=RolloutStream)  # streaming rollouts' buffer
    bad_updates: int = 0            # optimizer steps skipped for a NaN or inf, in all
    bad_steps_in_a_row: int = 0     # steps in a row with a skipped update (trainer.max_bad_updates)
    worker_restarts: int = 0        # dead or stuck workers re-created (trainer.max_restarts)
    restarts: list[dict] = dataclasses.field(default_factory=list)  # what each restart re-created and restored
    reward_error_sources: set[str] = dataclasses.field(default_factory=set)  # sources whose reward failures were warned about
    remaps: list = dataclasses.field(default_factory=list)  # RemapReports, in order
    train_progress: TrainProgress | None = None  # train()'s progress, restored from a checkpoint

    def add_step(self, metrics: dict) -> None:
        """Count a finished step and keep its metrics (the newest HISTORY_STEPS steps)."""
        self.step_count += 1
        self.history.append({"step": self.step_count, **metrics})
        del self.history[:-HISTORY_STEPS]  # bounded: metrics.jsonl keeps every step

    def count_bad_updates(self, bad: int) -> None:
        """Count a step's updates skipped for a NaN or inf (and the steps in a row that had some)."""
        self.bad_updates += bad
        self.bad_steps_in_a_row = self.bad_steps_in_a_row + 1 if bad else 0

    def prompt_position(self) -> tuple[dict, list[int]]:
        """Return the prompt stream's position before the prompts generated ahead or streamed but
        not trained yet, and the uids after it that were trained (what a checkpoint saves and a
        retried step goes back to: those prompts are generated again, the trained ones skipped)."""
        first = self.ahead.first_uid()
        if first is None:
            first = self.stream.oldest(self.prompts)
        if first is None:
            return self.prompts.state(), sorted(self.prompts.skip)
        return self.prompts.state_before(first), self.stream.consumed_since(first, self.prompts)

    def record(self, train: TrainProgress | None) -> dict[str, Any]:
        """Return the state a checkpoint saves (its ``session.json`` fields), with ``train()``'s progress."""
        position, skip = self.prompt_position()
        return {"step": self.step_count, "actor_version": self.actor_version, "prompts": position,
                "stream_skip": skip, "regenerated_prompts": self.ahead.regenerated + self.stream.regenerated,
                "kl_ctrl": dict(vars(self.kl_ctrl)), "history": self.history,
                "faults": {"bad_updates": self.bad_updates, "bad_steps_in_a_row": self.bad_steps_in_a_row,
                           "worker_restarts": self.worker_restarts},
                "train": train.record() if train else {}}

    def load(self, record: dict[str, Any]) -> None:
        """Take the state a checkpoint saved (``record``: its ``session.json``), as ``record`` wrote it
        or as earlier versions did; ``train_progress`` is the resume's to set (a rollback keeps the loop's)."""
        self.step_count = record["step"]
        # a checkpoint from before versions were saved has one per step (off by the steps whose
        # every update was skipped); the resume's sync gives it to the rollout
        self.actor_version = record.get("actor_version", record["step"])
        self.history = record["history"]
        self.prompts.set_state(record["prompts"])
        self.bad_updates = record["faults"]["bad_updates"]
        self.bad_steps_in_a_row = record["faults"]["bad_steps_in_a_row"]
        self.worker_restarts = record["faults"].get("worker_restarts", 0)
        self.ahead.regenerated = record.get("regenerated_prompts", 0)
        self.prompts.skip = set(record.get("stream_skip", []))
        vars(self.kl_ctrl).update(record["kl_ctrl"])
