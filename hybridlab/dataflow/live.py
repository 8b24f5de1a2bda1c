"""Live edits of a running session, as part of RLSession (a mixin; the state they use is set
up in session.py): a new dataflow, ``update`` (settings), ``remap`` (device mapping), and the
step boundary they wait for, which ``pause`` also holds a training run at.

Every edit is validated first, then applied between steps (dataflow/edits.py: during a
background run at the next step boundary; the caller waits for it); what it changes is worked
out and applied in dataflow/remap.py.
"""
from __future__ import annotations

import dataclasses
import threading

from hybridlab.algos.kl import get_kl_controller
from hybridlab.config import ConfigError, RunConfig
from hybridlab.controller.mapping import DeviceMapping
from hybridlab.dataflow import remap as changes  # what an edit changes, and applying it
from hybridlab.dataflow.agent_stages import agentic
from hybridlab.dataflow.context import StepContext
from hybridlab.dataflow.graph import Dataflow, DataflowError, merge
from hybridlab.dataflow.stages import get_stage
from hybridlab.dataflow.pairs import step_inputs
from hybridlab.dataflow.remap_checks import parse_mapping
from hybridlab.protocol import Batch


class LiveEdits:
    """RLSession's edits between steps and its pause / stop controls."""

    @property
    def dataflow(self) -> Dataflow:
        """The stages each step runs; assign a new Dataflow (or list of names) between steps."""
        return self._dataflow

    @dataflow.setter
    def dataflow(self, value: Dataflow | list) -> None:
        flow = value if isinstance(value, Dataflow) else Dataflow(value)
        flow.validate(self.cfg, self.mapping.roles, step_inputs(self.cfg))

        def assign() -> None:
            flow.validate(self.cfg, self.mapping.roles, step_inputs(self.cfg))  # against the config it now meets
            self._dataflow = flow
            self.cfg = dataclasses.replace(self.cfg, dataflow=flow.names)
            self.state.ahead.drop(self.state.prompts)

        self.boundary.run(assign)

    def update(self, *overrides: str) -> RunConfig:
        """Change settings with ``key=value`` overrides (e.g. ``"algorithm.adv_estimator=rloo"``,
        ``"actor.lr=5e-5"``, ``"mapping={...}"``); returns the new config once applied.

        Everything is validated first. Settings the running workers take (learning rate,
        clipping, micro-batch size, temperature...) are applied to them; settings built into a
        role (rollout.kv_cache_mb, rollout.dtype, rollout.prefix_caching, reward.*) re-create that
        role, and a new mapping remaps, both with the trainers' state carried in memory. Only what would make it another run (the
        model, the data, the warm start, the seed) is refused, with the reason. Applied between
        steps: during a background run, at the next step boundary (this call waits for it).
        ``trainer.steps`` applies to the next ``train()``; ``max_minutes`` and ``eval_every``
        also to a running one."""
        change = changes.prepare_update(self, overrides)  # every error now, before waiting for a boundary
        if self.workers is None:  # not started: nothing runs yet
            changes.apply_change(self, change)
        else:  # prepared again at the boundary, on the config as it is then
            self.boundary.run(lambda: changes.apply_change(self, changes.prepare_update(self, overrides)))
        return self.cfg

    def remap(self, mapping: DeviceMapping | dict | str):
        """Move the running session onto ``mapping`` (a DeviceMapping, a dict or YAML text):
        re-creates only the roles whose placement changed, carries the trainers' weights, AdamW
        moments, schedule position and RNG in memory, and resyncs the rollout. Refused before
        anything is torn down if the mapping cannot run (the session keeps its old one).
        Applied between steps (during a background run at the next step boundary; this call
        waits for it); returns the RemapReport."""
        new_mapping = parse_mapping(mapping)
        if self.workers is None:
            raise ConfigError("remap needs a started session (call start() first, or give the mapping in the"
                              " config: mapping=...)")
        changes.prepare_remap(self, new_mapping)
        return self.boundary.run(lambda: changes.apply_change(self, changes.prepare_remap(self, new_mapping)))

    def check_update(self, *overrides: str) -> list[str]:
        """Validate ``key=value`` overrides as ``update`` would, without applying them; returns the
        stages the step would then run (raises ConfigError or DataflowError naming what is wrong)."""
        return changes.prepare_update(self, overrides).flow.names

    def check_remap(self, mapping: DeviceMapping | dict | str) -> None:
        """Validate ``mapping`` as ``remap`` would, without applying it (raises MappingError or
        ConfigError listing every reason it cannot run in this session)."""
        changes.prepare_remap(self, parse_mapping(mapping))

    def remap_later(self, mapping: DeviceMapping | dict | str) -> None:
        """Check ``mapping`` now (a refusal raises here) and remap onto it in a thread of its own,
        at the next step boundary of a run: the dashboard's "Remap to the proposal" (its JSON is YAML
        text, as ``remap`` takes); a failure during the remap is sent as a ``control`` record."""
        new_mapping = parse_mapping(mapping)
        changes.prepare_remap(self, new_mapping)

        def remap() -> None:
            try:
                self.remap(new_mapping)
            except Exception as exc:  # refused at the boundary, or failed: say so on the page
                self.emit("control", {"action": "remap", "ok": False, "error": str(exc) or repr(exc)})

        threading.Thread(target=remap, name="remap-from-page", daemon=True).start()

    def apply_config(self, new: RunConfig, flow: Dataflow, configure: dict[str, dict]) -> None:
        """Apply a validated config between steps (dataflow/remap.py prepares it): the roles' live
        settings (``configure``: role -> settings), the KL controller, the dataflow."""
        for role, settings in configure.items():
            self.workers.groups[role].configure(**settings)
        if new.algorithm.kl_ctrl != self.cfg.algorithm.kl_ctrl:
            self.state.kl_ctrl = get_kl_controller(new.algorithm.kl_ctrl)
        if (new.trainer.off_policy, new.trainer.max_staleness, new.rollout, new.trainer.streaming) != \
                (self.cfg.trainer.off_policy, self.cfg.trainer.max_staleness, self.cfg.rollout, self.cfg.trainer.streaming):
            self.state.ahead.drop(self.state.prompts)
        # agent trajectories run with the settings their stream started with: a change starts them again
        agents_changed = agentic(new) and new.rollout != self.cfg.rollout
        if self.cfg.trainer.streaming and (not new.trainer.streaming or agents_changed) and self.workers is not None:
            self.workers.groups["rollout"].stream_close()  # the prompts not trained yet are drawn again
            self.state.stream.forget(self.state.prompts)
        if self.workers is not None and new.trainer.spare_processes != self.cfg.trainer.spare_processes:
            self.workers.set_spares(new.trainer.spare_processes)
        self.cfg, self._dataflow = new, flow

    def next_prompts(self) -> Batch:
        """Return the next step's prompts from the prompt stream (the stream moves on)."""
        self._refuse_while_stepping("next_prompts")
        with self.boundary.lock:
            return self.state.prompts.next()

    def run_stage(self, name: str, batch: Batch) -> Batch:
        """Run one registered stage by hand between steps; returns ``batch`` with what the stage
        added, its metrics in ``meta["metrics"]``. Refused while a background run is stepping."""
        self._refuse_while_stepping("run_stage")
        with self.boundary.step():
            return run_stage(self.context(), name, batch)

    def _refuse_while_stepping(self, what: str) -> None:
        if self.training and not self.held:
            raise RuntimeError(f"{what} runs between steps, but a training run is stepping: pause() it (and wait"
                               " until it is held) or stop it first")

    def request_stop(self) -> None:
        """Ask the running (or the next) ``train()`` to stop after its current step (a paused
        one at once); it still evaluates and writes its summary."""
        self.stop_requested = True
        self.boundary.resume()

    def stop_running(self) -> None:
        """Stop the running ``train()`` after its current step (the dashboard's Stop); unlike
        ``request_stop`` it raises RuntimeError when no training loop runs, rather than stopping
        the next one."""
        if not self.training:
            raise RuntimeError("no run to stop: no train() or start_background() run is going")
        self.request_stop()

    def pause(self) -> None:
        """Hold the running ``train()`` (a background run) at its next step boundary (the step
        under way finishes); ``update``, ``remap``, ``step`` and ``run_stage`` work while it is
        held; ``unpause()`` goes on. Raises RuntimeError when no training loop runs."""
        if not self.training:
            raise RuntimeError("no run to pause: pause() holds a running train() or start_background() run"
                               " at its next step boundary")
        self.boundary.pause()

    def unpause(self) -> None:
        """Let a paused run go on (``RLSession.resume`` is another thing: a run from a checkpoint)."""
        self.boundary.resume()

    @property
    def paused(self) -> bool:
        """True between ``pause()`` and ``unpause()``."""
        return self.boundary.paused

    @property
    def held(self) -> bool:
        """True while a paused run waits at a step boundary (its step has finished)."""
        return self.boundary.held.is_set()

    def wait_until_held(self, timeout: float | None = None) -> bool:
        """After ``pause()``: wait until the running loop has finished its step and waits at the
        boundary; returns True once it does (False after ``timeout`` seconds)."""
        return self.boundary.held.wait(timeout)


