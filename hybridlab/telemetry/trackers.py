"""The experiment trackers teams already use, fed what ``metrics.jsonl`` gets (``trainer.logger``,
verl's key): the run's config when a session opens, every step's metrics, and the run's remap,
resume and restart events.

- ``console``: the terminal's progress line (``trainer.progress``); nothing more here;
- ``tensorboard``: event files in ``RUN_DIR/tensorboard`` (written by ``metrics.MetricsLog``);
- ``wandb``: a Weights & Biases run in ``RUN_DIR/wandb``, offline unless ``WANDB_MODE`` says
  otherwise (no network needed; ``wandb sync RUN_DIR/wandb/offline-run-*`` uploads it later);
- ``mlflow``: an MLflow run at ``trainer.mlflow_uri``, or in a file store in ``RUN_DIR/mlruns``
  (metric names with ``/`` written ``.``: ``mlflow_key``).

Each session of a run (the first, and each resume) is one W&B run of the run's group and one
MLflow run; a roll-back to a checkpoint starts another W&B run (W&B drops steps it has passed).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from pathlib import Path

LOGGERS = ("console", "tensorboard", "wandb", "mlflow")
EVENTS = ("remap", "resume", "restart")  # the telemetry records each tracker also gets


def logger_problems(names) -> list[str]:
    """Return what is wrong with a ``trainer.logger`` value (empty if nothing)."""
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        return [f"trainer.logger: a list of names from {', '.join(LOGGERS)}, got {names!r}"]
    bad = [n for n in names if n not in LOGGERS]
    return [f"trainer.logger: {', '.join(map(repr, bad))} not one of {', '.join(LOGGERS)}"] if bad else []


def _numbers(metrics: dict) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def _flat(config: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value if isinstance(value, str) else json.dumps(value, default=str)
    return out


class WandbTracker:
    """One W&B run per session (grouped by the run's name), offline by default."""

    def __init__(self, run_dir: Path, project: str, name: str, config: dict, resumed_at: int | None):
        import wandb

        self.wandb, self.run_dir, self.project, self.name, self.config = wandb, run_dir, project, name, config
        self.run = None
        self._open(resumed_at)

    def _open(self, resumed_at: int | None) -> None:
        os.environ.setdefault("WANDB_SILENT", "true")
        mode = os.environ.get("WANDB_MODE", "offline")
        label = self.name if resumed_at is None else f"{self.name} (from step {resumed_at})"
        self.run = self.wandb.init(project=self.project, name=label, group=self.name, dir=str(self.run_dir),
                                   config=self.config, mode=mode, reinit="create_new")

    def log(self, step: int, metrics: dict) -> None:
        """Log a step's numbers (W&B merges two calls at one step into one row)."""
        self.run.log(_numbers(metrics), step=step)

    def event(self, kind: str, record: dict, step: int) -> None:
        """Mark a run event as ``event/KIND`` = 1 at ``step`` (the record itself: telemetry.jsonl)."""
        self.run.log({f"event/{kind}": 1.0}, step=step)

    def rewind(self, step: int) -> None:
        """Finish this W&B run and open the next one, labelled as going on from ``step``."""
        self.run.finish()
        self._open(step)

    def close(self) -> None:
        """Finish the W&B run (offline: its folder is complete for ``wandb sync``)."""
        self.run.finish()


class MlflowTracker:
    """One MLflow run per session: the config as parameters, metrics per step, events as tags."""

    def __init__(self, run_dir: Path, uri: str, project: str, name: str, config: dict, resumed_at: int | None):
        from mlflow.tracking import MlflowClient

        if not uri:  # MLflow 3 keeps its file store only behind this switch; a URI is the user's choice
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (run_dir / "mlruns").resolve().as_uri()
        self.client = MlflowClient(uri)
        experiment = self.client.get_experiment_by_name(project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
        label = name if resumed_at is None else f"{name} (from step {resumed_at})"
        self.run_id = self.client.create_run(experiment_id, run_name=label).info.run_id
        params = _flat(config)
        for start in range(0, len(params), 100):  # MLflow takes at most 100 parameters a call
            batch = dict(list(params.items())[start:start + 100])
            self.client.log_batch(self.run_id, params=[_param(k, v) for k, v in batch.items()])

    def log(self, step: int, metrics: dict) -> None:
        """Log a step's numbers, named by ``mlflow_key``."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(mlflow_key(k), v, now, step)
                                                    for k, v in _numbers(metrics).items()])

    def event(self, kind: str, record: dict, step: int) -> None:
        """Tag the run with the event's record as JSON (``event.KIND.stepN``)."""
        self.client.set_tag(self.run_id, f"event.{kind}.step{step}", json.dumps(record, default=str)[:5000])

    def rewind(self, step: int) -> None:
        """Nothing to do: MLflow keeps every value of a step, and the steps run again are logged again."""

    def close(self) -> None:
        """Mark the MLflow run finished."""
        self.client.set_terminated(self.run_id)


def mlflow_key(name: str) -> str:
    """Return a metric's MLflow name: ``/`` as ``.``. MLflow's file store keeps each name as a
    path, and ``perf/device_busy`` is a metric beside ``perf/device_busy/gpu0``."""
    return name.replace("/", ".")


def _param(key: str, value: str):
    from mlflow.entities import Param

    return Param(key, value[:6000])


@dataclasses.dataclass
class Trackers:
    """The run's W&B and MLflow trackers (TensorBoard and the console are written elsewhere)."""

    trackers: list

    @classmethod
    def open(cls, names, run_dir: str | os.PathLike, config: dict, project: str, mlflow_uri: str = "",
             resumed_at: int | None = None) -> "Trackers":
        """Return the trackers ``names`` asks for, each opened with the run's ``config``."""
        run_dir = Path(run_dir)
        name = run_dir.name
        out = []
        if "wandb" in names:
            out.append(WandbTracker(run_dir, project, name, config, resumed_at))
        if "mlflow" in names:
            out.append(MlflowTracker(run_dir, mlflow_uri, project, name, config, resumed_at))
        return cls(out)

    def log(self, step: int, metrics: dict) -> None:
        """Send a step's metrics (numbers only; NaN and inf left out) to every tracker."""
        for tracker in self.trackers:
            tracker.log(step, metrics)

    def event(self, kind: str, record: dict, step: int) -> None:
        """Send a remap, resume or restart record to every tracker (other kinds are ignored)."""
        if kind in EVENTS:
            for tracker in self.trackers:
                tracker.event(kind, record, step)

    def rewind(self, step: int) -> None:
        """The run went back to ``step`` (a roll-back): the steps after it are logged again."""
        for tracker in self.trackers:
            tracker.rewind(step)

    def close(self) -> None:
        """Finish every tracker's run."""
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []
