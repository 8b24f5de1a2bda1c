"""What a running step sees: StepContext."""
from __future__ import annotations

import warnings
from typing import Any, Callable

from hybridlab.config import RunConfig
from hybridlab.controller.worker_set import WorkerSet
from hybridlab.dataflow.graph import Dataflow
from hybridlab.dataflow.run_state import RunState
from hybridlab.dataflow.stages import get_stage
from hybridlab.faults import kill_processes, worker_kill
from hybridlab.protocol import Batch


class StepContext:
    """What stage functions see: the config, the worker groups, the sampling settings, the run's
    state, the step's warnings and the weight sync; nothing else of the session."""

    def __init__(self, cfg: RunConfig, workers: WorkerSet, state: RunState, stages: list[str],
                 sync: Callable[[], Any]):
        self.cfg = cfg
        self.workers = workers     # the worker groups per the device mapping (controller/worker_set.py)
        self.state = state         # the run's counters, prompt stream, KL controller, rollouts ahead
        self.stages = stages       # the names of the dataflow this step runs
        self._sync = sync          # the session's sync_weights: the actor's weights into the rollout engines
        self.warnings: list[str] = []
        self.rerunning = False   # inside rerun_rollout: generate now, never from the look-ahead
        self.actor_unchanged = False  # the actor update changed nothing (every update skipped for NaN/inf, or none)
        self.started: list = []       # the stages started so far (recovery: did an update begin?)

    def stage_starting(self, stage) -> None:
        """Called as each stage starts: records it, and kills workers where HYBRIDLAB_FAULT says."""
        self.started.append(stage)
        step = self.state.step_count + 1
        for role in worker_kill(stage.name, step):
            kill_processes([p["pid"] for p in self.group(role).placements],
                           f"{role} as stage {stage.name} of step {step} starts")

    def stage_finished(self, stage) -> None:
        """Called as each stage ends: a stage that updates the actor (``@actor_updated``) and
        changed its weights advances the run's ``actor_version``."""
        if "@actor_updated" in stage.outputs(self.cfg) and not self.actor_unchanged:
            self.state.actor_version += 1

    @property
    def timeline(self):
        """The workers' Timeline (stages stamp their worker calls on it)."""
        return self.workers.timeline

    def group(self, role: str):
        """Return the WorkerGroup of ``role``."""
        return self.workers.groups[role]

    def sampling(self, **overrides) -> dict:
        """Return the rollout sampling settings (with ``overrides``) as a dict."""
        r = self.cfg.rollout
        params = {"n": r.n, "temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k,
                  "max_tokens": r.max_new_tokens, "ignore_eos": r.ignore_eos,
                  "seed": self.cfg.trainer.seed + self.state.step_count}
        params.update(overrides)
        return params

    def warn(self, message: str) -> None:
        """Record a warning for this step's metrics and show it once."""
        self.warnings.append(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)

    def rerun_rollout(self, stages: list[str]) -> Batch:
        """Run ``stages`` (e.g. generate, reward) on fresh prompts; returns their batch. Their
        generation is on-policy and immediate even in off-policy mode (the look-ahead rollout
        belongs to the next step)."""
        self.rerunning = True
        try:
            batch, _ = Dataflow(stages).run(self, self.state.prompts.next())
        finally:
            self.rerunning = False
        return batch

    def scoring_stages(self) -> list[str]:
        """Return the stages of this step's dataflow that make its scored samples (what
        filter_groups runs again): those before filter_groups, or (a stage run by hand) those up
        to the first that writes scores."""
        names = self.stages
        if "filter_groups" in names:
            return names[:names.index("filter_groups")]
        return names[:1 + next(i for i, n in enumerate(names) if "token_level_scores" in get_stage(n).outputs(self.cfg))]

    def sync(self):
        """Copy the actor's weights into the rollout engines; returns the SyncReport."""
        return self._sync()
