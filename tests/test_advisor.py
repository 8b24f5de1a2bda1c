"""The mapping advisor (issue 35): the cost model's stage, step, overlap and busy figures against
hand arithmetic on a profile of round numbers; the planner's ranking and the reasons it names
for each rejected mapping (the run's own validation, memory, TP across nodes); profiles saved,
loaded and refused by name; the calibration's fit on constructed measurements, and one real
calibration at tiny sizes (vLLM, gloo, transformers and a worker call through Ray)."""
from __future__ import annotations

import dataclasses
import json

import pytest

from hybridlab.advisor import calibrate as cal
from hybridlab.advisor.cost_model import Workload, predict
from hybridlab.advisor.plan import best, plan, table
from hybridlab.advisor.profile import GPU_PROFILES, DeviceProfile, load_profile
from hybridlab.cli import main
from hybridlab.controller.mapping import DeviceMapping
from hybridlab.errors import UserError
from hybridlab.run_config import load_config

ROUND = DeviceProfile(name="round", kind="cpu", processor="test", dtype="float32", flops=1e10, bandwidth=1e10,
                      memory_gb=24, memory_shared=True, collective_latency_s=1e-4, collective_gbps=1e9,
                      engine_collective_latency_s=1e-5,
                      decode_overhead_s=1e-3, decode_token_s=1e-4, prefill_token_s=1e-5, forward_token_s=1e-5,
                      forward_efficiency=0.5, train_token_s=2e-5, train_efficiency=0.25, call_overhead_s=0.01)
WORK = Workload(params=1_000_000, layers=4, hidden=128, vocab=1000, samples=32, prompt_mean=10, prompt_max=12,
                response_mean=6, response_max=8)
SIZES = ["data.prompts_per_step=4", "rollout.n=8", "actor.ppo_mini_batch_size=4"]
# the stages priced are the config's dataflow (a reference pass added to GRPO's)
SETTINGS = [*SIZES,
            "dataflow=[generate,reward,rollout_as_old_logprob,ref_logprob,advantages,update_actor,sync_weights]"]
# off-policy, the actor recomputes the old log-probs
OFF = [*SIZES, "dataflow=[generate,reward,old_logprob,ref_logprob,advantages,update_actor,sync_weights]"]
ONE = {"pools": {"main": {"devices": 1}},
       "roles": {r: {"pool": "main", "colocate": "engine"} for r in ("actor", "rollout", "ref", "reward")}}
SPLIT = {"pools": {"train": {"devices": 1}, "gen": {"devices": 1}},
         "roles": {"actor": {"pool": "train", "colocate": "t"}, "ref": {"pool": "train", "colocate": "t"},
                   "reward": {"pool": "train", "colocate": "t"}, "rollout": {"pool": "gen"}}}


def test_stage_times_follow_the_formulas_on_one_device():
    p = predict(WORK, load_config(None, SETTINGS), DeviceMapping.from_dict(ONE), ROUND)
    # generate: prefill 32 x 10 x (1e-5 + 2e6/1e10) = 0.0672; decode 8 x (1e-3 + 4e6/1e10) = 0.0112
    # + 32 x 6 x (1e-4 + 2e6/1e10) = 0.0576; + the call 0.01
    assert p.stage_s["generate"] == pytest.approx(0.146)
    # ref: 32 x 16 tokens x (1e-5 + 2e6 / (1e10 x 0.5)) = 0.20992, + 0.01
    assert p.stage_s["ref_logprob"] == pytest.approx(0.21992)
    # update: 512 x (2e-5 + 6e6 / (1e10 x 0.25)) = 1.23904 (one epoch, no all-reduce at dp 1), + 0.01
    assert p.stage_s["update_actor"] == pytest.approx(1.24904)
    # sync in the shared process: 2 x 4e6 bytes / 1e10 = 0.0008, + 0.01; reward: the call; advantages: nothing
    assert p.stage_s["sync_weights"] == pytest.approx(0.0108)
    assert (p.stage_s["reward"], p.stage_s["advantages"], p.stage_s["rollout_as_old_logprob"]) == \
        (pytest.approx(0.01), 0.0, 0.0)
    assert p.step_s == pytest.approx(0.146 + 0.01 + 0.21992 + 1.24904 + 0.0108) and p.busy == 1.0
    assert not p.overlapped


