"""`hybridlab train` end to end in its own process: warm start, RL steps, run directory."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile


def test_train_command_writes_the_run_directory(tmp_path):
    run_dir = tmp_path / "run"
    ray_tmp = tempfile.mkdtemp(prefix="hlray-", dir="/tmp")
    try:
        out = subprocess.run(
            [sys.executable, "-m", "hybridlab.cli", "train", f"trainer.run_dir={run_dir}", "trainer.steps=2",
             "warm_start.steps=20", "data.test_samples=16", "data.prompts_per_step=8", "rollout.n=4",
             "actor.ppo_mini_batch_size=8", "trainer.eval_every=1", "--ray-temp-dir", ray_tmp],
            capture_output=True, text=True, timeout=600, env={**os.environ, "TQDM_DISABLE": "1"})
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"run directory: {run_dir}" in out.stdout and "summary.json" in out.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert 0 <= summary["accuracy_before"] <= 1 and 0 <= summary["accuracy_after"] <= 1
    assert summary["steps"] == 2 and summary["algorithm"] == "grpo" and summary["eval_n"] == 16
    assert [p["step"] for p in summary["eval_curve"]] == [0, 1, 2]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "reward/mean" in line]
    assert [line["step"] for line in steps] == [1, 2]
    assert (run_dir / "config.yaml").is_file() and (run_dir / "warm_start" / "config.json").is_file()
