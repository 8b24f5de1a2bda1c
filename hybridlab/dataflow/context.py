"""What a running step sees (StepContext) and a training run in a background thread (BackgroundRun)."""
from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from hybridlab.dataflow.graph import Dataflow, DataflowError, merge
from hybridlab.dataflow.stages import get_stage
from hybridlab.faults import kill_processes, worker_kill
from hybridlab.protocol import Batch

if TYPE_CHECKING:
    from hybridlab.dataflow.session import RLSession


class StepContext:
    """What stage functions see: the config, the worker groups and a few shared services."""

    def __init__(self, rl: "RLSession"):
        self.rl = rl
        self.cfg = rl.cfg
        self.kl_ctrl = rl.kl_ctrl
        self.warnings: list[str] = []
        self.rerunning = False   # inside rerun_rollout: generate now, never from the look-ahead
        self.actor_unchanged = False  # the actor update changed nothing (every update skipped for NaN/inf, or none)
        self.started: list = []       # the stages started so far (recovery: did an update begin?)

    def stage_starting(self, stage) -> None:
        """Called as each stage starts: records it, and kills workers where HYBRIDLAB_FAULT says."""
        self.started.append(stage)
        step = self.rl.step_count + 1
        for role in worker_kill(stage.name, step):
            kill_processes([p["pid"] for p in self.group(role).placements],
                           f"{role} as stage {stage.name} of step {step} starts")

    def stage_finished(self, stage) -> None:
        """Called as each stage ends: a stage that updates the actor (``@actor_updated``) and
        changed its weights advances the session's ``actor_version``."""
        if "@actor_updated" in stage.outputs(self.cfg) and not self.actor_unchanged:
            self.rl.actor_version += 1

    @property
    def timeline(self):
        """The session's Timeline (stages stamp their worker calls on it)."""
        return self.rl.workers.timeline

    def group(self, role: str):
        """Return the WorkerGroup of ``role``."""
        return self.rl.workers.groups[role]

    def sampling(self, **overrides) -> dict:
        """Return the rollout sampling settings (with ``overrides``) as a dict."""
        r = self.cfg.rollout
        params = {"n": r.n, "temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k,
                  "max_tokens": r.max_new_tokens, "ignore_eos": r.ignore_eos, "seed": self.cfg.trainer.seed + self.rl.step_count}
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
            batch, _ = Dataflow(stages).run(self, self.rl.prompts.next())
        finally:
            self.rerunning = False
        return batch

    def sync(self):
        """Copy the actor's weights into the rollout engines; returns the SyncReport."""
        return self.rl.sync_weights()


def run_stage(rl: "RLSession", name: str, batch: Batch) -> Batch:
    """Run the registered stage ``name`` on ``batch`` as a step would; returns the batch with
    what the stage added (its metrics under ``meta["metrics"][name]``). Raises DataflowError
    naming the fields the stage needs that ``batch`` lacks, or the role the mapping lacks."""
    stage = get_stage(name)
    missing = [f for f in stage.inputs(rl.cfg) if not f.startswith("@") and f not in batch]
    if missing:
        have = ", ".join([*batch.tensors, *batch.objects]) or "nothing"
        raise DataflowError(f"stage {name!r} needs the field(s) {', '.join(missing)}, which the batch does not"
                            f" have (it has: {have}); run the stages that make them first")
    for role in filter(None, (stage.role, *stage.needs)):
        if role not in rl.mapping.roles:
            raise DataflowError(f"stage {name!r} runs on role {role!r}, which the device mapping does not have"
                                f" (roles: {', '.join(rl.mapping.roles)})")
    ctx = StepContext(rl)
    ctx.rerunning = True  # generate now, on these prompts (never the off-policy look-ahead)
    new, metrics = stage.fn(ctx, batch)
    ctx.stage_finished(stage)
    out = merge(batch, new, stage.replaces_rows)
    out.meta = {**out.meta, "metrics": {**batch.meta.get("metrics", {}), name: metrics}}
    return out


class BackgroundRun:
    """``RLSession.train`` running in a thread; the kernel stays free while it runs."""

    def __init__(self, rl: "RLSession", steps: int | None):
        import threading

        self.rl, self.summary, self.error = rl, None, None
        self._thread = threading.Thread(target=self._run, args=(steps,), name="hybridlab-train", daemon=True)
        self._thread.start()

    def _run(self, steps: int | None) -> None:
        try:
            self.summary = self.rl.train(steps)
        except BaseException as exc:  # kept for wait() to re-raise in the kernel's thread
            self.error = exc

    def done(self) -> bool:
        """Return True once training has finished (or failed)."""
        return not self._thread.is_alive()

    def stop(self) -> None:
        """Ask the run to stop after the current step (it still evaluates and writes its summary)."""
        self.rl.request_stop()

    def wait(self, timeout: float | None = None) -> dict | None:
        """Wait for the run to end; returns its summary (re-raises its error), or None if it is
        still running after ``timeout`` seconds."""
        self._thread.join(timeout)
        if self.error is not None:
            raise self.error
        return self.summary

    def __repr__(self) -> str:
        state = "done" if self.done() else f"running, step {self.rl.step_count}"
        return f"BackgroundRun({state})"