def test_data_parallel_halves_the_work_and_adds_the_gradient_all_reduce():
    two = {"pools": {"main": {"devices": 2}}, "roles": {r: {**lay, "dp": 2} for r, lay in ONE["roles"].items()}}
    p = predict(WORK, load_config(None, SETTINGS), DeviceMapping.from_dict(two), ROUND)
    # 16 sequences per engine: prefill 0.0336, decode 0.0112 + 96 x 3e-4 = 0.0288, the call 0.01
    assert p.stage_s["generate"] == pytest.approx(0.0836)
    # 256 tokens per rank: 0.61952, + one all-reduce of 4e6 bytes over 2: 1e-4 + 4e6 / 1e9 = 0.0041, + 0.01
    assert p.stage_s["update_actor"] == pytest.approx(0.63362)
    pipe = {"pools": {"main": {"devices": 2}}, "roles": {**two["roles"], "ref": {"pool": "main", "pp": 2,
                                                                                 "colocate": "engine"}}}
    p = predict(WORK, load_config(None, SETTINGS), DeviceMapping.from_dict(pipe), ROUND)
    # 512 tokens x (1e-5 + 2 x 5e5 / 5e9) = 0.10752, twice for the bubble of one micro-batch on 2 stages;
    # one hop of 512 x 128 x 4 bytes: 1e-4 + 2.62144e-4; + the call
    assert p.stage_s["ref_logprob"] == pytest.approx(0.21504 + 3.62144e-4 + 0.01)


def test_an_moe_model_computes_with_its_active_experts_and_ep_trades_gradients_for_exchanges():
    # 800k of the 1M parameters are 8 experts, 2 per token: 200k + 800k x 2 / 8 = 400k active
    moe = dataclasses.replace(WORK, expert_params=800_000, experts=8, top_k=2, moe_layers=4)
    assert moe.active_params == 400_000 and moe.read_params(1) == 400_000
    reached = 1 - 0.75 ** 32  # the experts 32 tokens reach, expected under even routing
    assert moe.read_params(32) == pytest.approx(200_000 + 800_000 * reached)
    assert moe.train_params(2) == pytest.approx(100_000 + 200_000)  # TP splits the dense part only
    p = predict(moe, load_config(None, SETTINGS), DeviceMapping.from_dict(ONE), ROUND)
    # generate: prefill 320 x (1e-5 + 8e5/1e10); decode 8 x (1e-3 + read x 4 bytes / 1e10) + 192 x (1e-4 + 8e5/1e10)
    decode = 8 * (1e-3 + (200_000 + 800_000 * reached) * 4 / 1e10) + 192 * 1.8e-4
    assert p.stage_s["generate"] == pytest.approx(0.0288 + decode + 0.01, abs=2e-6)
    # update: 512 x (2e-5 + 2.4e6 / 2.5e9), + the call
    assert p.stage_s["update_actor"] == pytest.approx(512 * 9.8e-4 + 0.01)

    def two(ep: int) -> dict:
        return {"pools": {"main": {"devices": 2}},
                "roles": {r: {**lay, "dp": 2, **({"ep": ep} if r in ("actor", "ref") else {})}
                          for r, lay in ONE["roles"].items()}}

    dp2, ep2 = (predict(moe, load_config(None, SETTINGS), DeviceMapping.from_dict(two(ep)), ROUND) for ep in (1, 2))
    # ep 1: 256 tokens per rank; one all-reduce of every gradient (4e6 bytes) over 2 ranks
    assert dp2.stage_s["update_actor"] == pytest.approx(256 * 9.8e-4 + (1e-4 + 4e-3) + 0.01)
    # ep 2: 16 rows padded to 12 + 8 tokens; per sparse layer the allgather dispatcher's 4 collectives forward
    # and 3 backward with the other rank's 320 tokens: hidden states (128 wide) in 4 bytes in and 4 (the
    # probabilities' fp32) out, probabilities (8 experts, fp32) and map (1 byte) in; backward the hidden
    # states both ways and the probabilities; the dense gradients (8e5 bytes) over 2 ranks, the experts' stay
    hidden, probs = 320 * 128, 320 * 8
    forward, backward = hidden * 8 + probs * 5, hidden * 8 + probs * 4
    update = 320 * 9.8e-4 + 4 * (7 * 1e-4 + (forward + backward) / 1e9) + (1e-4 + 8e-4) + 0.01
    assert ep2.stage_s["update_actor"] == pytest.approx(update, abs=2e-6)
    # a forward pass: padded tokens at 2 x 4e5 / 5e9 each, and the 4 forward collectives per sparse layer
    assert dp2.stage_s["ref_logprob"] == pytest.approx(256 * 1.7e-4 + 0.01, abs=2e-6)
    assert ep2.stage_s["ref_logprob"] == pytest.approx(320 * 1.7e-4 + 4 * (4 * 1e-4 + forward / 1e9) + 0.01, abs=2e-6)
    assert ep2.peak_memory_mb < dp2.peak_memory_mb  # the experts' weights and moments split in two
    tp2 = {"pools": {"main": {"devices": 2}},
           "roles": {r: {**lay, **({"tp": 2} if r in ("actor", "ref") else {"dp": 2})} for r, lay in ONE["roles"].items()}}
    # TP 2 without ep: the dispatcher's group is the 2 TP ranks, each routing all 512 tokens
    ref = predict(moe, load_config(None, SETTINGS), DeviceMapping.from_dict(tp2), ROUND).stage_s["ref_logprob"]
    exchange = 4 * (4 * 1e-4 + (512 * 128 * 8 + 512 * 8 * 5) / 1e9)
    tp_traffic = 2 * 4 * (1e-4 + 512 * 128 * 4 / 1e9)  # two all-reduces of the hidden states per layer
    assert ref == pytest.approx(512 * (1e-5 + 2 * 3e5 / 5e9) + tp_traffic + exchange + 0.01, abs=2e-6)


