"""The kernel's warm pool (controller/warm_pool.py): fresh, pre-imported worker processes that
outlive a session; the next session of the same Python process adopts them."""
from __future__ import annotations

import json
import re
import sys
import time

import pytest
import torch

from hybridlab.controller.warm_pool import set_warm_processes, warm_pool
from hybridlab.controller.worker import library_module
from hybridlab.dataflow.session import RLSession
from hybridlab.telemetry.hub import TELEMETRY_FILE

SETTINGS = ["warm_start.max_steps=0", "data.prompts_per_step=8", "rollout.n=4", "rollout.max_new_tokens=6",
            "actor.ppo_mini_batch_size=8", "data.test_samples=8", "trainer.progress=false", "trainer.save_every=0",
            "trainer.eval_every=0"]
COMPARED = ("responses", "response_mask", "rollout_log_probs", "token_level_scores", "advantages")


def repeatable(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith(("timing/", "perf/", "sync/")) and k != "warnings"}


def worker_pids(rl) -> set[int]:
    return {p["pid"] for group in rl.workers.groups.values() for p in group.placements}


def test_a_session_on_adopted_processes_takes_the_first_step_of_one_started_cold(ray_local, trained_dir, tmp_path):
    settings = [f"model={trained_dir}", *SETTINGS]
    set_warm_processes(1)
    try:
        with RLSession(None, [*settings, f"trainer.run_dir={tmp_path / 'cold'}"]) as cold:
            cold_pids = worker_pids(cold)
            first_cold = cold.step()
            # the pool filled once the workers were built: one process, warmed up beside the session,
            # shown on the dashboard's System section as a device sample of its own
            assert warm_pool().pool().wait_ready(timeout=600) == 1
            (spare,) = warm_pool().processes()
            assert spare["pid"] not in cold_pids  # never ran a worker
            deadline = time.monotonic() + 30
            while True:
                cold.telemetry.flush()
                records = [json.loads(line) for line in (cold.run_dir / TELEMETRY_FILE).read_text().splitlines()]
                pool = [r for r in records if r.get("kind") == "device" and r.get("role") == "warm pool"]
                if pool or time.monotonic() > deadline:
                    break
                time.sleep(1)
            assert pool and pool[-1]["processes"] == 1 and pool[-1]["rss_mb"] > 100  # torch and the engines loaded
        taken = warm_pool().spares.taken
        with RLSession(None, [*settings, f"trainer.run_dir={tmp_path / 'warm'}"]) as warm:
            assert warm_pool().spares.taken == taken + 1
            assert worker_pids(warm) == {spare["pid"]}  # the session's one process is the adopted one
            first_warm = warm.step()
    finally:
        set_warm_processes(0)
    assert warm_pool().processes() == []  # turned off: its processes stopped
    # the first step on the adopted process is the cold session's, bit for bit
    assert repeatable(first_warm.metrics) == repeatable(first_cold.metrics)
    for field in COMPARED:
        assert torch.equal(first_warm.batch[field], first_cold.batch[field]), field


def test_warm_processes_import_libraries_but_never_a_users_own_modules(tmp_path, monkeypatch):
    import importlib

    import json as stdlib
    import torch.nn

    import hybridlab.workers.rollout.worker
    import tests.agent_functions

    (tmp_path / "my_reward.py").write_text("def score(*a):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    mine = importlib.import_module("my_reward")
    try:
        assert [library_module(m) for m in (stdlib, torch.nn, hybridlab.workers.rollout.worker, sys)] == [True] * 4
        assert [library_module(m) for m in (mine, tests.agent_functions)] == [False, False]
    finally:
        sys.modules.pop("my_reward", None)


@pytest.mark.parametrize("bad", [-1, 1.5, "2", True])
def test_a_bad_pool_size_is_refused_by_name(bad):
    with pytest.raises(ValueError, match=re.escape(f"warm processes must be a whole number >= 0, got {bad!r}")):
        set_warm_processes(bad)
