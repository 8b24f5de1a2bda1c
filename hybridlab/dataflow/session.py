"""RLSession: RL training you can drive one step at a time from a notebook, or run to the end.

    rl = RLSession("grpo", ["trainer.steps=50"]).start()
    result = rl.step()            # the step's Batch and metrics, for inspection
    rl.dataflow = Dataflow([...]) # edit the step between steps; workers keep running
    rl.train()                    # the rest, with a progress bar; returns the summary
    rl.shutdown()

It owns a controller Session (Ray, pools, worker groups per the device mapping), the prompt
source, the dataflow, the KL controller and the run directory (config.yaml, metrics.jsonl,
TensorBoard events, summary.json).
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any

import yaml

from hybridlab.config import ConfigError, RunConfig, dataflow_names, default_mapping, load_config
from hybridlab.controller.mapping import DeviceMapping
from hybridlab.dataflow.graph import Dataflow
from hybridlab.dataflow.stages import REWARD_FIELDS, RolloutAhead
from hybridlab.dataflow.prompts import PROMPT_FIELDS, PromptFit, PromptSource, load_samples, prompt_batch, \
    tokenize_prompts
from hybridlab.dataflow.edits import StepBoundary
from hybridlab.dataflow.roles import role_classes
from hybridlab.dataflow.context import BackgroundRun, StepContext
from hybridlab.atomic import write_json
from hybridlab.controller.binding import BIND_ENV
from hybridlab.telemetry.busy import session_busy
from hybridlab.telemetry.run import RunTelemetry
from hybridlab.protocol import Batch


HISTORY_STEPS = 1000  # the newest steps' metrics kept in memory (and in checkpoints)


@dataclasses.dataclass
class StepResult:
    """What one RL step produced: the final Batch (every field the stages wrote), metrics, and
    ``stages``: each stage with the fields it added, in the order the stages finished."""

    step: int
    batch: Batch
    metrics: dict[str, Any]
    stages: list[tuple[str, list[str]]] = dataclasses.field(default_factory=list)


class RLSession:
    """RL training held by a notebook kernel or the CLI; see the module docstring."""

    def __init__(self, config: RunConfig | str | os.PathLike | None = None, overrides: list[str] | None = None, *,
                 ray_address: str | None = None, ray_temp_dir: str | None = None):
        if isinstance(config, RunConfig):
            if overrides:
                raise ValueError("pass overrides with a config path or preset name, not with a RunConfig object")
            from hybridlab.config import validate_config

            validate_config(config)  # the dataflow is validated here, on update() and on assignment
            self.cfg = config
        else:
            self.cfg = load_config(config, overrides)
        names = dataflow_names(self.cfg)
        self._dataflow = Dataflow(names)
        from hybridlab.algos.kl import get_kl_controller

        self.mapping = DeviceMapping.from_dict(self.cfg.mapping or default_mapping(self.cfg, names))
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.run_dir = Path(self.cfg.trainer.run_dir or Path("runs") / f"{self.cfg.name}-{stamp}")
        self.kl_ctrl = get_kl_controller(self.cfg.algorithm.kl_ctrl)
        self._ray = dict(address=ray_address, temp_dir=ray_temp_dir)
        self.session = None
        self.step_count = 0
        self.history: list[dict] = []  # the metrics of the newest HISTORY_STEPS steps
        self.ahead = RolloutAhead()  # off-policy: the next steps' rollouts, submitted ahead
        self.telemetry = RunTelemetry(self.run_dir)  # the hub, span stream, live reporter (trainer.telemetry)
        self.log = None        # MetricsLog, once started
        self._stop_requested = False
        self._training = False     # a train() loop runs (in this thread or a background one)
        self.bad_updates = 0           # optimizer steps skipped for a NaN or inf, in all
        self.bad_steps_in_a_row = 0    # steps in a row with a skipped update (trainer.max_bad_updates)
        self.worker_restarts = 0       # dead or stuck workers re-created (trainer.max_restarts)
        self.restarts: list[dict] = [] # what each restart re-created and restored
        self.reward_error_sources: set[str] = set()  # data sources whose reward failures were warned about
        self._edits = StepBoundary()  # a step, or an edit of the session; never both
        self.broken: str | None = None   # why the session cannot step (a remap failed halfway)
        self.environment: dict = {}
        self.remaps: list = []      # RemapReports, in order
        self.warm_start_info: dict | None = None  # steps, seconds, held-out accuracy of the warm start
        self.background: BackgroundRun | None = None   # the latest start_background() run
        self._resume_from: Path | None = None   # the checkpoint resume() continues from
        self._train_state: dict | None = None   # train()'s progress restored from it
        self.step_callbacks: list = []  # called with each StepResult (notebook widgets follow the run)

    # ------------------------------------------------------------ lifecycle
    def start(self) -> "RLSession":
        """Create the run directory, run the warm start, start the workers; returns self."""
        if self.session is not None:
            return self
        from transformers import AutoTokenizer

        from hybridlab.controller.session import Session
        from hybridlab.environment import describe, usable_cores
        from hybridlab.models.zoo import resolve_model
        from hybridlab.workers.train.convert import ModelSpec

        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(yaml.safe_dump(self.cfg.to_dict(), sort_keys=False))
        processes = sum(1 for _ in self.mapping.process_sets())
        env = {"OMP_NUM_THREADS": str(max(1, usable_cores() // processes))}
        if self.cfg.trainer.bind_threads:
            env[BIND_ENV] = "1"
        self.environment = {**describe(self.cfg.trainer.seed), "worker_threads": int(env["OMP_NUM_THREADS"]),
                            "worker_processes": processes}
        write_json(self.run_dir / "environment.json", self.environment)
        from hybridlab.controller.resources import connect

        devices = sum(p.devices for p in self.mapping.pools.values())
        model_dir = Path(resolve_model(self.cfg.model))
        # every prompt is checked (empty, not tokenizable, too long) before Ray or a warm start
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.context = PromptFit.of(self.cfg, model_dir).context
        self.prompts = PromptSource(load_samples(self.cfg, "train"), self.tokenizer, self.cfg.data.prompts_per_step,
                                    seed=self.cfg.data.seed, fit=self._prompt_fit())
        self.test_samples = load_samples(self.cfg, "test")
        tokenize_prompts(self.test_samples, self.tokenizer, self._prompt_fit())
        try:
            connect(address=self._ray["address"], temp_dir=self._ray["temp_dir"], min_gpus=devices)
            if self.cfg.trainer.telemetry:  # first, so a viewer sees the warm start too
                self.telemetry.start(env, self._run_record(model_dir))
            if self.cfg.warm_start.max_steps:
                model_dir = self._warm_start(model_dir)
            self.model_dir = model_dir
            self.spec = ModelSpec.from_hf(model_dir)
            self.session = Session(self.mapping, role_classes(self.cfg, self.mapping, str(model_dir)),
                                   address=self._ray["address"], env=env, ray_temp_dir=self._ray["temp_dir"],
                                   spares=self.cfg.trainer.spare_processes)
            self.session.watch.stacks_dir = self.run_dir / "stacks"
            self.session.start()
            self.telemetry.watch(self.session, self.stacks)
        except BaseException:
            self.shutdown()  # nothing half-started stays behind; start() may be called again
            raise
        from hybridlab.telemetry.metrics import MetricsLog

        record = None
        if self._resume_from is not None:  # logs back to the checkpoint before anything appends
            from hybridlab.dataflow import checkpoints

            record = checkpoints.prepare_logs(self.run_dir, self._resume_from)
        self.log = MetricsLog(self.run_dir, self.cfg.trainer.tensorboard,
                              purge_after=record["step"] if record else None)
        if record is not None:
            checkpoints.restore(self, self._resume_from, record)
            self._train_state = record["train"]
            self._emit("resume", {"step": self.step_count, "checkpoint": self._resume_from.name})
        return self

    @classmethod
    def resume(cls, run_dir: str | os.PathLike, overrides: list[str] | None = None, **kwargs) -> "RLSession":
        """Return a started session that continues the run in ``run_dir`` from its latest
        complete checkpoint, with its config (and ``overrides``, e.g. another mapping): the
        trainers' weights and moments, the step, every RNG, the prompt stream, the KL
        controller; logs cut back to the checkpoint. ``train()`` then runs the remaining steps."""
        from hybridlab.dataflow import checkpoints

        run_dir = Path(run_dir)
        checkpoint = checkpoints.latest(run_dir)  # a clear error before anything starts
        rl = cls(checkpoint / "config.yaml", [*(overrides or []), f"trainer.run_dir={run_dir}"], **kwargs)
        rl._resume_from = checkpoint
        return rl.start()

    def _prompt_fit(self) -> PromptFit:
        """Return how long a prompt may be under the current settings."""
        return PromptFit(self.context, self.cfg.rollout.max_new_tokens, self.cfg.data.truncate_prompts)

    def _run_record(self, model_dir: Path) -> dict:
        """Return the telemetry's first record: the run, its mapping, and the config explained
        (``hybridlab explain``; a note if it cannot be made: the run does not depend on it)."""
        from hybridlab.explain import explain

        try:
            explanation = explain(self.cfg, model_dir).markdown()
        except Exception as exc:
            explanation = f"(no explanation: {exc})"
        return {"name": self.cfg.name, "run_dir": str(self.run_dir), "algorithm": self.cfg.algorithm.adv_estimator,
                "dataflow": self._dataflow.names, "mapping": self.mapping.to_dict(),
                "processor": self.environment["processor"], "explanation": explanation}

    def save_checkpoint(self) -> Path:
        """Write a checkpoint of the run now (between steps); returns its folder."""
        from hybridlab.dataflow import checkpoints

        with self._edits.lock:
            return checkpoints.save(self, dict(self._train_state or {}))

    def _emit(self, kind: str, record: dict) -> None:
        self.telemetry.emit(kind, record)

    def dashboard(self):
        """Return the live dashboard of this run (display it in a notebook cell); its one
        action asks for the workers' stacks."""
        return self.telemetry.dashboard()

    def _warm_start(self, base: Path) -> Path:
        """Run (or reuse) the warm start; returns the checkpoint directory."""
        from hybridlab.dataflow.warm_start import warm_start

        path, self.warm_start_info = warm_start(self.cfg, self.run_dir, base, self._emit)
        return path

    def shutdown(self) -> None:
        """Stop the workers and close the logs (the Ray connection stays for the kernel)."""
        self.ahead.pending = []
        self.telemetry.stop_watching()
        if self.session is not None:
            self.session.shutdown()
            self.session = None
        if getattr(self, "log", None) is not None:
            self.log.close()
            self.log = None
        self.telemetry.close()

    def __enter__(self) -> "RLSession":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -------------------------------------------------------------- dataflow
    @property
    def dataflow(self) -> Dataflow:
        """The stages each step runs; assign a new Dataflow (or list of names) between steps."""
        return self._dataflow

    @dataflow.setter
    def dataflow(self, value: Dataflow | list) -> None:
        flow = value if isinstance(value, Dataflow) else Dataflow(value)
        flow.validate(self.cfg, self.mapping.roles, PROMPT_FIELDS)

        def assign() -> None:
            flow.validate(self.cfg, self.mapping.roles, PROMPT_FIELDS)  # against the config it now meets
            self._dataflow = flow
            self.cfg = dataclasses.replace(self.cfg, dataflow=flow.names)
            self._drop_pending()

        self._edits.run(assign)

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
        from hybridlab.dataflow import remap

        change = remap.prepare_update(self, overrides)  # every error now, before waiting for a boundary
        if self.session is None:  # not started: nothing runs yet
            remap.apply_change(self, change)
        else:  # prepared again at the boundary, on the config as it is then
            self._edits.run(lambda: remap.apply_change(self, remap.prepare_update(self, overrides)))
        return self.cfg

    def remap(self, mapping: DeviceMapping | dict | str):
        """Move the running session onto ``mapping`` (a DeviceMapping, a dict or YAML text):
        re-creates only the roles whose placement changed, carries the trainers' weights, AdamW
        moments, schedule position and RNG in memory, and resyncs the rollout. Refused before
        anything is torn down if the mapping cannot run (the session keeps its old one).
        Applied between steps (during a background run at the next step boundary; this call
        waits for it); returns the RemapReport."""
        from hybridlab.dataflow import remap

        new_mapping = remap.parse_mapping(mapping)
        if self.session is None:
            raise ConfigError("remap needs a started session (call start() first, or give the mapping in the"
                              " config: mapping=...)")
        remap.prepare_remap(self, new_mapping)
        return self._edits.run(lambda: remap.apply_change(self, remap.prepare_remap(self, new_mapping)))

    def _set_config(self, new: RunConfig, flow: Dataflow, configure: dict[str, dict]) -> None:
        """Apply a validated config between steps: live worker settings, KL controller, dataflow."""
        for role, settings in configure.items():
            self.session.groups[role].configure(**settings)
        if new.algorithm.kl_ctrl != self.cfg.algorithm.kl_ctrl:
            from hybridlab.algos.kl import get_kl_controller

            self.kl_ctrl = get_kl_controller(new.algorithm.kl_ctrl)
        if (new.trainer.off_policy, new.trainer.max_staleness, new.rollout) != \
                (self.cfg.trainer.off_policy, self.cfg.trainer.max_staleness, self.cfg.rollout):
            self._drop_pending()
        if self.session is not None and new.trainer.spare_processes != self.cfg.trainer.spare_processes:
            self.session.set_spares(new.trainer.spare_processes)
        self.cfg, self._dataflow = new, flow

    def _drop_pending(self) -> None:
        self.ahead.drop()  # let it finish; its samples are not used

    # ------------------------------------------------------------------ steps
    def step(self) -> StepResult:
        """Run one RL step through the dataflow; returns its Batch and metrics (also logged)."""
        if self.session is None:
            self.start()
        if self.broken:
            raise RuntimeError(self.broken)
        from hybridlab.dataflow.recovery import run_step

        with self._edits.step():  # edits queued during the previous step apply before this one
            return run_step(self)  # a dead or stuck worker is re-created and the step run again

    def _step(self, ctx: StepContext) -> StepResult:
        t = self.cfg.trainer
        self.session.watch.configure(t.call_deadline_floor_s, t.call_deadline_s)
        start, wall = time.perf_counter(), time.time()
        trace: list[tuple[str, list[str]]] = []
        batch, metrics = self._dataflow.run(ctx, self.prompts.next(), trace=trace)
        seconds = time.perf_counter() - start
        tokens = int(batch["response_mask"].sum()) if "response_mask" in batch else 0
        bad = int(metrics.get("actor/skipped", 0) + metrics.get("critic/skipped", 0))
        self.bad_updates += bad
        self.bad_steps_in_a_row = self.bad_steps_in_a_row + 1 if bad else 0
        if bad:
            ctx.warn(f"step {self.step_count + 1}: {bad} update(s) skipped for a NaN or inf loss or gradient norm;"
                     " the weights stay as they were")
        metrics["faults/bad_updates"] = self.bad_updates
        metrics["faults/worker_restarts"] = self.worker_restarts
        metrics.setdefault("rollout/staleness", 0)
        metrics.update({"timing/step_s": seconds, "perf/tokens_per_s": tokens / seconds if seconds else 0.0,
                        "warnings": len(ctx.warnings)})
        metrics.update(session_busy(self.session, wall, time.time()))
        self.step_count += 1
        self.history.append({"step": self.step_count, **metrics})
        del self.history[:-HISTORY_STEPS]  # bounded: metrics.jsonl keeps every step
        self.log.write(self.step_count, metrics)
        self._emit("metrics", {"step": self.step_count, **metrics})
        result = StepResult(self.step_count, batch, metrics, trace)
        for callback in list(self.step_callbacks):
            try:
                callback(result)
            except Exception as exc:  # a display hook must never stop training
                warnings.warn(f"step callback {callback!r} failed: {exc!r}", RuntimeWarning)
        return result

    def sync_weights(self, reason: str = "step"):
        """Copy the actor's weights into the rollout engines now; returns the SyncReport (the
        dataflow's sync_weights stage calls this, and a remap with ``reason="remap"``)."""
        from hybridlab.reshard.transfer import sync_mapped

        report = sync_mapped(self.session.groups, self.mapping, self.spec)
        self._emit("sync", {"step": self.step_count + (reason == "step"), "bytes": report.bytes_moved,
                            "buckets": report.buckets, "seconds": report.seconds, "mode": report.mode,
                            "reason": reason, "bytes_per_pair": report.plan.get("bytes_per_pair", {})})
        return report

    def running(self) -> list[dict]:
        """Return the worker calls in flight, oldest first: role, ranks, method, stage,
        elapsed_s, deadline_s and late (past its deadline: stuck)."""
        return self.session.watch.running() if self.session is not None else []

    def stacks(self) -> list[Path]:
        """Write every worker process's Python stacks to ``RUN_DIR/stacks/``; returns the files."""
        from hybridlab.controller.watch import dump_stacks

        label, seen, files = time.strftime("%Y%m%d-%H%M%S"), set(), []
        for role, group in self.session.groups.items():  # colocated roles share processes: dump each once
            pids = tuple(p["pid"] for p in group.placements)
            if pids not in seen:
                seen.add(pids)
                files += dump_stacks(group.placements, self.run_dir / "stacks", f"{label}-{role}")
        return files

    # -------------------------------------------------------------- evaluation
    def evaluate(self, samples: list | None = None) -> dict:
        """Return greedy accuracy of the current rollout weights on the test prompts:
        ``{"accuracy", "n", "reward_mean"}``."""
        samples = samples if samples is not None else self.test_samples
        if not samples:
            return {"accuracy": float("nan"), "n": 0, "reward_mean": float("nan")}
        from hybridlab.dataflow.recovery import with_recovery

        prompts = prompt_batch(samples, self.tokenizer, list(range(len(samples))), self._prompt_fit())
        # under the step lock: a remap or an edit waits for the evaluation as for a step
        with self._edits.lock, self.session.timeline.staged("evaluate"):  # the dashboard labels calls by stage
            scored = with_recovery(self, lambda ctx: self.session.groups["reward"].compute_reward(
                self.session.groups["rollout"].generate(prompts, ctx.sampling(n=1, temperature=0.0))
                .select(REWARD_FIELDS)))
        return {"accuracy": float(scored["acc"].nanmean()), "n": len(samples),
                "reward_mean": float(scored["token_level_scores"].sum(-1).mean())}

    def decoded(self, batch: Batch, limit: int = 16) -> list[dict]:
        """Return the first ``limit`` rows of a step's batch as readable dicts (prompt, response,
        length, reward, log-prob means, advantage) for a notebook table."""
        from hybridlab.dataflow.rows import batch_rows

        return [{k: v for k, v in row.items() if k != "#"} for row in batch_rows(batch[:limit], self.tokenizer)]

    # ---------------------------------------------------------------- notebook
    def next_prompts(self) -> Batch:
        """Return the next step's prompts from the prompt stream (the stream moves on)."""
        self._refuse_while_stepping("next_prompts")
        with self._edits.lock:
            return self.prompts.next()

    def run_stage(self, name: str, batch: Batch) -> Batch:
        """Run one registered stage by hand between steps; returns ``batch`` with what the stage
        added, its metrics in ``meta["metrics"]``. Refused while a background run is stepping."""
        from hybridlab.dataflow.context import run_stage

        self._refuse_while_stepping("run_stage")
        with self._edits.step():
            return run_stage(self, name, batch)

    def _refuse_while_stepping(self, what: str) -> None:
        if self._training and not self.held:
            raise RuntimeError(f"{what} runs between steps, but a training run is stepping: pause() it (and wait"
                               " until it is held) or stop it first")

    def inspect(self, result: "StepResult | Batch", stage: str | None = None):
        """Return a sortable table widget of a step's batch as it was after ``stage``."""
        from hybridlab.notebook.batch_table import inspect

        return inspect(self, result, stage)

    def mapping_editor(self):
        """Return the device-mapping editor widget (Validate / Apply call ``remap``)."""
        from hybridlab.notebook import MappingEditor

        return MappingEditor(self)

    def dataflow_editor(self):
        """Return the dataflow and algorithm editor widget (Validate / Apply call ``update``)."""
        from hybridlab.notebook import DataflowEditor

        return DataflowEditor(self)

    def controls(self, steps: int | None = None):
        """Return the Start / Pause / Resume / Step / Stop widget."""
        from hybridlab.notebook import Controls

        return Controls(self, steps)

    # ------------------------------------------------------------------ loop
    def train(self, steps: int | None = None) -> dict:
        """Run ``steps`` steps (default trainer.steps; after ``resume``, the remaining ones)
        within trainer.max_minutes, evaluating greedy accuracy before, every
        trainer.eval_every steps and after, checkpointing every trainer.save_every steps, at
        the end and on a stop; writes and returns the summary (``summary.json``)."""
        from hybridlab.dataflow.train_loop import train

        if self.session is None:
            self.start()
        self._training = True
        try:
            return train(self, steps)
        finally:  # a pause or stop asked for after the last step must not hold the next run
            self._training = False
            self._stop_requested = False
            self._edits.resume()

    def request_stop(self) -> None:
        """Ask the running (or the next) ``train()`` to stop after its current step (a paused
        one at once); it still evaluates and writes its summary."""
        self._stop_requested = True
        self._edits.resume()

    def pause(self) -> None:
        """Hold the running ``train()`` (a background run) at its next step boundary (the step
        under way finishes); ``update``, ``remap``, ``step`` and ``run_stage`` work while it is
        held; ``unpause()`` goes on. Raises RuntimeError when no training loop runs."""
        if not self._training:
            raise RuntimeError("no run to pause: pause() holds a running train() or start_background() run"
                               " at its next step boundary")
        self._edits.pause()

    def unpause(self) -> None:
        """Let a paused run go on (``RLSession.resume`` is another thing: a run from a checkpoint)."""
        self._edits.resume()

    @property
    def paused(self) -> bool:
        """True between ``pause()`` and ``unpause()``."""
        return self._edits.paused

    @property
    def held(self) -> bool:
        """True while a paused run waits at a step boundary (its step has finished)."""
        return self._edits.held.is_set()

    def wait_until_held(self, timeout: float | None = None) -> bool:
        """After ``pause()``: wait until the running loop has finished its step and waits at the
        boundary; returns True once it does (False after ``timeout`` seconds)."""
        return self._edits.held.wait(timeout)

    def start_background(self, steps: int | None = None) -> "BackgroundRun":
        """Run ``train(steps)`` in a background thread so the notebook kernel stays responsive;
        returns a handle with ``done()``, ``stop()`` and ``wait()``."""
        if self.session is None:
            self.start()
        if self.background is not None and not self.background.done():
            raise RuntimeError("a background run is going: stop() or wait() for it before starting another")
        self.background = BackgroundRun(self, steps)
        return self.background
