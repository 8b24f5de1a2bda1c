"""Dead and stuck workers on the real engines (tiny model; actor, rollout and reward in their own
processes): a worker killed with SIGKILL from outside (actor, rollout, ref, critic) is re-created
on its placement and the step runs again with the numbers it would have had; a hanging reward
function is reported as stuck with its stack written, re-created, and the run goes on;
`trainer.max_restarts` stops it."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from browser import LAUNCH_ARGS, chromium

from hybridlab.dataflow.recovery import WorkerLost
from hybridlab.dataflow.session import RLSession
from hybridlab.telemetry.dashboard import STUCK_ALARM
from hybridlab.telemetry.hub import TELEMETRY_FILE

SETTINGS = ["warm_start.max_steps=0", "data.prompts_per_step=8", "rollout.n=4", "rollout.max_new_tokens=6",
            "actor.ppo_mini_batch_size=8", "data.test_samples=8", "trainer.progress=false", "trainer.save_every=0",
            "trainer.eval_every=0", "trainer.max_restarts=10"]
SPLIT = {"pools": {"train": {"devices": 1}, "gen": {"devices": 1}},
         "roles": {"actor": {"pool": "train"}, "rollout": {"pool": "gen"}, "reward": {"pool": "gen"}}}


@pytest.fixture(scope="module")
def rl(ray_local, trained_dir, tmp_path_factory):
    session = RLSession(None, [f"model={trained_dir}", *SETTINGS, f"mapping={json.dumps(SPLIT)}",
                               f"trainer.run_dir={tmp_path_factory.mktemp('faults') / 'run'}"]).start()
    yield session
    session.shutdown()


@contextlib.contextmanager
def served_page(rl):
    """Yield a headless Chromium page on the run's served dashboard (closed and stopped after)."""
    from playwright.sync_api import sync_playwright

    from hybridlab.telemetry.serving import serve

    browser_path = chromium()
    server, port = serve(rl.run_dir, port=0, threaded=True)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=browser_path, headless=True, args=LAUNCH_ARGS)
            page = browser.new_page()
            page.goto(f"http://localhost:{port}/", timeout=60_000)
            yield page
            browser.close()
    finally:
        server.stop()


def telemetry(rl, kind: str) -> list[dict]:
    """Return the run's telemetry records of ``kind``, in order."""
    lines = (rl.run_dir / TELEMETRY_FILE).read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == kind]


def pids(rl, role: str) -> list[int]:
    return [p["pid"] for p in rl.workers.groups[role].placements]


def kill(rl, role: str) -> None:
    for pid in pids(rl, role):
        os.kill(pid, signal.SIGKILL)


def repeatable(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith(("timing/", "perf/", "sync/", "faults/"))
            and k != "warnings"}


