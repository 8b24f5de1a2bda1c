"""Soak: a long run of the small model, watched for what grows when it should not.

``hybridlab bench soak --json``: GRPO steps (default 300) with a checkpoint every 50, sampling
after every step the resident memory (RSS) of each worker process and of the controller, the
open file descriptors, and the telemetry file's size. Reported per process: the RSS slope after
warm-up (least squares, MB per 100 steps, and as a share of its RSS); the goal is a slope of at
most 1% of RSS per 100 steps for every process (``goal_met``). Also: telemetry bytes per step,
descriptors at the start and the end, and the seconds each checkpoint took.
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

from hybridlab.dataflow.session import RLSession
from hybridlab.environment import processor
from hybridlab.errors import UserError
from hybridlab.models.zoo import resolve_model
from hybridlab.telemetry.hub import TELEMETRY_FILE
from hybridlab.telemetry.memory import LEAK_PCT_PER_100_STEPS as GOAL_PCT_PER_100_STEPS
from hybridlab.telemetry.memory import slope_per_100


def _rss_mb(pid: int) -> float:
    """Return the resident memory of process ``pid`` in MB (from /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _fds(pid: int) -> int:
    """Return how many file descriptors process ``pid`` has open."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def _settings(model: str, run_dir: str) -> list[str]:
    return [f"model={model}", "warm_start.max_steps=0", "data.prompts_per_step=8", "rollout.n=4",
            "rollout.max_new_tokens=16", "actor.ppo_mini_batch_size=8", "trainer.progress=false",
            "trainer.eval_every=0", "trainer.save_every=0", "trainer.keep_checkpoints=2", "data.test_samples=8",
            f"trainer.run_dir={run_dir}"]


def run(model: str = "small", steps: int = 300, save_every: int = 50, warmup: int = 50) -> dict:
    """Run the soak and return its figures (see the module docstring), with the processor."""

    if steps <= warmup + 10:
        raise UserError(f"steps ({steps}) must exceed warmup ({warmup}) by more than 10 to fit a slope")
    with tempfile.TemporaryDirectory() as tmp:
        rl = RLSession(None, _settings(str(resolve_model(model)), f"{tmp}/run"))
        try:
            rl.start()
            processes = {",".join(g.hostset.roles): p["pid"] for g in rl.workers.groups.values()
                         for p in g.placements}
            processes["controller"] = os.getpid()
            rss: dict[str, list[float]] = {name: [] for name in processes}
            fds_start = {name: _fds(pid) for name, pid in processes.items()}
            telemetry = rl.run_dir / TELEMETRY_FILE
            rl.telemetry.flush()  # the records sent so far, on disk
            telemetry_start = telemetry.stat().st_size
            checkpoint_s, step_s = [], []
            for step in range(1, steps + 1):
                t0 = time.perf_counter()
                rl.step()
                step_s.append(time.perf_counter() - t0)
                if step % save_every == 0:
                    t0 = time.perf_counter()
                    rl.save_checkpoint()
                    checkpoint_s.append(round(time.perf_counter() - t0, 3))
                for name, pid in processes.items():
                    rss[name].append(_rss_mb(pid))
                if step % 50 == 0:
                    print(f"soak: step {step}/{steps}", flush=True)
            fds_end = {name: _fds(pid) for name, pid in processes.items()}
            rl.telemetry.flush()
            telemetry_bytes = telemetry.stat().st_size - telemetry_start
            restarts = rl.state.worker_restarts
        finally:
            rl.shutdown()
    per_process = {name: {**rss_figures(values, warmup), "fds_start": fds_start[name], "fds_end": fds_end[name]}
                   for name, values in rss.items()}
    return {"benchmark": "soak", "model": model, "processor": processor(), "steps": steps, "warmup_steps": warmup,
            "save_every": save_every, "median_step_s": round(statistics.median(step_s), 3),
            "processes": per_process, "telemetry_bytes_per_step": round(telemetry_bytes / steps),
            "checkpoint_s": checkpoint_s, "worker_restarts": restarts,
            "goal_pct_per_100_steps": GOAL_PCT_PER_100_STEPS, "goal_met": goal_met(per_process)}


def rss_figures(values: list[float], warmup: int) -> dict:
    """Return one process's RSS figures from its per-step samples (MB; step k's sample at index
    k - 1): first and last sample, and the least-squares slope over the steps after ``warmup``,
    in MB and as a percentage of the mean RSS over those steps, per 100 steps."""
    after = values[warmup:]
    slope = slope_per_100(list(range(warmup + 1, warmup + 1 + len(after))), after)
    return {"rss_mb_start": round(values[0], 1), "rss_mb_end": round(values[-1], 1),
            "slope_mb_per_100_steps": round(slope, 3),
            "slope_pct_per_100_steps": round(100 * slope / statistics.fmean(after), 3)}


def goal_met(per_process: dict[str, dict]) -> bool:
    """Return whether every process's RSS slope is at most the goal's share of its RSS per 100 steps."""
    return all(p["slope_pct_per_100_steps"] <= GOAL_PCT_PER_100_STEPS for p in per_process.values())
