"""A step that survives a dead or stuck worker: re-create it, restore state, run the step again.

    try the step
    a worker died (its process is gone) or got stuck (past its call deadline; stacks written):
        count it (faults/worker_restarts); past trainer.max_restarts: stop with WorkerLost
        re-create the processes of every dead role, with the roles colocated with them, on the
        same placement (same pool, same devices)
        a trainer (actor, critic) lost its process, or the step had already started an update:
            roll the run back to its latest checkpoint, in memory: trainer weights and moments,
            step, RNG, prompt stream, KL controller; metrics.jsonl is cut back to it; the
            steps since are run again (with the same numbers: the run stays seeded)
        else (rollout, ref or reward only, before any update):
            the step's prompts, RNG and KL controller go back to the step's start, the new
            rollout engines get the actor's weights
        run the step again

Any other failure (a bug, a bad setting) is raised as before.
"""
from __future__ import annotations

import dataclasses
import random
import sys
import time
from typing import TYPE_CHECKING, Callable, TypeVar

import numpy as np
import torch

from hybridlab.controller.calls import WorkerError
from hybridlab.controller.worker_set import WorkerSet
from hybridlab.dataflow import checkpoints
from hybridlab.dataflow.context import StepContext
from hybridlab.dataflow.run_state import RunState
from hybridlab.telemetry.metrics import MetricsLog

if TYPE_CHECKING:
    from hybridlab.dataflow.session import RLSession

T = TypeVar("T")
STATEFUL = ("actor", "critic")
UPDATES = {"@actor_updated", "@critic_updated"}   # outputs of the stages that change trainer state


class WorkerLost(RuntimeError):
    """Workers died or got stuck more often than ``trainer.max_restarts`` allows; names the last
    one. ``can_save``: the trainers still hold the state after the last finished step."""

    def __init__(self, message: str, can_save: bool):
        super().__init__(message)
        self.can_save = can_save


@dataclasses.dataclass
class StepStart:
    """What a step consumes on the controller, as it was when the step began."""

    prompts: dict
    rng: tuple
    kl: dict
    skip: list  # streaming: uids after the position that were trained already


def step_start(state: RunState) -> StepStart:
    """Return the controller state a retried step must start from."""
    position, skip = state.prompt_position()
    return StepStart(position, (random.getstate(), np.random.get_state(), torch.get_rng_state()),
                     dict(vars(state.kl_ctrl)), skip)


def back_to(state: RunState, start: StepStart) -> None:
    """Put the run's prompt stream, KL controller and the controller's RNGs back to ``start``."""
    state.prompts.set_state(start.prompts)
    state.prompts.skip = set(start.skip)
    random.setstate(start.rng[0])
    np.random.set_state(start.rng[1])
    torch.set_rng_state(start.rng[2])
    vars(state.kl_ctrl).update(start.kl)


