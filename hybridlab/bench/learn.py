"""The default run's promise, per seed: ``hybridlab train`` (GRPO on arith, tiny model, warm
start to its held-out target) for each seed, each in its own process as a user runs it.

Reports, per seed, greedy test accuracy before and after RL, the gain in points, the warm
start's steps and held-out accuracy, and the seconds the whole command took; with the
processor, since seeded runs repeat bit for bit only on the same processor and thread count.
The goal (issue 13): a gain of at least 20 points, the whole command within 10 minutes, for
every seed. A benchmark, not a test: three seeds take about half an hour on 2 cores.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hybridlab.environment import describe, usable_cores
from hybridlab.errors import UserError

GOAL_POINTS = 20.0
GOAL_SECONDS = 600.0


def _seeds(seeds) -> list[int]:
    text = str(seeds)
    try:
        out = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise UserError(f"benchmark learn: seeds must be integers separated by commas, e.g. 0,1,2; got {text!r}") \
            from None
    if not out:
        raise UserError("benchmark learn: give at least one seed, e.g. --seeds 0,1,2")
    return out


def curves(run_dir: Path) -> dict:
    """Return the run's greedy test accuracy by step (``curve``), by samples trained
    (``curve_samples``: steps x data.prompts_per_step x rollout.n, from the run's config.yaml)
    and by seconds since the first RL step began (``curve_seconds``: the first step's line time
    less its step time), and for agent runs the share of trajectories that called a tool, first
    and last step (``tool_call_share``)."""
    import yaml

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    per_step = cfg["data"]["prompts_per_step"] * cfg["rollout"]["n"]
    steps = [r for r in records if "timing/step_s" in r]
    start = steps[0]["time"] - steps[0]["timing/step_s"] if steps else 0.0
    evals = [r for r in records if "eval/accuracy" in r]
    out: dict = {"curve": [[r["step"], round(r["eval/accuracy"], 4)] for r in evals],
                 "curve_samples": [[r["step"] * per_step, round(r["eval/accuracy"], 4)] for r in evals],
                 "curve_seconds": [[round(max(r["time"] - start, 0.0), 1), round(r["eval/accuracy"], 4)]
                                   for r in evals]}
    shares = [r["agent/tool_call_share"] for r in records if "agent/tool_call_share" in r]
    if shares:
        out["tool_call_share"] = {"first": shares[0], "last": shares[-1]}
    return out


def run_seed(seed: int, overrides: list[str], workdir: Path, config: str | None = None) -> dict:
    """Run ``hybridlab train`` (the default run, or ``config``) with ``trainer.seed=seed`` in a
    child process; returns its figures (the run directory is kept under ``workdir``)."""
    run_dir = workdir / f"seed{seed}"
    ray_tmp = tempfile.mkdtemp(prefix="hlray-", dir="/tmp")
    start = time.perf_counter()
    try:
        out = subprocess.run([sys.executable, "-m", "hybridlab.cli", "train", *([config] if config else []),
                              f"trainer.seed={seed}",
                              f"trainer.run_dir={run_dir}", "trainer.progress=false", *overrides,
                              "--ray-temp-dir", ray_tmp], capture_output=True, text=True)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    seconds = time.perf_counter() - start
    if out.returncode != 0:
        return {"seed": seed, "error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "failed",
                "seconds": round(seconds, 1), "run_dir": str(run_dir)}
    s = json.loads((run_dir / "summary.json").read_text())
    gain = 100 * (s["accuracy_after"] - s["accuracy_before"])
    warm = s.get("warm_start") or {}
    return {"seed": seed, "accuracy_before": s["accuracy_before"], "accuracy_after": s["accuracy_after"],
            "gain": round(gain, 1), "seconds": round(seconds, 1), "rl_steps": s["steps"],
            "rl_seconds": s["rl_seconds"], "warm_start_steps": warm.get("steps"),
            "warm_start_held_out_accuracy": warm.get("held_out_accuracy"),
            "warm_start_seconds": warm.get("seconds"), "stopped_by": s["stopped_by"],
            "processor": s["environment"]["processor"], "run_dir": str(run_dir), **curves(run_dir)}


def run(seeds="0,1,2", out: str | None = None, overrides: str = "", config: str | None = None,
        goal_points: float = GOAL_POINTS) -> dict:
    """Return ``{"processor", "runs": [per seed], "gain_min", "seconds_max", "goal_met"}``;
    ``out`` keeps the run directories (default: a temporary folder), ``overrides`` adds
    ``key=value`` settings separated by spaces (e.g. to try another recipe), ``config`` runs a
    preset or YAML file instead of the default run (e.g. ``agent_calc``), ``goal_points`` is the
    gain every seed must reach (the reasoning-gym recipe's goal is 15)."""
    seed_list = _seeds(seeds)
    extra = overrides.split() if overrides else []
    workdir = Path(out) if out else Path(tempfile.mkdtemp(prefix="hybridlab-learn-"))
    workdir.mkdir(parents=True, exist_ok=True)
    runs = []
    for seed in seed_list:
        runs.append(run_seed(seed, extra, workdir, config))
        print(json.dumps(runs[-1]), file=sys.stderr, flush=True)  # progress while the others run
    ok = [r for r in runs if "error" not in r]
    env = describe()
    return {
        "benchmark": "learn", "processor": env["processor"], "threads": usable_cores(),
        "packages": env["packages"], "config": config, "seeds": seed_list, "overrides": extra, "runs": runs,
        "gain_min": min((r["gain"] for r in ok), default=None),
        "seconds_max": max((r["seconds"] for r in runs), default=None),
        "goal": {"gain_points": float(goal_points), "seconds": GOAL_SECONDS},
        "goal_met": len(ok) == len(runs) and all(r["gain"] >= float(goal_points) and r["seconds"] <= GOAL_SECONDS
                                                 for r in ok),
        "workdir": str(workdir),
    }