def test_the_planner_offers_expert_parallel_layouts_for_an_moe_model():
    from hybridlab.models.zoo import resolve_model

    moe_dir = resolve_model("tiny-qwen3moe")  # 4 experts, 2 per token, in 3 of its 4 layers
    cfg = load_config(None, [f"model={moe_dir}", *SIZES])
    work = Workload.of(cfg)
    assert (work.experts, work.top_k, work.moe_layers) == (4, 2, 3) and work.active_params < work.params
    found = plan(cfg, 4, ROUND, work=work)
    eps = {c.label for c in found if c.ok and c.mapping.roles["actor"].ep == 2}
    assert "colocated on 4: trainers tp1 pp1 dp4 ep2, rollout tp1 dp4" in eps
    assert all(c.mapping.roles["actor"].ep in (1, 2, 4) for c in found)  # only sizes that divide dp and the experts
    four = next(c for c in found if c.label == "colocated on 4: trainers tp1 pp1 dp4 ep4, rollout tp1 dp4")
    assert four.ok and four.prediction.stage_s["update_actor"] == predict(work, cfg, four.mapping, ROUND).stage_s[
        "update_actor"]
    dense = plan(load_config(None, [*SIZES]), 4, ROUND)
    assert not any(" ep" in c.label for c in dense)


