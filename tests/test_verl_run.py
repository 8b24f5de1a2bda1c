"""A verl run script run by hybridlab: ``tests/verl_scripts/grpo_gsm8k.sh`` (verl's GRPO-on-GSM8K
example's knobs and key arrays, ``hybridlab train`` in place of ``main_ppo``) on the tiny Qwen
checkpoint and a small GSM8K-format parquet, its knobs set for size and two steps asked for in
its ``"$@"``: it evaluates and saves on schedule under verl's metric names, then a second run of
the same script resumes from the checkpoint (verl's ``resume_mode=auto``)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridlab.tasks.dataset import write_rows

SCRIPT = Path(__file__).parent / "verl_scripts" / "grpo_gsm8k.sh"


def repeatable(line: dict) -> dict:
    """A metrics line without what measures time or the machine's load."""
    return {k: v for k, v in line.items() if k != "time" and not k.startswith(("timing", "perf/", "busy/", "device/"))
            and not k.endswith(("seconds", "_s"))}


def records(run_dir: Path) -> dict:
    """The run directory's checkpoints and metrics lines, as they stand now."""
    return {"checkpoints": sorted(p.name for p in (run_dir / "checkpoints").iterdir()),
            "lines": [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]}


@pytest.fixture(scope="module")
def verl_runs(ray_address, tiny_dir, tmp_path_factory):
    """The script run for two steps, then again for three with 4 sampled validation answers per
    prompt, then the third step again from the first run's older checkpoint into a new directory
    (the first run's trainer.default_local_dir then holds step 3); returns the three processes, the
    run directory and its records after the first run."""
    root = tmp_path_factory.mktemp("verl")
    rows = [{"prompt": [{"role": "user", "content": f"Tom has {i} apples and buys {i} more. How many now?"}],
             "data_source": "openai/gsm8k", "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
             "extra_info": {"index": i}} for i in range(24)]
    knobs = {"MODEL_PATH": str(tiny_dir), "TRAIN_FILE": str(write_rows(rows, root / "train.parquet")),
             "TEST_FILE": str(write_rows(rows[:8], root / "test.parquet")), "NGPUS_PER_NODE": "1",
             "TRAIN_BATCH_SIZE": "8", "PPO_MINI_BATCH_SIZE": "4", "ROLLOUT_N": "4", "ROLLOUT_TP": "1",
             "MAX_PROMPT_LENGTH": "64", "MAX_RESPONSE_LENGTH": "12", "TEST_FREQ": "1", "SAVE_FREQ": "1",
             "VERL_USE_UV": "0"}
    env = {**os.environ, **knobs, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "TQDM_DISABLE": "1"}
    run_dir = root / "checkpoints"

    def run(steps: int, *more: str) -> subprocess.CompletedProcess:
        done = subprocess.run(["bash", str(SCRIPT), f"trainer.total_training_steps={steps}",
                               f"trainer.default_local_dir={run_dir}", "trainer.progress=false", *more],
                              cwd=root, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        return done

    first = run(2)
    after_first = records(run_dir)
    sampled = [f"actor_rollout_ref.rollout.val_kwargs.{k}" for k in ("do_sample=True", "temperature=1.0", "n=4")]
    second = run(3, *sampled)  # resumed with sampled validation
    # the same again from the older checkpoint, into a new directory (verl's resume_path)
    branch = run(3, *sampled, "trainer.resume_mode=resume_path",
                 f"trainer.resume_from_path={run_dir}/checkpoints/step-000002", f"trainer.default_local_dir={root}/branch")
    return first, second, run_dir, after_first, branch


def test_the_script_trains_evaluates_and_saves_on_schedule(verl_runs):
    first, _, run_dir, after_first, _ = verl_runs
    assert after_first["checkpoints"] == ["step-000001", "step-000002"]  # save_freq=1
    lines = after_first["lines"]
    assert [line["step"] for line in lines if "eval/accuracy" in line] == [0, 1, 2]  # before, then test_freq=1
    assert [line["step"] for line in lines if "reward/mean" in line] == [1, 2]
    assert "ignored verl settings: " in first.stdout
    for key in ("data.max_prompt_length", "actor_rollout_ref.model.enable_gradient_checkpointing",
                "actor_rollout_ref.rollout.gpu_memory_utilization", "actor_rollout_ref.ref.fsdp_config.param_offload"):
        assert f"{key} (" in first.stdout
    assert f"run directory: {run_dir}" in first.stdout
    config = json.loads((run_dir / "summary.json").read_text())["config"]  # the second run's, resumed
    assert (config["actor"]["lr"], config["actor"]["weight_decay"], config["actor"]["micro_batch_tokens"]) == \
        (1e-6, 0.01, 3000)
    assert (config["actor"]["use_kl_loss"], config["rollout"]["n"], config["data"]["prompts_per_step"]) == (True, 4, 8)
    assert config["trainer"]["logger"] == ["console", "wandb"] and config["name"] == "qwen3_4b_function_rm"


def test_it_resumes_with_resume_mode_auto_and_logs_verls_metric_names(verl_runs):
    _, second, run_dir, _, _ = verl_runs
    assert f"resuming {run_dir} from step-000002" in second.stdout
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-000002", "step-000003"]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evaluated = [line["step"] for line in lines if "eval/accuracy" in line]
    assert evaluated == [0, 1, 2, 3]  # before the first step, then every step (test_freq=1), on through the resume
    evals = [line for line in lines if "eval/accuracy" in line]
    assert all("val-core/openai/gsm8k/reward/mean@1" in line for line in evals[:3])
    # the resumed run samples 4 answers per prompt (val_kwargs): verl's entries at N = 4, GSM8K's bare
    # score naming the core ones
    core, aux = "val-core/openai/gsm8k/reward/", "val-aux/openai/gsm8k/reward/"
    assert sorted(k.removeprefix(core) for k in evals[3] if k.startswith("val-core/")) == \
        ["best@4/mean", "best@4/std", "mean@4"]
    assert {k.removeprefix(aux) for k in evals[3] if k.startswith("val-aux/")} == {"std@4", "best@2/mean", "best@2/std", "worst@2/mean", "worst@2/std", "worst@4/mean", "worst@4/std"}
    assert evals[3]["val-core/openai/gsm8k/reward/mean@4"] == pytest.approx(evals[3]["eval/accuracy"], abs=1e-12)
    steps = [line for line in lines if "reward/mean" in line]
    assert [line["step"] for line in steps] == [1, 2, 3]
    assert all(line["critic/score/mean"] == line["reward/mean"] for line in steps)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["stopped_by"] == "steps"


def test_resume_path_goes_on_from_an_older_checkpoint_in_a_new_directory_as_the_run_did(verl_runs):
    _, _, run_dir, after_first, branch = verl_runs
    root = run_dir.parent
    assert f"{root / 'branch'} starts from {run_dir}/checkpoints/step-000002" in branch.stdout
    assert f"resuming {root / 'branch'} from step-000002" in branch.stdout
    assert sorted(p.name for p in (root / "branch" / "checkpoints").iterdir()) == ["step-000002", "step-000003"]
    ran = [repeatable(json.loads(line)) for line in (root / "branch" / "metrics.jsonl").read_text().splitlines()]
    before = [repeatable(line) for line in after_first["lines"]]
    assert ran[:len(before)] == before  # the first run's records up to its step 2, then step 3 again
    resumed = [repeatable(json.loads(line)) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert ran == resumed  # step 3 and its sampled validation, exactly as the in-place resume ran them
