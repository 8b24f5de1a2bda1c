"""The notebook widgets driven as a user would (values set, buttons clicked) against a real
session on the tiny model: a valid mapping applies, an invalid one shows its problems and
changes nothing, a dataflow edit changes the next step's stages, the controls run, pause and
stop a background run, and the inspector shows what each stage added. The mapping advisor on
the same session: Suggest fills in its mapping and Apply moves onto it; the live advisor's
record against the run's own steps; a remap asked through the page's run control."""
from __future__ import annotations

import dataclasses
import json
import statistics
import time

import pytest
import torch

from hybridlab.dataflow.graph import DataflowError
from hybridlab.dataflow.session import RLSession
from tests.test_remap import assert_steps_in_sync

SETTINGS = ["warm_start.max_steps=0", "data.prompts_per_step=8", "rollout.n=4", "rollout.max_new_tokens=6",
            "actor.ppo_mini_batch_size=8", "data.test_samples=16", "trainer.progress=false", "trainer.eval_every=0"]


@pytest.fixture(scope="module")
def rl(ray_local, trained_dir, tmp_path_factory):
    session = RLSession(None, [f"model={trained_dir}", *SETTINGS,
                               f"trainer.run_dir={tmp_path_factory.mktemp('widgets') / 'run'}"]).start()
    yield session
    session.shutdown()


def pids(rl) -> list[int]:
    return sorted(p["pid"] for s in rl.workers._sets for p in s.placements)


def test_run_stage_by_hand_and_inspect_what_each_stage_added(rl):
    batch = rl.next_prompts()
    with pytest.raises(DataflowError, match="stage 'reward' needs the field.* responses"):
        rl.run_stage("reward", batch)
    batch = rl.run_stage("generate", batch)
    assert len(batch) == 8 * 4 and "responses" in batch and "token_level_scores" not in batch
    batch = rl.run_stage("reward", batch)
    assert batch.meta["metrics"]["reward"]["reward/mean"] == pytest.approx(float(batch["token_level_scores"].sum(-1).mean()))
    table = rl.inspect(batch)
    assert len(table.rows) == 32 and {"prompt", "response", "length", "reward", "rollout_logp"} <= set(table.rows[0])

    result = rl.step()
    assert [name for name, _ in result.stages][0] == "generate"
    after_generate = rl.inspect(result, stage="generate").rows[0]
    assert "response" in after_generate and "reward" not in after_generate and "advantage" not in after_generate
    after_reward = rl.inspect(result, stage="reward").rows[0]
    assert "reward" in after_reward and "advantage" not in after_reward
    full = rl.inspect(result)
    rewards = torch.tensor([r["reward"] for r in full.rows])
    full.sort_by.value, full.descending.value = "reward", True
    assert [r["reward"] for r in full.sorted_rows()] == sorted(rewards.tolist(), reverse=True)
    assert "<table" in full.table.value and "advantage" in full.table.value
    with pytest.raises(KeyError, match="stage 'values' did not run in step"):
        rl.inspect(result, stage="values")


def test_an_invalid_mapping_shows_its_problems_and_changes_nothing(rl):
    editor = rl.mapping_editor()
    before, processes = rl.mapping, pids(rl)
    editor.role("actor").tp.value = 3
    editor.role("actor").ep.value = 2  # the editor passes ep on (1 is left out of the mapping)
    editor.pool("main").devices.value = 3
    editor.role("rollout").dp.value = 3
    editor.role("reward").dp.value = 3
    editor.validate_button.click()
    assert "roles.actor.tp: the model&#x27;s 4 attention heads are not divisible by tp=3" in editor.status.value
    assert "roles.actor.ep: ep=2 must divide dp=1" in editor.status.value
    assert "Traceback" not in editor.status.value
    editor.apply_button.click()
    assert "Not applied" in editor.status.value and "not divisible by tp=3" in editor.status.value
    assert rl.mapping == before and pids(rl) == processes
    assert "device 2" in editor.drawing.value and "actor tp2 dp0 pp0" in editor.drawing.value


def test_a_valid_mapping_applies_and_shows_its_report(rl):
    editor = rl.mapping_editor()
    assert "device 0" in editor.drawing.value and "rollout engine 0" in editor.drawing.value
    editor.add_pool("gen", 1)
    for role in ("rollout", "reward"):
        editor.role(role).pool.value = "gen"
        editor.role(role).colocate.value = "g"
    editor.role("actor").colocate.value = ""
    assert "device 1" in editor.drawing.value  # the drawing follows the edits
    assert editor.validate() == []
    editor.apply_button.click()
    assert "Applied after step" in editor.status.value and "re-created actor, reward, rollout" in editor.status.value
    assert rl.mapping.roles["rollout"].pool == "gen" and rl.mapping.roles["actor"].pool == "main"
    assert rl.workers.groups["actor"].hostset is not rl.workers.groups["rollout"].hostset
    assert_steps_in_sync(rl)


