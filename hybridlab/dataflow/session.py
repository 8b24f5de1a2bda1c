"""RLSession: RL training you can drive one step at a time from a notebook, or run to the end.

    rl = RLSession("grpo", ["trainer.steps=50"]).start()
    result = rl.step()            # the step's Batch and metrics, for inspection
    rl.dataflow = Dataflow([...]) # edit the step between steps; workers keep running
    rl.train()                    # the rest, with a progress bar; returns the summary
    rl.shutdown()

It owns a WorkerSet (``rl.workers``: Ray, pools, worker groups per the device mapping), the
prompt source, the dataflow, the KL controller and the run directory (config.yaml,
metrics.jsonl, TensorBoard events, summary.json). This module is the run's lifecycle: start
(warm start, environment record, workers), resume, close. The step is in step.py, live edits
in live.py; the notebook widgets (``rl.controls()``...) are imported when asked for: the UI
depends on the session, never the other way round.
"""
from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import yaml
from transformers import AutoTokenizer

from hybridlab.advisor.live import LiveAdvisor
from hybridlab.advisor.suggest import suggest_mapping
from hybridlab.algos.kl import get_kl_controller
from hybridlab.atomic import write_json
from hybridlab.backend_checks import training_strategy
from hybridlab.config import ConfigError, RunConfig
from hybridlab.controller.binding import BIND_ENV
from hybridlab.controller.mapping import DeviceMapping
from hybridlab.controller.resources import connect
from hybridlab.controller.warm_pool import warm_pool
from hybridlab.controller.watch import dump_stacks
from hybridlab.controller.worker_set import WorkerSet
from hybridlab.dataflow import checkpoints
from hybridlab.dataflow.defaults import dataflow_names, default_mapping
from hybridlab.dataflow.edits import StepBoundary
from hybridlab.dataflow.graph import Dataflow, StepResult
from hybridlab.dataflow.live import LiveEdits
from hybridlab.dataflow.pairs import PairSource, load_pairs
from hybridlab.dataflow.prompts import PromptFit, PromptSource, load_samples, tokenize_prompts
from hybridlab.dataflow.roles import role_classes, worker_classes
from hybridlab.dataflow.run_state import RunState, TrainProgress
from hybridlab.dataflow.step import BackgroundRun, Stepping
from hybridlab.dataflow.warm_start import warm_start
from hybridlab.environment import describe, usable_cores
from hybridlab.explain import explain
from hybridlab.models.chat import check_chat, use_template
from hybridlab.models.spec import ModelSpec
from hybridlab.models.zoo import resolve_model
from hybridlab.protocol import Batch
from hybridlab.run_config import load_config, validate_config
from hybridlab.scorers import ScorerOptions
from hybridlab.telemetry.metrics import MetricsLog
from hybridlab.telemetry.run import RunTelemetry
from hybridlab.telemetry.trackers import Trackers
from hybridlab.workers.reward.scoring import check_sources
from hybridlab.workers.rollout.cpu_attention import check_head_size