def test_off_policy_overlaps_generation_only_on_devices_of_its_own():
    split = DeviceMapping.from_dict(SPLIT)
    on = predict(WORK, load_config(None, OFF), split, ROUND)
    # the sync crosses processes: 4e6 bytes / 1e9 + 1e-4 + the call; old log-probs cost what ref's do
    assert on.stage_s["sync_weights"] == pytest.approx(0.0141) and on.stage_s["old_logprob"] == pytest.approx(0.21992)
    rest = 0.01 + 2 * 0.21992 + 1.24904 + 0.0141
    assert on.step_s == pytest.approx(0.146 + rest)
    # device-seconds: generate on gen, reward, old, ref and update on train, the sync on both
    assert on.busy == pytest.approx((0.146 + 0.01 + 2 * 0.21992 + 1.24904 + 2 * 0.0141) / (2 * (0.146 + rest)),
                                    abs=1e-3)
    off = predict(WORK, load_config(None, [*OFF, "trainer.off_policy=true"]), split, ROUND)
    assert off.overlapped and off.step_s == pytest.approx(max(0.146, rest))
    deeper = predict(WORK, load_config(None, [*OFF, "trainer.off_policy=true", "trainer.max_staleness=3"]), split,
                     ROUND)  # a deeper queue: the same steady state for steps of the mean times
    assert deeper.step_s == off.step_s and deeper.stage_s == off.stage_s
    beside = {**SPLIT, "roles": {**SPLIT["roles"], "reward": {"pool": "gen", "colocate": "g"},
                                 "rollout": {"pool": "gen", "colocate": "g"}}}
    behind = predict(WORK, load_config(None, [*OFF, "trainer.off_policy=true"]),
                     DeviceMapping.from_dict(beside), ROUND)  # the reward waits behind the next generation
    assert not behind.overlapped and behind.step_s == pytest.approx(on.step_s)
    shared = predict(WORK, load_config(None, [*OFF, "trainer.off_policy=true"]), DeviceMapping.from_dict(ONE),
                     ROUND)
    assert not shared.overlapped and shared.step_s == pytest.approx(0.146 + 0.01 + 2 * 0.21992 + 1.24904 + 0.0108)


def test_the_planner_ranks_by_prediction_and_names_every_rejection(tiny_dir):
    cfg = load_config(None, [f"model={tiny_dir}", "rollout.n=4", "data.prompts_per_step=4",
                             "actor.ppo_mini_batch_size=4"])
    found = plan(cfg, 4, ROUND)
    ok = [c for c in found if c.ok]
    steps = [c.prediction.step_s for c in ok]
    assert steps == sorted(steps) and best(found) is ok[0]
    assert ok[0].prediction.step_s == predict(Workload.of(cfg), cfg, ok[0].mapping, ROUND).step_s
    reasons = {c.label: c.rejected for c in found if not c.ok}
    # tiny: 4 heads, 2 key/value heads; 4 prompts x 4 samples do not split over 3 ranks
    assert "mapping.roles.actor.tp: the model's 2 key/value heads are not divisible by tp=4" in \
        reasons["colocated on 4: trainers tp4 pp1 dp1, rollout tp1 dp4"]
    assert "mapping.roles.rollout.tp: the model's 4 attention heads are not divisible by tp=3" in \
        reasons["split 1 train + 3 gen, reward on gen: trainers tp1 pp1 dp1, rollout tp3 dp1"]
    assert ("actor.ppo_mini_batch_size: 4 prompts x rollout.n 4 = 16 sequences per update is not divisible by the"
            " actor's data-parallel size 3") in reasons["split 3 train + 1 gen, reward on gen: trainers tp1 pp1 dp3,"
                                                         " rollout tp1 dp1"]
    text = table(found)
    assert text.splitlines()[1].startswith("   1") and ok[0].label in text.splitlines()[1]
    assert f"rejected: {len(reasons)} of {len(found)}" in text

    across = plan(cfg, 4, ROUND, nodes=2)  # whole nodes per pool; TP stays inside a node
    assert {c.label.split(":")[0] for c in across} == {"colocated on 4", "split 2 train + 2 gen, reward on gen",
                                                           "split 2 train + 2 gen, reward on train"}
    assert "roles.actor.tp: tp=4 would span nodes (2 devices per node)" in " ".join(
        next(c for c in across if c.label == "colocated on 4: trainers tp4 pp1 dp1, rollout tp1 dp4").rejected)


def test_mappings_that_do_not_fit_in_memory_are_refused_with_the_gigabytes(tiny_dir):
    cfg = load_config(None, [f"model={tiny_dir}"])
    small_node = dataclasses.replace(ROUND, memory_gb=0.5)
    found = plan(cfg, 1, small_node)
    assert [c.ok for c in found] == [False]
    (reason,) = found[0].rejected
    need = sum(predict(Workload.of(cfg), cfg, found[0].mapping, ROUND).memory_mb.values()) / 1024
    assert reason == f"memory: needs {need:.1f} GB on node 0, which has 0.5 GB (90% usable)"
    with pytest.raises(UserError, match="no mapping of this config can run on these devices:\n  - memory: needs"):
        best(found)
    per_device = dataclasses.replace(GPU_PROFILES["h100"], memory_gb=0.5)
    assert "on device main/0, which has 0.5 GB" in plan(cfg, 1, per_device)[0].rejected[0]
    with pytest.raises(UserError, match="--nodes: must be a positive integer that divides --devices \\(4\\), got 3"):
        plan(cfg, 4, ROUND, nodes=3)