SPLIT = {"pools": {"main": {"devices": 1}, "gen": {"devices": 1}},
         "roles": {"actor": {"pool": "main"}, "rollout": {"pool": "gen", "colocate": "g"},
                   "reward": {"pool": "gen", "colocate": "g"}}}


def test_suggest_fills_in_the_advisors_mapping_and_apply_moves_the_session_onto_it(rl):
    from hybridlab.advisor.cost_model import predict
    from hybridlab.advisor.profile import load_profile
    from hybridlab.advisor.suggest import session_workload
    from hybridlab.controller.mapping import DeviceMapping

    if rl.mapping != DeviceMapping.from_dict(SPLIT):  # what the test above leaves
        rl.remap(SPLIT)
    editor = rl.mapping_editor()
    assert editor.suggest("nowhere") is None
    assert "No suggestion" in editor.status.value and "hybridlab calibrate" in editor.status.value
    # compute-bound, bytes free, collectives slow: on-policy, split pools leave each stage one device,
    # colocated at dp 2 every stage has both (TP and PP only add traffic)
    bound = dataclasses.replace(load_profile("h100"), name="compute-bound", flops=1e8, bandwidth=1e13,
                                call_overhead_s=0.0, collective_latency_s=1e-3)
    found = editor.suggest(bound)
    assert found.best.label == "colocated on 2: trainers tp1 pp1 dp2, rollout tp1 dp2" and found.speedup > 1.5
    assert found.current.step_s == predict(session_workload(rl), rl.cfg, rl.mapping, bound).step_s
    assert f"{found.speedup:.2f}x" in editor.status.value and "Apply remaps" in editor.status.value
    assert DeviceMapping.from_dict(editor.mapping_dict()) == found.best.mapping  # the table holds it
    editor.apply_button.click()
    assert "Applied after step" in editor.status.value and rl.mapping == found.best.mapping
    assert_steps_in_sync(rl)
    assert rl.suggest_mapping(bound).same  # nothing faster now


def telemetry(rl, kind: str) -> list[dict]:
    from hybridlab.telemetry.hub import TELEMETRY_FILE

    rl.telemetry.flush()  # what the session sent so far, written
    lines = (rl.run_dir / TELEMETRY_FILE).read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == kind]


def test_the_live_advisor_checks_its_prediction_and_the_page_remaps_onto_a_proposal(rl):
    from hybridlab.advisor.cost_model import predict
    from hybridlab.advisor.profile import load_profile
    from hybridlab.advisor.suggest import session_workload
    from hybridlab.controller.mapping import DeviceMapping
    from hybridlab.telemetry.live import request_action

    rl.update("trainer.advise_every=1", "trainer.advisor_profile=h100")
    for _ in range(3):
        rl.step()
        rl.advisor.wait()
    last = rl.advisor.last
    recent = [h for h in rl.state.history if h["step"] > last["since_step"]][-5:]
    assert last["step"] == rl.state.step_count and last["steps"] == len(recent) >= 2
    assert last["measured_s"] == round(statistics.median(h["timing/step_s"] for h in recent), 4)
    work = dataclasses.replace(session_workload(rl), response_mean=statistics.mean(
        h["response_length/mean"] for h in recent))
    assert last["predicted_s"] == predict(work, rl.cfg, rl.mapping, load_profile("h100")).step_s
    assert last["error"] == round(last["predicted_s"] / last["measured_s"] - 1, 3)
    assert telemetry(rl, "advice")[-1]["step"] == last["step"]  # on its way to the dashboard

    remap_answers = lambda: [r for r in telemetry(rl, "control") if r.get("action") == "remap"]
    earlier = len(remap_answers())
    bad = {"pools": {"main": {"devices": 1}}, "roles": {"actor": {"pool": "main", "tp": 3}}}
    request_action(rl.run_dir, "remap", json.dumps(bad))  # refused before anything is torn down
    request_action(rl.run_dir, "remap", json.dumps(SPLIT))  # as the page's "Remap to the proposal" asks
    deadline = time.time() + 120
    while (rl.mapping != DeviceMapping.from_dict(SPLIT) or len(remap_answers()) < earlier + 2) \
            and time.time() < deadline:
        time.sleep(0.2)
    assert rl.mapping == DeviceMapping.from_dict(SPLIT)
    answers = remap_answers()[earlier:]
    assert [a["ok"] for a in answers] == [False, True]  # in the order asked
    assert "not divisible by tp=3" in answers[-2]["error"]
    rl.update("trainer.advise_every=20", "trainer.advisor_profile=local")


