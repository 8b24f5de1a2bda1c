"""Session start-up in a notebook kernel: the first start against the next, on the warm pool.

Each model runs in a Python process of its own, as a fresh kernel would, with three starts of
``RLSession("grpo", ["warm_start.max_steps=0", ...])`` one after the other (each shut down before
the next; the Ray connection stays, as in a kernel):

- ``first_start_s``: the process's first start (Ray's local cluster started too; the kernel's
  warm pool, controller/warm_pool.py, starts filling once the workers are built);
- ``second_start_s``: the next start, once the pool's processes have warmed up (what a user
  gets who starts another session after looking at the first): it adopts them;
- ``no_pool_start_s``: a third start with the pool off, the same work as the second without it.

Goal: the second start at most half the first (``second_over_first`` <= 0.5). ``pool_speedup``
(``no_pool_start_s / second_start_s``) is the pool's own share of the gain, the rest being Ray's
start and the first imports in the controller. Later starts find warmer file caches, so the
third start, without the pool, is favoured if anything.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hybridlab.environment import processor, processor_family
from hybridlab.errors import UserError

GOAL = 0.5


def _three_starts(model: str, workdir: Path) -> dict:
    """Start three sessions of ``model`` in this process (see the module docstring); returns the figures."""
    from hybridlab.controller.warm_pool import set_warm_processes, warm_pool
    from hybridlab.dataflow.session import RLSession

    settings = ["warm_start.max_steps=0", f"model={model}", "trainer.progress=false"]
    figures: dict = {}
    for name in ("first", "second", "no_pool"):
        rl = RLSession("grpo", [*settings, f"trainer.run_dir={workdir / name}"])
        if name == "first":  # a pool for as many processes as the session has; it fills once they are built
            figures["processes"] = len(list(rl.mapping.process_sets()))
            set_warm_processes(figures["processes"])
        elif name == "no_pool":
            set_warm_processes(0)
        taken_before = warm_pool().spares.taken if warm_pool().spares is not None else 0
        start = time.perf_counter()
        rl.start()
        figures[f"{name}_start_s"] = round(time.perf_counter() - start, 3)
        if name == "second":
            figures["adopted"] = warm_pool().spares.taken - taken_before
        rl.shutdown()
        if name == "first":  # a user looks at the first session before starting the next
            figures["pool_ready"] = warm_pool().pool().wait_ready(timeout=600)
    return figures


def run(models: str = "tiny,small") -> dict:
    """Return, per model, ``first_start_s``, ``second_start_s``, ``no_pool_start_s``, the ratios
    ``second_over_first`` and ``pool_speedup``, the processes adopted, and ``goal_met``; with the
    processor."""
    names = [m.strip() for m in str(models).split(",") if m.strip()]
    if not names:
        raise UserError(f"benchmark start: models must be zoo names or paths separated by commas, got {models!r}")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for model in names:
            code = ("import json, sys; from pathlib import Path; from hybridlab.bench.start import _three_starts;"
                    f" print('BENCH-START ' + json.dumps(_three_starts({model!r}, Path({tmp!r}) / {model!r})))")
            child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
            line = next((x for x in child.stdout.splitlines() if x.startswith("BENCH-START ")), None)
            if child.returncode != 0 or line is None:
                raise RuntimeError(f"benchmark start on {model}: the measuring process failed:\n{child.stderr[-3000:]}")
            r = json.loads(line.removeprefix("BENCH-START "))
            r["second_over_first"] = round(r["second_start_s"] / r["first_start_s"], 3)
            r["pool_speedup"] = round(r["no_pool_start_s"] / r["second_start_s"], 3)
            r["goal_met"] = r["second_over_first"] <= GOAL
            results[model] = r
    return {"benchmark": "start", "processor": processor(), "processor_family": processor_family(),
            "models": results, "goal_second_over_first": GOAL,
            "goal_met": all(r["goal_met"] for r in results.values())}