def test_a_killed_actor_rolls_back_to_the_checkpoint_and_the_step_repeats_exactly(rl):
    rl.step()
    rl.save_checkpoint()
    reference = rl.step().metrics
    actor, rollout = pids(rl, "actor"), pids(rl, "rollout")
    kill(rl, "actor")
    again = rl.step()
    assert again.step == 2 and rl.state.step_count == 2          # rolled back to step 1, step 2 run again
    assert repeatable(again.metrics) == repeatable(reference)
    assert again.metrics["faults/worker_restarts"] == 1
    assert pids(rl, "actor") != actor and pids(rl, "rollout") == rollout  # only the dead role is new
    event = rl.state.restarts[-1]
    assert (event["role"], event["failure"], event["recreated"], event["rolled_back_to"]) == ("actor", "died", ["actor"], 1)
    steps = [json.loads(line)["step"] for line in (rl.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]  # the step logged before the kill was cut and logged again, once


def test_a_killed_rollout_is_recreated_resynced_and_its_step_repeats_exactly(rl):
    if rl.state.step_count == 0:  # run alone: a step first, so that the rollout holds trained weights to lose
        rl.step()
    step, restarts = rl.state.step_count, rl.state.worker_restarts
    rl.save_checkpoint()
    actor, reward = pids(rl, "actor"), pids(rl, "reward")
    kill(rl, "rollout")
    killed = rl.step()                          # generate fails; nothing was updated: the step runs again
    prompts_after = rl.state.prompts.state()
    event = rl.state.restarts[-1]
    assert (event["role"], event["failure"], event["recreated"], event["rolled_back_to"]) == \
        ("rollout", "died", ["rollout"], None)
    assert pids(rl, "actor") == actor and pids(rl, "reward") == reward
    assert killed.step == step + 1 and killed.metrics["faults/worker_restarts"] == restarts + 1
    # the same step without the kill: roll back to the checkpoint by killing the actor, run the step again
    kill(rl, "actor")
    reference = rl.step()
    assert rl.state.restarts[-1]["rolled_back_to"] == step and reference.step == step + 1
    assert repeatable(killed.metrics) == repeatable(reference.metrics)
    assert rl.state.prompts.state() == prompts_after  # the retried step took its prompts once


HANG = '''
import pathlib, time
from hybridlab.workers.reward.scoring import RuleScorer

RULES = RuleScorer()


def score(data_source, solution_str, ground_truth, extra_info=None):
    marker = pathlib.Path({marker!r})
    if not marker.exists():
        marker.write_text("hung once")
        time.sleep(3600)  # a reward function that never returns
    return RULES(data_source, solution_str, ground_truth, extra_info)
'''


def test_a_hanging_reward_call_is_reported_stuck_with_its_stack_and_the_run_goes_on(rl, tmp_path):
    path = tmp_path / "hang_reward.py"
    path.write_text(HANG.format(marker=str(tmp_path / "hung")))
    rl.update(f"reward.function={path}:score", "reward.kind=function", "reward.timeout_s=0",
              "trainer.call_deadline_s=10")
    restarts = rl.state.worker_restarts
    start = time.time()
    with served_page(rl) as page:  # the dashboard's Stuck calls section, in a browser, while it hangs
        page.get_by_text("Stuck calls", exact=True).wait_for(timeout=60_000)  # not alarmed: nothing is late
        assert page.get_by_text(STUCK_ALARM).count() == 0
        stepping = ThreadPoolExecutor(1).submit(rl.step)
        page.get_by_text(STUCK_ALARM).wait_for(timeout=60_000)  # the reward call went past its deadline
        result = stepping.result(timeout=600)
        page.get_by_text("Stuck calls", exact=True).wait_for(timeout=30_000)  # the call ended: no alarm
    assert time.time() - start >= 10  # waited for the deadline, not less
    event = rl.state.restarts[-1]
    assert (event["role"], event["method"], event["failure"], event["rolled_back_to"]) == \
        ("reward", "compute_reward", "stuck", None)
    assert result.metrics["faults/worker_restarts"] == restarts + 1
    assert (tmp_path / "hung").read_text() == "hung once"
    stacks = sorted((rl.run_dir / "stacks").glob("*-reward-compute_reward-rank0-pid*.txt"))
    assert len(stacks) == 1
    text = stacks[0].read_text()
    assert "hang_reward.py" in text and "in score" in text  # where it hung, from the stuck process
    assert rl.running() == []  # nothing in flight between steps
    # the call was shown late until the reward process was replaced (stacks, then a 2 s close):
    # longer than the reporter's and the dashboard's 1 s polls, so no viewer can miss it
    running = telemetry(rl, "running")
    first = next(i for i, r in enumerate(running) if any(c["late"] for c in r["calls"]))
    assert running[first]["time"] >= start + 10 and running[first + 1]["calls"] == []
    assert running[first + 1]["time"] - running[first]["time"] >= 2.0
    rl.update("trainer.call_deadline_s=0")


PPO = {"pools": {"train": {"devices": 1}, "gen": {"devices": 1}},
       "roles": {"actor": {"pool": "train"}, "critic": {"pool": "train"}, "ref": {"pool": "train"},
                 "rollout": {"pool": "gen"}, "reward": {"pool": "gen"}}}
PPO_FLOW = ("[generate, reward, rollout_as_old_logprob, ref_logprob, values, kl_reward, advantages, update_critic,"
            " update_actor, sync_weights]")


def test_a_killed_critic_rolls_back_and_a_killed_ref_is_recreated_with_the_models_weights(rl, trained_dir):
    from tests.test_train import hf_logprobs

    rl.update(f"mapping={json.dumps(PPO)}", "algorithm.adv_estimator=gae", "algorithm.use_kl_in_reward=true",
              "critic.ppo_mini_batch_size=8", f"dataflow={PPO_FLOW}")
    rl.step()
    rl.save_checkpoint()
    step, critic, actor = rl.state.step_count, pids(rl, "critic"), pids(rl, "actor")
    clean = rl.step()  # the step without a fault: what the critic's case must repeat
    assert {"critic/values_mean", "critic/vf_loss", "actor/reward_kl_penalty"} <= set(clean.metrics)
    kill(rl, "critic")
    again = rl.step()  # the critic's state is lost: back to the checkpoint, the step since run again
    assert (rl.state.restarts[-1]["role"], rl.state.restarts[-1]["rolled_back_to"]) == ("critic", step)
    assert rl.state.step_count == step + 1 and pids(rl, "critic") != critic and pids(rl, "actor") == actor
    # the seeded step gives the clean run's numbers (values, KL reward, critic and actor losses)
    assert again.step == clean.step == step + 1
    assert repeatable(again.metrics) == repeatable(clean.metrics)
    restarts = again.metrics["faults/worker_restarts"]
    kill(rl, "ref")
    retried = rl.step()  # ref_logprob fails before any update: the step runs again, nothing rolled back
    assert (rl.state.restarts[-1]["role"], rl.state.restarts[-1]["rolled_back_to"]) == ("ref", None)
    assert retried.step == rl.state.step_count == step + 2 and retried.metrics["faults/worker_restarts"] == restarts + 1
    # the re-created reference holds the model it was built from: its log-probs are transformers' on it
    b = retried.batch
    mask = b["response_mask"].bool()
    assert (b["ref_log_prob"].double() - hf_logprobs(trained_dir, b))[mask].abs().max() < 1e-4


def test_max_restarts_stops_the_run_naming_the_worker_with_a_checkpoint(rl, monkeypatch):
    from hybridlab.dataflow.checkpoints import checkpoint_dirs

    if rl.state.worker_restarts == 0:  # run alone: a restart first, so that the limit counts one
        kill(rl, "rollout")
        rl.step()
    assert rl.state.worker_restarts > 0
    rl.update(f"trainer.max_restarts={rl.state.worker_restarts}")
    step = rl.state.step_count
    monkeypatch.setenv("HYBRIDLAB_FAULT", f"kill:rollout:generate@{step + 2}")  # the driver kills it then
    summary = rl.train(steps=3)
    assert summary["failed"] is True and summary["steps"] == step + 1
    assert summary["stopped_by"] == (f"worker rollout rank 0 died in generate during step {step + 2}, after"
                                     f" {rl.state.worker_restarts} restart(s) already (trainer.max_restarts="
                                     f"{rl.state.worker_restarts}); the run stops")
    assert checkpoint_dirs(rl.run_dir)[-1].name == f"step-{step + 1:06d}"  # the last finished step is saved
    with pytest.raises(WorkerLost, match="worker rollout rank 0 died in generate"):
        rl.step()  # stepping by hand: the same error
    records = [json.loads(line) for line in (rl.run_dir / "telemetry.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in records if r["kind"] == "restart"] == ["restart"] * rl.state.worker_restarts


def test_the_dashboard_marks_each_restart_and_keeps_each_step_once(rl):
    from hybridlab.telemetry.dashboard import Dashboard

    if not rl.state.restarts:  # run alone: a restart for the page to mark
        rl.save_checkpoint()
        kill(rl, "actor")
        rl.step()
    board = Dashboard(rl.run_dir)
    board.update()
    # every restart the session made, in order (in the whole module: actor, rollout, actor, reward stuck,
    # critic, ref); the death that stopped the run under max_restarts is not one
    assert [(r["role"], r["failure"]) for r in board.restarts] == [(r["role"], r["failure"]) for r in rl.state.restarts]
    assert board.curves.data["step"] == list(range(1, rl.state.step_count + 1))  # rolled-back steps replaced
    last = rl.state.restarts[-1]
    assert f"{len(board.restarts)} worker restart(s), last: {last['role']} {last['failure']}" in board.status.object