def test_a_dataflow_edit_changes_the_next_steps_stages(rl):
    editor = rl.dataflow_editor()
    assert "rloo" in editor.selectors["algorithm.adv_estimator"].options  # filled from the registry
    editor.default_stages.value = False
    editor.stage_boxes["sync_weights"].value = False
    editor.selectors["algorithm.adv_estimator"].value = "rloo"
    editor.numbers["actor.entropy_coeff"].value = 0.01
    assert editor.validate() == []
    editor.apply_button.click()
    assert "Applied for step" in editor.status.value, editor.status.value
    result = rl.step()
    assert "sync_weights" not in [name for name, _ in result.stages] and rl.cfg.algorithm.adv_estimator == "rloo"
    assert rl.cfg.actor.entropy_coeff == pytest.approx(0.01)
    from hybridlab.algos.advantages import compute_rloo_outcome_advantage

    b = result.batch
    adv, _ = compute_rloo_outcome_advantage(b["token_level_rewards"], b["response_mask"].float(), b["uid"])
    assert torch.allclose(b["advantages"], adv, atol=1e-6)

    editor.default_stages.value = True  # back to the algorithm's own stages
    editor.stage_boxes["old_logprob"].value = True  # ignored: the default is chosen
    editor.apply_button.click()
    assert rl.cfg.dataflow is None and "sync_weights" in rl.dataflow.names

    editor.selectors["actor.loss_agg_mode"].value = "seq-mean-token-mean"
    editor.default_stages.value = False  # a dataflow that cannot run is refused in words
    editor.stage_boxes["advantages"].value = False
    problems = editor.validate()
    assert problems and any("advantages" in p for p in problems), problems
    editor.apply_button.click()
    assert "Not applied" in editor.status.value and rl.cfg.dataflow is None


def test_controls_run_pause_and_stop_a_background_run_and_edits_wait_for_a_boundary(rl):
    controls = rl.controls(steps=40)
    controls.buttons["Pause"].click()  # nothing to pause: said, and no pause left behind for the next run
    assert "No run to pause" in controls.status.value and not rl.paused
    with pytest.raises(RuntimeError, match="no run to pause"):
        rl.pause()
    start = rl.state.step_count
    controls.buttons["Start"].click()
    assert "Running 40 steps" in controls.status.value
    deadline = time.time() + 120
    while rl.state.step_count < start + 1 and time.time() < deadline:
        time.sleep(0.1)
    controls.buttons["Pause"].click()
    assert rl.wait_until_held(120)
    held = rl.state.step_count
    time.sleep(2.0)
    assert rl.state.step_count == held and rl.paused  # held at a boundary
    deadline = time.time() + 10
    while "Paused after step" not in controls.status.value and time.time() < deadline:
        time.sleep(0.1)
    assert f"Paused after step {held}" in controls.status.value  # said once it is actually held
    controls.buttons["Start"].click()  # a second run is refused and the paused one stays paused
    assert "a background run is going" in controls.status.value and rl.paused and rl.state.step_count == held
    controls.buttons["Step"].click()  # while held, one step by hand
    assert f"Ran step {held + 1}" in controls.status.value and rl.state.step_count == held + 1
    editor = rl.mapping_editor()  # an edit while held applies at once (no step holds the boundary)
    editor.role("reward").colocate.value = ""
    editor.apply_button.click()
    assert "Applied after step" in editor.status.value and rl.state.remaps[-1].step == held + 1
    controls.buttons["Resume"].click()
    deadline = time.time() + 120
    while rl.state.step_count < held + 2 and time.time() < deadline:
        time.sleep(0.1)
    controls.buttons["Step"].click()  # refused: the background run is stepping
    assert "a background run is stepping; Pause it first" in controls.status.value
    editor.role("reward").colocate.value = "g"
    flow = rl.dataflow_editor()
    flow.numbers["actor.lr"].value = 2e-5
    flow.apply_button.click()  # during the run: queued to the next boundary, the click returns at once
    assert "Queued: applies at the next step boundary" in flow.status.value
    editor.apply_button.click()
    assert "Queued: applies at the next step boundary" in editor.status.value
    flow.applier.wait(120)
    editor.applier.wait(120)
    assert "Applied for step" in flow.status.value and rl.cfg.actor.lr == pytest.approx(2e-5)
    assert "Applied after step" in editor.status.value
    controls.buttons["Pause"].click()
    assert rl.wait_until_held(120)
    controls.buttons["Stop"].click()  # stop while paused: the run ends at once, summary written
    controls.wait(300)
    assert "Finished at step" in controls.status.value and "stop requested" in controls.status.value
    assert (rl.run_dir / "summary.json").is_file() and rl.state.step_count < start + 40 and not rl.paused
    assert controls.progress.value == rl.state.step_count - start
    assert "reward/mean" in controls.metrics.value