def run_stage(ctx: StepContext, name: str, batch: Batch) -> Batch:
    """Run the registered stage ``name`` on ``batch`` as a step would; returns the batch with
    what the stage added (its metrics under ``meta["metrics"][name]``). Raises DataflowError
    naming the fields the stage needs that ``batch`` lacks, or the role the mapping lacks."""
    stage = get_stage(name)
    missing = [f for f in stage.inputs(ctx.cfg) if not f.startswith("@") and f not in batch]
    if missing:
        have = ", ".join([*batch.tensors, *batch.objects]) or "nothing"
        raise DataflowError(f"stage {name!r} needs the field(s) {', '.join(missing)}, which the batch does not"
                            f" have (it has: {have}); run the stages that make them first")
    for role in filter(None, (stage.role, *stage.needs)):
        if role not in ctx.workers.mapping.roles:
            raise DataflowError(f"stage {name!r} runs on role {role!r}, which the device mapping does not have"
                                f" (roles: {', '.join(ctx.workers.mapping.roles)})")
    ctx.rerunning = True  # generate now, on these prompts (never the off-policy look-ahead)
    new, metrics = stage.fn(ctx, batch)
    ctx.stage_finished(stage)
    out = merge(batch, new, stage.replaces_rows)
    out.meta = {**out.meta, "metrics": {**batch.meta.get("metrics", {}), name: metrics}}
    return out
