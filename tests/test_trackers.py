"""The trackers of `trainer.logger` (W&B offline, MLflow's file store), read back from their own
files: what a session logs, its events and a roll-back (a whole run: test_train_cli.py)."""
from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest

from hybridlab.telemetry.trackers import Trackers, logger_problems


def _records(path: Path):
    """The protobuf records of a W&B run file: a 7-byte header, then LevelDB-style log records
    ([crc 4][length 2][type 1][data]) in 32 KiB blocks, a record split over blocks in parts."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, buf, block = path.read_bytes(), 7, b"", 32768
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a record header is padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: the record is whole
            record = pb.Record()
            record.ParseFromString(buf)
            buf = b""
            yield record


def wandb_runs(run_dir: Path) -> list[dict]:
    """Each offline W&B run under ``run_dir``, oldest first: its name, config and history rows
    ({step: {key: value}}, W&B's own ``_`` keys left out), and whether its exit record (the last one W&B writes) is there."""
    runs = []
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        run = {"name": None, "config": {}, "history": {}, "finished": False}
        for record in _records(path):
            kind = record.WhichOneof("record_type")
            run["finished"] |= kind == "exit"
            if kind == "run":
                run["name"] = record.run.display_name
                run["config"] = {i.key: json.loads(i.value_json) for i in record.run.config.update
                                 if i.key != "_wandb"}
            elif kind == "history":
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                run["history"].setdefault(row["_step"], {}).update(
                    {k: v for k, v in row.items() if not k.startswith("_")})
        runs.append(run)
    return runs


def mlflow_runs(run_dir: Path, project: str = "hybridlab") -> list[dict]:
    """Each MLflow run in ``run_dir/mlruns``, oldest first: name, parameters, tags and metrics
    ({key: [(step, value), ...]})."""
    import os

    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads file stores only so (as `mlflow ui` too)
    client = MlflowClient((run_dir / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name(project)
    out = []
    for run in sorted(client.search_runs([experiment.experiment_id]), key=lambda r: r.info.start_time):
        metrics = {k: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, k))
                   for k in run.data.metrics}
        out.append({"name": run.info.run_name, "params": run.data.params, "tags": run.data.tags, "metrics": metrics})
    return out


def test_a_session_logs_config_metrics_and_events_and_a_roll_back_starts_another_wandb_run(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline by default: no network, no account
    run_dir = tmp_path / "grpo-run"
    trackers = Trackers.open(["console", "wandb", "mlflow"], run_dir, {"trainer": {"steps": 3}, "model": "tiny"},
                             "hybridlab")
    trackers.log(1, {"reward/mean": 0.25, "actor/grad_norm": 2, "skipped": True, "note": "x", "bad": float("nan")})
    trackers.log(2, {"reward/mean": 0.5})
    trackers.event("remap", {"roles_recreated": ["actor"]}, 2)
    trackers.event("phase", {"phase": "evaluate"}, 2)  # not a run event: not sent
    trackers.rewind(1)  # a roll-back to the checkpoint of step 1: steps 2... run again
    trackers.log(2, {"reward/mean": 0.75})
    trackers.close()

    # W&B's service process writes the offline files: on a loaded machine a file was once still
    # short of its records right after finish() (the full suite), so wait up to 30 s for each
    # run's exit record
    deadline = time.monotonic() + 30
    while not all(run["finished"] for run in wandb_runs(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    first, second = wandb_runs(run_dir)
    assert (first["name"], second["name"]) == ("grpo-run", "grpo-run (from step 1)")
    assert first["config"] == {"trainer": {"steps": 3}, "model": "tiny"}
    assert first["history"] == {1: {"reward/mean": 0.25, "actor/grad_norm": 2.0},
                                2: {"reward/mean": 0.5, "event/remap": 1.0}}
    assert second["history"] == {2: {"reward/mean": 0.75}}
    (run,) = mlflow_runs(run_dir)
    assert run["name"] == "grpo-run" and run["params"] == {"trainer.steps": "3", "model": "tiny"}
    assert run["metrics"] == {"reward.mean": [(1, 0.25), (2, 0.5), (2, 0.75)], "actor.grad_norm": [(1, 2.0)]}
    assert json.loads(run["tags"]["event.remap.step2"]) == {"roles_recreated": ["actor"]}
    assert not any(k.startswith("event.phase") for k in run["tags"])


def test_an_unknown_logger_is_named():
    assert logger_problems(["console", "neptune"]) == ["trainer.logger: 'neptune' not one of console, tensorboard,"
                                                      " wandb, mlflow"]
    assert logger_problems("wandb") == ["trainer.logger: a list of names from console, tensorboard, wandb, mlflow,"
                                        " got 'wandb'"]
    from hybridlab.config import ConfigError
    from hybridlab.run_config import load_config

    with pytest.raises(ConfigError, match="trainer.logger: 'neptune' not one of"):
        load_config(None, ["trainer.logger=[console,neptune]"])


def tensorboard_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Return every scalar of a run's TensorBoard event files, as TensorBoard reads them (purged
    steps hidden): tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_metrics_log_mirrors_each_steps_numbers_to_tensorboard_and_a_resume_hides_the_steps_after_its_checkpoint(
        tmp_path):
    from hybridlab.telemetry.metrics import MetricsLog

    log = MetricsLog(tmp_path)
    log.write(1, {"reward/mean": 0.25, "actor/grad_norm": 2, "skipped": True, "note": "x", "bad": float("nan")})
    log.write(2, {"reward/mean": 0.5, "actor/grad_norm": 3})
    log.write(3, {"reward/mean": 0.125})
    log.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["bad"] is None
    assert tensorboard_scalars(tmp_path) == {"reward/mean": [(1, 0.25), (2, 0.5), (3, 0.125)],
                                             "actor/grad_norm": [(1, 2.0), (2, 3.0)]}
    log = MetricsLog(tmp_path, purge_after=1)  # resumed from the checkpoint of step 1: steps 2 and 3 run again
    log.write(2, {"reward/mean": 0.75})
    log.close()
    assert tensorboard_scalars(tmp_path) == {"reward/mean": [(1, 0.25), (2, 0.75)], "actor/grad_norm": [(1, 2.0)]}