def worker_failure(exc: BaseException) -> WorkerError | None:
    """Return the WorkerError behind ``exc`` (a StageError wraps it), or None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, WorkerError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def with_recovery(rl: "RLSession", attempt: Callable[["StepContext"], T]) -> T:
    """Return ``attempt(ctx)`` (a step, an evaluation) with a fresh StepContext, re-creating
    dead or stuck workers and trying again as the module docstring says."""
    while True:
        start = step_start(rl.state)
        ctx = rl.context()
        try:
            return attempt(ctx)
        except Exception as exc:
            err = worker_failure(exc)
            if err is None:
                raise
            dead = lost_roles(rl.workers, err)
            if not dead:  # the method itself raised: a bug or a bad setting, not a lost worker
                raise
            recover(rl, err, dead, ctx, start)


def lost_roles(workers: WorkerSet, err: WorkerError) -> set[str]:
    """Return the roles whose processes are gone or stuck, with their colocated roles. A method
    that raised counts only if its own processes no longer answer (a peer rank died under it);
    after a death, the other process sets are asked too (a node may have gone)."""
    own = set(workers.colocated(err.role))
    if err.kind not in ("died", "stuck"):
        return own if workers.dead_roles(only=own) else set()
    return own | workers.dead_roles(timeout=30.0, exclude=own)


def refuse_lost_nodes(workers: WorkerSet, dead: set[str], what: str, can_save: bool, wait_s: float = 60.0) -> None:
    """Raise WorkerLost, naming the node, when the ``dead`` roles' node is gone and no other node
    can hold their pool: none carries its ``node_labels``, or Ray cannot re-place its bundles
    within ``wait_s``. Returns at once when their nodes are alive."""
    import ray

    alive = {n["NodeID"]: n for n in ray.nodes() if n.get("Alive")}
    for pool, members in workers.mapping.process_sets():
        if not set(members) & dead:
            continue
        lost = {p["node_id"]: p.get("ip", "?") for p in workers.groups[members[0]].placements
                if p["node_id"] not in alive}
        if not lost:
            continue
        gone = ", ".join(f"{ip} (node {node[:12]})" for node, ip in lost.items())
        labels = workers.mapping.pools[pool].node_labels
        if labels and not any(all((n.get("Labels") or {}).get(k) == v for k, v in labels.items())
                              for n in alive.values()):
            raise WorkerLost(f"{what}: node {gone} is gone, and no other node carries pools.{pool}.node_labels"
                             f" {labels}; the run stops", can_save=can_save) from None
        try:
            ray.get(workers.pools[pool].pg.ready(), timeout=wait_s)
        except ray.exceptions.GetTimeoutError:
            raise WorkerLost(f"{what}: node {gone} is gone, and Ray could not place pool {pool!r} on the other"
                             f" nodes within {wait_s:.0f} s (too few free devices); the run stops",
                             can_save=can_save) from None


def recover(rl: "RLSession", err: WorkerError, dead: set[str], ctx: "StepContext", start: StepStart) -> None:
    """Re-create the ``dead`` roles and restore what the failed step changed; raises WorkerLost
    past ``trainer.max_restarts``."""
    touched = any(set(s.outputs(rl.cfg)) & UPDATES for s in ctx.started)
    rollback = touched or bool(dead & set(STATEFUL))
    what = f"worker {err.role} rank {err.rank} {err.kind} in {err.method}"
    if rl.state.worker_restarts >= rl.cfg.trainer.max_restarts:
        raise WorkerLost(f"{what} during step {rl.state.step_count + 1}, after {rl.state.worker_restarts} restart(s) already"
                         f" (trainer.max_restarts={rl.cfg.trainer.max_restarts}); the run stops",
                         can_save=not rollback) from None
    ckpt = checkpoints.checkpoint_dirs(rl.run_dir)[-1] if rollback and checkpoints.checkpoint_dirs(rl.run_dir) else None
    if rollback and ckpt is None:
        raise WorkerLost(f"{what} during step {rl.state.step_count + 1}, and the trainers' state is lost with no"
                         " checkpoint to go back to (train() writes one at its start; call save_checkpoint()"
                         " when stepping by hand)", can_save=False) from None
    refuse_lost_nodes(rl.workers, dead, what, can_save=not rollback)
    rl.state.worker_restarts += 1
    t0 = time.perf_counter()
    print(f"{what}; re-creating {', '.join(sorted(dead))} (restart {rl.state.worker_restarts} of at most"
          f" {rl.cfg.trainer.max_restarts})", file=sys.stderr, flush=True)
    rl.state.ahead.forget(rl.state.prompts)  # its workers may be gone: its prompts are drawn and generated again
    rl.state.stream.forget(rl.state.prompts, read=False)  # the same for streamed prompts not trained yet
    if rl.cfg.trainer.streaming and "rollout" not in dead:  # a live engine would go on with them
        rl.workers.groups["rollout"].stream_close()
    for pool_roles in {rl.workers.colocated(r) for r in dead}:
        rl.workers.recreate(pool_roles[0], close_timeout=2.0)
    if rollback:
        rl.log.close()
        record = checkpoints.prepare_logs(rl.run_dir, ckpt, telemetry=False)

        rl.log = MetricsLog(rl.run_dir, "tensorboard" in rl.cfg.trainer.logger, purge_after=record["step"])
        rl.trackers.rewind(record["step"])
        restarts = rl.state.worker_restarts  # restarts count for the whole run, rolled back or not
        checkpoints.restore(rl.workers, rl.state, ckpt, record)
        if "actor" in rl.workers.groups and "rollout" in rl.workers.groups:
            rl.sync_weights(reason="resume")
        rl.state.worker_restarts = restarts
    else:
        back_to(rl.state, start)
        if "rollout" in dead and "actor" in rl.workers.groups:
            rl.sync_weights(reason="restart")
    event = {"step": rl.state.step_count, "role": err.role, "rank": err.rank, "method": err.method, "failure": err.kind,
             "recreated": sorted(dead), "rolled_back_to": rl.state.step_count if rollback else None,
             "restarts": rl.state.worker_restarts, "seconds": round(time.perf_counter() - t0, 3)}
    rl.state.restarts.append(event)
    rl.emit("restart", event)