def test_plan_and_explain_take_overrides_alone_on_the_command_line(tiny_dir, capsys):
    # argparse reads the first KEY=VALUE as the config; the command line hands it back as an override
    assert main(["plan", f"model={tiny_dir}", "rollout.n=4", "--devices", "1", "--profile", "h100"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[2].startswith("   1") and "colocated on 1: trainers tp1 pp1 dp1, rollout tp1 dp1" in out
    assert main(["explain", f"model={tiny_dir}", "rollout.n=4"]) == 0
    assert " x 4 samples (rollout.n)" in capsys.readouterr().out


def test_profiles_save_load_and_are_refused_by_name(tmp_path, capsys):
    path = ROUND.save(tmp_path / "round.json")
    assert load_profile(path) == ROUND
    assert load_profile("H100").sources and load_profile("h100").flops == 989.4e12
    bad = {**ROUND.to_dict(), "flop": 1.0}
    del bad["flops"]
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(UserError, match=r"unknown field\(s\) \['flop'\], missing field\(s\) \['flops'\]"):
        load_profile(tmp_path / "bad.json")
    with pytest.raises(UserError, match="no device profile 'nowhere'.*run `hybridlab calibrate`"):
        load_profile("nowhere")
    assert main(["plan", "--profile", "nowhere", "--devices", "2"]) == 2  # refused before any work
    assert "run `hybridlab calibrate`" in capsys.readouterr().err


def test_the_fit_reproduces_its_measurements_and_keeps_overheads_positive():
    measured = {"processor": "test", "date": "2026-11-27", "devices": 2, "cores_per_device": 1, "memory_gb": 24.0,
                "matmul_gflops": {"float32": 10.0, "bfloat16": 20.0}, "bandwidth_gbps": 10.0,
                "allreduce_s": {"4096": 1e-4 + 4096 / 1e9, "16777216": 1e-4 + 16777216 / 1e9},
                "shared_memory_exchange_s": 2e-6,
                "engine": {"model": "m", "params": 1_000_000, "prompt_len": 16, "prefill_token_s": 2.5e-4,
                           # roofline 4e-4 + b x 2e-4, plus 1e-3 + b x 1e-4 on top
                           "decode_step_s": {"1": 1.7e-3, "8": 3.8e-3}},
                "training": [{"model": "a", "params": 1_000_000, "forward_token_s": 1e-5 + 2e6 / 1e10 / 0.5,
                              "train_token_s": 2e-5 + 6e6 / 1e10 / 0.25},
                             {"model": "b", "params": 4_000_000, "forward_token_s": 1e-5 + 8e6 / 1e10 / 0.5,
                              "train_token_s": 2e-5 + 24e6 / 1e10 / 0.25}],
                "call_overhead_s": 0.01}
    p = cal.fit_profile(json.loads(json.dumps(measured)))  # as read back from the file: string keys
    assert (p.collective_latency_s, p.collective_gbps) == (pytest.approx(1e-4), pytest.approx(1e9))
    assert (p.decode_overhead_s, p.decode_token_s) == (pytest.approx(1e-3), pytest.approx(1e-4))
    assert p.prefill_token_s == pytest.approx(5e-5) and p.engine_collective_latency_s == 2e-6
    assert (p.forward_token_s, p.forward_efficiency) == (pytest.approx(1e-5), pytest.approx(0.5))
    assert (p.train_token_s, p.train_efficiency) == (pytest.approx(2e-5), pytest.approx(0.25))
    # measurements below the roofline's line through them: no negative overhead, the line through 0
    measured["training"][0]["forward_token_s"] = 1e-5
    low = cal.fit_profile(measured)
    xs, ys = [2e6 / 1e10, 8e6 / 1e10], [1e-5, 1e-5 + 8e6 / 1e10 / 0.5]
    slope = (xs[0] * ys[0] + xs[1] * ys[1]) / (xs[0] ** 2 + xs[1] ** 2)
    assert (low.forward_token_s, low.forward_efficiency) == (0.0, pytest.approx(1 / slope))


def test_a_real_calibration_at_tiny_sizes_writes_a_profile_the_planner_reads(ray_local, tiny_dir, tmp_path):
    from hybridlab.environment import processor

    result = cal.calibrate("ci", str(tmp_path / "ci.json"), progress=lambda text: None, devices=2,
                           engine_model="tiny", batches=(1, 4), new_tokens=8, train_models=("tiny", "small"),
                           train_rows=2, train_seq=16, steps=1)
    profile = load_profile(result["path"])
    m = profile.measured
    assert profile.processor == processor() and m["cores_per_device"] == 1 and m["devices"] == 2
    assert sorted(int(b) for b in m["engine"]["decode_step_s"]) == [1, 4]
    assert [t["model"] for t in m["training"]] == ["tiny", "small"]
    assert m["training"][1]["params"] > m["training"][0]["params"]
    assert profile.flops == m["matmul_gflops"]["float32"] * 1e9 and profile.call_overhead_s == m["call_overhead_s"]
    assert profile.to_dict() == cal.fit_profile(m, "ci").to_dict()
    assert best(plan(load_config(None, [f"model={tiny_dir}"]), 1, profile)).ok


ADVICE = {"kind": "advice", "step": 40, "since_step": 20, "after_remap": True, "steps": 5, "profile": "local",
          "mapping": ONE, "measured_s": 2.0, "predicted_s": 1.8, "error": -0.1,
          "busy": {"trainer": {"measured": 0.6, "predicted": 0.55}, "generator": {"measured": 0.3, "predicted": 0.35}},
          "best": {"label": "split 1 train + 1 gen, reward on train: trainers tp1 pp1 dp1, rollout tp1 dp1",
                   "mapping": SPLIT, "predicted_s": 1.2}, "speedup": 1.5, "propose": True}


def test_the_advice_panel_shows_the_check_and_asks_for_the_proposed_remap(tmp_path):
    from hybridlab.telemetry.advice_panel import NO_ADVICE, AdvicePanel

    panel = AdvicePanel(tmp_path, control=True)
    assert panel.text.object == NO_ADVICE and not panel.button.visible
    panel.feed([{**ADVICE, "propose": False, "speedup": 1.1}, ADVICE])  # the newest counts
    text = panel.text.object
    assert "steps 36-40, since the remap after step 20" in text
    assert "Measured 2.000 s per step; predicted 1.800 s for this mapping (-10%)." in text
    assert "trainers 60% / 55%; generators 30% / 35%" in text
    assert "**Proposal:** split 1 train + 1 gen, reward on train" in text and "(1.50x faster)" in text
    assert panel.button.visible
    panel.button.clicks += 1  # as a click in the browser
    (asked,) = (tmp_path / "control").glob("*.remap")
    assert json.loads(asked.read_text()) == SPLIT and not panel.button.visible
    viewer = AdvicePanel(tmp_path, control=False)  # a page that may not control the run: no button
    viewer.feed([ADVICE])
    assert "**Proposal:**" in viewer.text.object and not viewer.button.visible
    viewer.feed([{"kind": "advice", "step": 7, "failed": "no device profile 'local'\nmore"}])
    assert viewer.text.object == "**Mapping advisor** (step 7): no advice: no device profile &#x27;local&#x27;"


def test_the_reporter_hands_a_remap_request_its_mapping_in_click_order(tmp_path):
    from hybridlab.telemetry.live import LiveReporter, request_action

    done, sent = [], []
    reporter = LiveReporter(tmp_path, lambda: [], {"remap": done.append, "pause": lambda: done.append("pause")},
                            lambda kind, record: sent.append((kind, record)))
    request_action(tmp_path, "pause")
    request_action(tmp_path, "remap", json.dumps(SPLIT))
    request_action(tmp_path, "remap", json.dumps(ONE))  # a second click is a second request
    reporter.tick()
    assert done == ["pause", json.dumps(SPLIT), json.dumps(ONE)] and not list((tmp_path / "control").iterdir())
    assert sent[-1] == ("control", {"action": "remap", "ok": True, "paused": False})