class RLSession(Stepping, LiveEdits):
    """RL training held by a notebook kernel or the CLI; see the module docstring."""

    def __init__(self, config: RunConfig | str | os.PathLike | None = None, overrides: list[str] | None = None, *,
                 ray_address: str | None = None, ray_temp_dir: str | None = None):
        if isinstance(config, RunConfig):
            if overrides:
                raise ValueError("pass overrides with a config path or preset name, not with a RunConfig object")
            validate_config(config)  # the dataflow is validated here, on update() and on assignment
            self.cfg = config
        else:
            self.cfg = load_config(config, overrides)
        names = dataflow_names(self.cfg)
        self._dataflow = Dataflow(names)
        self.mapping = DeviceMapping.from_dict(self.cfg.mapping or default_mapping(self.cfg, names))
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.run_dir = Path(self.cfg.trainer.run_dir or Path("runs") / f"{self.cfg.name}-{stamp}")
        self.state = RunState(get_kl_controller(self.cfg.algorithm.kl_ctrl))  # what steps read and write
        self._ray = dict(address=ray_address, temp_dir=ray_temp_dir)
        self.workers = None
        self.telemetry = RunTelemetry(self.run_dir)  # the hub, span stream, live reporter (trainer.telemetry)
        self.log = None        # MetricsLog, once started
        self.trackers = Trackers([])  # W&B and MLflow (trainer.logger), once started
        self.stop_requested = False  # request_stop(): the running (or next) train() stops after its step
        self.training = False        # a train() loop runs (in this thread or a background one)
        self.boundary = StepBoundary()  # a step, or an edit of the session; never both
        self.broken: str | None = None   # why the session cannot step (a remap failed halfway)
        self.environment: dict = {}
        self.warm_start_info: dict | None = None  # steps, seconds, held-out accuracy of the warm start
        self.background: BackgroundRun | None = None   # the latest start_background() run
        self._resume_from: Path | None = None   # the checkpoint resume() continues from
        self.step_callbacks: list = []  # called with each StepResult (notebook widgets follow the run)
        self.advisor = None  # the mapping advisor's LiveAdvisor: its check every trainer.advise_every steps

    def start(self) -> "RLSession":
        """Create the run directory, run the warm start, start the workers; returns self."""
        if self.workers is not None:
            return self
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(yaml.safe_dump(self.cfg.to_dict(), sort_keys=False))
        processes = sum(1 for _ in self.mapping.process_sets())
        env = {"OMP_NUM_THREADS": str(max(1, usable_cores() // processes)),
               **({BIND_ENV: "1"} if self.cfg.trainer.bind_threads else {})}
        self.environment = {**describe(self.cfg.trainer.seed), "worker_threads": int(env["OMP_NUM_THREADS"]),
                            "worker_processes": processes, "training_backends": self.training_backends()}
        write_json(self.run_dir / "environment.json", self.environment)
        devices = sum(p.devices for p in self.mapping.pools.values())
        model_dir = Path(resolve_model(self.cfg.model, data=self.cfg.data))
        # every prompt is checked (empty, not tokenizable, too long) before Ray or a warm start
        self.tokenizer = use_template(AutoTokenizer.from_pretrained(model_dir), self.cfg.data.chat_template)
        self._model_fit = PromptFit.of(self.cfg, model_dir)  # its context; the settings may change live
        check_head_size(self.cfg.rollout.backend, model_dir)  # vLLM's CPU attention on this processor
        self.test_samples = load_samples(self.cfg, "test")
        if self.cfg.data.preferences:  # offline DPO: each step's batch is pairs, not prompts
            pairs = load_pairs(self.cfg)
            check_chat(self.tokenizer, pairs + self.test_samples, model_dir)
            self.state.prompts = PairSource(pairs, self.tokenizer, self.cfg.data.prompts_per_step,
                                      seed=self.cfg.data.seed, context=self._model_fit.context)
        else:
            train = load_samples(self.cfg, "train")
            check_chat(self.tokenizer, train + self.test_samples, model_dir)
            if self.cfg.reward.kind == "rule":  # a source without a scorer would score error_score throughout
                check_sources(train + self.test_samples, ScorerOptions.of(self.cfg.reward, self.cfg.sandbox))
            self.state.prompts = PromptSource(train, self.tokenizer, self.cfg.data.prompts_per_step,
                                        seed=self.cfg.data.seed, fit=self._prompt_fit())
        tokenize_prompts(self.test_samples, self.tokenizer, self._prompt_fit())
        try:
            connect(address=self._ray["address"], temp_dir=self._ray["temp_dir"], min_gpus=devices)
            if self.cfg.trainer.telemetry:  # first, so a viewer sees the warm start too
                self.telemetry.start(env, self._run_record(model_dir))
            if self.cfg.warm_start.max_steps:
                model_dir = self._warm_start(model_dir)
            self.model_dir = model_dir
            self.spec = ModelSpec.read(model_dir)
            self._start_workers(model_dir, env)
        except BaseException:
            self.shutdown()  # nothing half-started stays behind; start() may be called again
            raise
        record = None
        if self._resume_from is not None:  # logs back to the checkpoint before anything appends
            record = checkpoints.prepare_logs(self.run_dir, self._resume_from)
        self.log = MetricsLog(self.run_dir, "tensorboard" in self.cfg.trainer.logger,
                              purge_after=record["step"] if record else None)
        t = self.cfg.trainer
        self.trackers = Trackers.open(t.logger, self.run_dir, dataclasses.asdict(self.cfg), t.project_name,
                                      t.mlflow_uri, resumed_at=record["step"] if record else None)
        if record is not None:
            checkpoints.restore(self.workers, self.state, self._resume_from, record)
            if "actor" in self.workers.groups and "rollout" in self.workers.groups:
                self.sync_weights(reason="resume")
            self.state.train_progress = TrainProgress.from_record(record["train"])
            self.emit("resume", {"step": self.state.step_count, "checkpoint": self._resume_from.name})
        self._start_advisor()
        return self

    def _start_workers(self, model_dir: Path, env: dict) -> None:
        """Start the mapping's worker processes (in the kernel's warm processes where there are
        some: controller/warm_pool.py) and have the telemetry watch their calls."""
        self.workers = WorkerSet(self.mapping, role_classes(self.cfg, self.mapping, str(model_dir)),
                                 address=self._ray["address"], env=env, ray_temp_dir=self._ray["temp_dir"],
                                 spares=self.cfg.trainer.spare_processes, warm=warm_pool(),
                                 warm_roles=worker_classes())
        self.workers.watch.stacks_dir = self.run_dir / "stacks"
        self.workers.start()
        self.telemetry.watch(self.workers, self._run_controls(), paused=lambda: self.paused)

    def _start_advisor(self) -> None:
        """Check the mapping against the advisor's prediction every trainer.advise_every steps."""
        if self.advisor is None:
            self.advisor = LiveAdvisor(self, self.emit)
            self.step_callbacks.append(self.advisor)

    @classmethod
    def resume(cls, run_dir: str | os.PathLike, overrides: list[str] | None = None, **kwargs) -> "RLSession":
        """Return a started session that continues the run in ``run_dir`` from its latest
        complete checkpoint, with its config (and ``overrides``, e.g. another mapping): the
        trainers' weights and moments, the step, every RNG, the prompt stream, the KL
        controller; logs cut back to the checkpoint. ``train()`` then runs the remaining steps."""
        run_dir = Path(run_dir)
        checkpoint = checkpoints.latest(run_dir)  # a clear error before anything starts
        adapter = [o.split("=", 1)[0] for o in overrides or [] if o.startswith("actor.lora.")]
        if adapter:  # the checkpoint's adapter has its shape and scale; the rollout engines follow it
            raise ConfigError(f"{adapter[0]} cannot change when resuming: the checkpoint holds an adapter built"
                              " with the run's actor.lora settings")
        rl = cls(checkpoint / "config.yaml", [*(overrides or []), f"trainer.run_dir={run_dir}"], **kwargs)
        rl._resume_from = checkpoint
        return rl.start()

    def _prompt_fit(self) -> PromptFit:
        """Return how long a prompt may be under the current settings."""
        return PromptFit.of(self.cfg, self._model_fit)

    def _run_record(self, model_dir: Path) -> dict:
        """Return the telemetry's first record: the run, its mapping, and the config explained
        (``hybridlab explain``; a note if it cannot be made: the run does not depend on it)."""
        try:
            explanation = explain(self.cfg, model_dir).markdown()
        except Exception as exc:
            explanation = f"(no explanation: {exc})"
        return {"name": self.cfg.name, "run_dir": str(self.run_dir), "algorithm": self.cfg.algorithm.adv_estimator,
                "dataflow": self._dataflow.names, "mapping": self.mapping.to_dict(),
                "processor": self.environment["processor"], "backends": self.training_backends(),
                "explanation": explanation}

    def training_backends(self) -> dict[str, str]:
        """Return {training role: the backend that runs it} for the mapping's actor, ref and critic."""
        return {role: training_strategy(self.cfg, "critic" if role == "critic" else "actor")
                for role in ("actor", "ref", "critic") if role in self.mapping.roles}

    def save_checkpoint(self, progress: TrainProgress | None = None) -> Path:
        """Write a checkpoint of the run now (between steps; ``progress``: train()'s, which a resumed
        train() goes on from); returns its folder."""
        with self.boundary.lock:
            return checkpoints.save(self, progress)

    def emit(self, kind: str, record: dict) -> None:
        """Send a run record of ``kind`` to the telemetry (dashboard, telemetry.jsonl) and the trackers."""
        self.telemetry.emit(kind, record)
        self.trackers.event(kind, record, self.state.step_count)

    def dashboard(self):
        """Return the live dashboard of this run (display it in a notebook cell); its one
        action asks for the workers' stacks."""
        return self.telemetry.dashboard()

    def _warm_start(self, base: Path) -> Path:
        """Run (or reuse) the warm start; returns the checkpoint directory."""
        path, self.warm_start_info = warm_start(self.cfg, self.run_dir, base, self.emit)
        return path

    def shutdown(self) -> None:
        """Stop the workers and close the logs (the Ray connection stays for the kernel)."""
        self.state.ahead.forget(self.state.prompts)
        self.telemetry.stop_watching()
        if self.workers is not None:
            self.workers.shutdown()
            self.workers = None
        if getattr(self, "log", None) is not None:
            self.log.close()
            self.log = None
        self.trackers.close()
        self.telemetry.close()

    def __enter__(self) -> "RLSession":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def running(self) -> list[dict]:
        """Return the worker calls in flight, oldest first: role, ranks, method, stage,
        elapsed_s, deadline_s and late (past its deadline: stuck)."""
        return self.workers.watch.running() if self.workers is not None else []

    def _run_controls(self) -> dict:
        """Return what the dashboard's run controls call (``telemetry.live.ACTIONS``)."""
        return {"pause": self.pause, "resume": self.unpause, "stop": self.stop_running, "stacks": self.stacks,
                "remap": self.remap_later}

    def stacks(self) -> list[Path]:
        """Write every worker process's Python stacks to ``RUN_DIR/stacks/``; returns the files."""
        label, seen, files = time.strftime("%Y%m%d-%H%M%S"), set(), []
        for role, group in self.workers.groups.items():  # colocated roles share processes: dump each once
            pids = tuple(p["pid"] for p in group.placements)
            if pids not in seen:
                seen.add(pids)
                files += dump_stacks(group.placements, self.run_dir / "stacks", f"{label}-{role}")
        return files

    def inspect(self, result: "StepResult | Batch", stage: str | None = None):
        """Return a sortable table widget of a step's batch as it was after ``stage``."""
        from hybridlab.notebook.batch_table import inspect

        return inspect(self, result, stage)

    def suggest_mapping(self, profile=None):
        """Return the mapping advisor's Suggestion for this session's devices (``profile``: a
        DeviceProfile, h100/h200/a100 or a file; default this machine's from ``hybridlab calibrate``):
        the best predicted mapping, the prediction for the current one, and ``apply(rl)``."""
        return suggest_mapping(self, profile)

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
