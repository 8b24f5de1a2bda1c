"""The dashboard's panels, run controls and serving rules on recorded telemetry (no engines
needed: the records are what a run writes; the live run is in test_dashboard.py, reading a run's
history and the runs beside it in test_run_history.py)."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from hybridlab.errors import UserError
from hybridlab.telemetry import dashboard as dash
from hybridlab.telemetry import panels, service_panel
from hybridlab.telemetry.busy import busy_fractions, busy_metrics, union_seconds
from hybridlab.telemetry.memory import leak_check
from hybridlab.telemetry.timeline import Span


def write_run(run_dir: Path, records: list[dict], metrics: list[dict] = (), summary: dict | None = None) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "telemetry.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    if summary is not None:
        (run_dir / "summary.json").write_text(json.dumps(summary))
    return run_dir


def step_record(step: int, t: float) -> dict:
    return {"kind": "metrics", "step": step, "time": t, "reward/mean": step / 10, "timing/step_s": 2.0,
            "timing/generate_s": 0.5, "rollout/tokens": 100, "response_length/p10": 2.0,
            "response_length/p50": 4.0, "response_length/p90": 6.0, "response_length/max": 8.0,
            "rollout/straggler_share": 0.25, "perf/device_busy": 0.5, "perf/device_busy/gpu0": 0.75,
            "perf/device_busy/gpu1": 0.25}


def board_after_one_step(tmp_path: Path):
    """A run directory whose telemetry holds its run record and step 1, and its dashboard after a poll."""
    run_dir = write_run(tmp_path / "run", [{"kind": "run", "name": "r", "mapping": {}}, step_record(1, time.time())])
    board = dash.Dashboard(run_dir, control=False)
    board.update()
    return run_dir, board


def test_busy_fraction_is_the_union_of_the_calls_on_each_device():
    assert union_seconds([(0, 2), (1, 3), (5, 6)]) == 4
    spans = [Span("actor", 0, "update", 1.0, 3.0), Span("rollout", 0, "generate", 2.0, 5.0),  # overlap on GPU 0
             Span("reward", 0, "score", 4.0, 12.0)]                                            # clipped at 10
    where = {"actor": ["GPU 0"], "rollout": ["GPU 0"], "reward": ["GPU 1"]}
    fractions = busy_fractions(spans, lambda role, rank: where[role], 0.0, 10.0)
    assert fractions == {"GPU 0": 0.4, "GPU 1": 0.6}
    assert busy_metrics(fractions, ["GPU 0", "GPU 1", "GPU 2"]) == {
        "perf/device_busy/gpu0": 0.4, "perf/device_busy/gpu1": 0.6, "perf/device_busy/gpu2": 0.0,
        "perf/device_busy": pytest.approx(1.0 / 3)}


def test_the_leak_alarm_fires_on_memory_that_keeps_growing_after_warm_up():
    ends = [float(s) for s in range(1, 151)]                  # 150 steps, one a second
    times = [s / 2 for s in range(1, 301)]                    # two samples a step
    settles = [1000.0 + 100 * min(t, 60.0) / 60 for t in times]  # a start-up ramp into step 60, then flat
    growing = [1000.0 + 0.5 * t for t in times]                # +50 MB per 100 steps: about 5%
    assert leak_check(times, growing, ends[:99]) is None       # 50 warm-up + 50 steps not reached yet
    assert leak_check(times, settles, ends)["leak"] is False   # warm-up is a third of 150: the ramp is over
    check = leak_check(times, growing, ends)
    assert check["leak"] is True and check["slope_mb"] == pytest.approx(50.0, rel=1e-6)
    stops = [1000.0 + 0.5 * min(t, 110.0) for t in times]      # grows, then stops: not a leak that stays
    assert leak_check(times, stops, ends)["slope_pct"] > 1 and leak_check(times, stops, ends)["leak"] is False


def test_every_panel_receives_its_records_and_every_source_rolls_over(tmp_path, monkeypatch):
    monkeypatch.setitem(dash.ROLLOVER, "curves", 5)
    for key in panels.ROLLOVER:
        monkeypatch.setitem(panels.ROLLOVER, key, 6)
    t0 = time.time() - 100
    records = [{"kind": "run", "name": "r", "mapping": {}, "processor": "AMD EPYC", "explanation": "```\nper step\n```"}]
    for step in range(1, 21):
        t = t0 + step
        records += [{"kind": "device", "time": t - 0.5, "device": "GPU 0", "role": "actor", "rank": 0, "util": 50.0,
                     "memory_mb": 900.0 + step, "rss_mb": 900.0 + step, "pid": 1},
                    {"kind": "sync", "step": step, "time": t, "bytes": 2**20 * 3, "buckets": 2, "seconds": 0.5,
                     "mode": "collective", "reason": "step", "bytes_per_pair": {"0->0": 2**20, "0->1": 2 * 2**20}},
                    {**agent_step(step, [{"calc": (1, 0, 0.1)}, {}]), "time": t}]
    records.append({"kind": "running", "time": t0 + 21, "calls": [
        {"role": "rollout", "ranks": [0], "method": "generate", "stage": "generate", "start": time.time() - 30,
         "deadline_s": 10.0, "late": True},
        {"role": "actor", "ranks": [0, 1], "method": "update", "stage": "update_actor", "start": time.time() - 1,
         "deadline_s": 120.0, "late": False}]})
    board = dash.Dashboard(write_run(tmp_path / "run", records), control=False)
    board.update()
    assert board.curves.data["step"] == [16, 17, 18, 19, 20]              # rollover 5
    heat = board.devices.source.data  # 20 samples a second apart, in bins of 5 s
    assert (heat["row"], heat["x"], heat["value"]) == (["GPU 0 actor r0"] * 4, [2.5, 7.5, 12.5, 17.5], [50.0] * 4)
    assert board.memory.sources["actor r0"].data["mb"] == [915.0 + i for i in range(6)]
    assert len(board.memory.markers.data["t"]) == 6
    busy = board.busy.heat.source.data  # one cell per device and step
    assert [v for row, v in zip(busy["row"], busy["value"]) if row == "gpu0"] == [0.75] * 20
    assert set(busy["row"]) == set(board.busy.fig.y_range.factors) == {"gpu0", "gpu1"}
    assert board.rollout.source.data["step"] == list(range(15, 21))
    assert board.agent.source.data["step"] == board.agent.tools["calc"].data["step"] == list(range(15, 21))
    assert board.rollout.source.data["tokens_per_s"][-1] == 200.0
    assert board.rollout.source.data["straggler_pct"][-1] == 25.0
    matrix = board.reshard.matrix.data
    assert (matrix["src"], matrix["dst"], matrix["label"]) == ([0, 0], [0, 1], ["1.0", "2.0"])
    assert "3.0 MB in 2 bucket(s), 0.50 s, 25.0% of step 20" in board.reshard.caption.object
    rows = board.running.table.object.split("</tr>")
    assert len(rows) == 4 and "color:#c62828" in rows[1] and "(stuck)" in rows[1]  # the late call in red
    assert "color:#c62828" not in rows[2] and ">update_actor<" in rows[2]
    assert board.controls is None                                          # no control: no buttons
    assert "per step" in board.explanation.object


def agent_step(step: int, tools: list[dict]) -> dict:
    """A step's metrics record as an agent run writes it: agent_metrics of two trajectories,
    the first of 3 turns, the second of 1, using the tools in ``tools`` (one dict per trajectory)."""
    import torch

    from hybridlab.dataflow.agent_stages import agent_metrics
    from hybridlab.protocol import Batch

    out = Batch({"agent_turns": torch.tensor([3.0, 1.0]), "agent_tool_calls": torch.tensor([2.0, 0.0]),
                 "agent_tool_errors": torch.tensor([1.0, 0.0]), "agent_tool_timeouts": torch.tensor([0.0, 0.0]),
                 "agent_model_tokens": torch.tensor([30.0, 10.0]), "agent_tool_tokens": torch.tensor([12.0, 0.0]),
                 "agent_retokenized": torch.tensor([1.0, 0.0]), "agent_error": torch.tensor([0, 0])},
                {"agent_tools": tools})
    return {**step_record(step, time.time() - 50 + step), **agent_metrics(out)}


def test_the_agent_panel_waits_with_a_reason_then_plots_turns_tokens_and_each_tools_calls(tmp_path):
    steps = [agent_step(2, [{"calc": (2, 1, 0.5)}, {}]), agent_step(3, [{"calc": (1, 0, 0.25)}, {"search": (4, 0, 2.0)}]),
             agent_step(4, [{"calc": (1, 0, 0.1)}, {}])]
    views = []
    for polls in ([[0], [1], [2]], [[0, 1, 2]]):  # live, a poll per step, or opened after the run: the same plots
        run_dir = write_run(tmp_path / f"run{len(polls)}", [{"kind": "run", "name": "r", "mapping": {}},
                                                            step_record(1, time.time())])
        board = dash.Dashboard(run_dir, control=False)
        board.update()
        agent = board.agent
        assert agent.note.visible and not agent.figures.visible and "no agent metrics yet" in agent.note.object
        for poll in polls:
            with (run_dir / "telemetry.jsonl").open("a") as f:
                f.writelines(json.dumps(steps[i]) + "\n" for i in poll)
            board.update()
        assert not agent.note.visible and agent.figures.visible
        views.append((dict(agent.source.data), {name: dict(src.data) for name, src in agent.tools.items()}))
    (data, tools), (once, tools_once) = views
    assert data == once and json.dumps(tools) == json.dumps(tools_once)  # NaN-safe equality
    assert (data["step"], data["turns_mean"], data["turns_max"]) == ([2, 3, 4], [2.0] * 3, [3.0] * 3)
    assert data["retokenized_pct"] == [25.0] * 3                        # 1 of 4 model calls
    assert (data["model_tokens"], data["context_tokens"]) == ([40.0] * 3, [12.0] * 3)
    calc, search = tools["calc"], tools["search"]
    assert (calc["calls"], calc["errors"], calc["latency_ms"]) == ([2.0, 1.0, 1.0], [1.0, 0.0, 0.0], [250.0, 250.0, 100.0])
    # a tool's line starts at its first call; a later step without calls has 0 calls and no latency
    assert (search["step"], search["calls"], search["latency_ms"][0]) == ([3, 4], [4.0, 0.0], 500.0)
    assert math.isnan(search["latency_ms"][1])
    assert {r.label["value"] for r in agent.calls.legend[0].items} == {"calc", "calc failed", "search",
                                                                      "search failed"}
    for fig in (agent.turns, agent.tokens, agent.calls, agent.latency):  # built at the first step, hover too
        assert [type(t).__name__ for t in fig.tools].count("HoverTool") == 1
    with (run_dir / "telemetry.jsonl").open("a") as f:  # a worker died in step 4: the run went back to step 3
        f.write(json.dumps({"kind": "restart", "step": 4, "role": "rollout", "rank": 0, "failure": "died",
                            "recreated": ["rollout"], "rolled_back_to": 3, "time": time.time()}) + "\n")
    board.update()
    assert agent.source.data["step"] == [2, 3] and agent.tools["search"].data["step"] == [3]


def test_the_moe_panel_waits_with_a_reason_then_plots_balance_and_the_latest_tokens_per_expert(tmp_path):
    def moe_step(step: int, tokens: list[float]) -> dict:
        mean = sum(tokens) / len(tokens)
        return {**step_record(step, time.time() - 50 + step), "actor/moe/load_balancing_loss": 1.0 + step / 100,
                "actor/moe/expert_load_max": max(tokens) / mean,
                **{f"actor/moe/expert_tokens/{e}": n for e, n in enumerate(tokens)}}

    run_dir, board = board_after_one_step(tmp_path)
    moe = board.moe
    assert moe.note.visible and not moe.figures.visible and "no routed experts" in moe.note.object
    with (run_dir / "telemetry.jsonl").open("a") as f:
        f.writelines(json.dumps(moe_step(s, t)) + "\n" for s, t in ((2, [10, 30, 20, 20]), (3, [25, 25, 10, 40])))
    board.update()
    assert not moe.note.visible and moe.figures.visible
    assert moe.source.data == {"step": [2, 3], "loss": [1.02, 1.03], "load_max": [1.5, 1.6]}
    assert moe.experts.data == {"expert": [0, 1, 2, 3], "tokens": [25, 25, 10, 40]}  # the latest update
    with (run_dir / "telemetry.jsonl").open("a") as f:  # a worker died in step 3: the run went back to step 2
        f.write(json.dumps({"kind": "restart", "step": 3, "role": "actor", "rank": 0, "failure": "died",
                            "recreated": ["actor"], "rolled_back_to": 2, "time": time.time()}) + "\n")
    board.update()
    assert moe.source.data["step"] == [2]


def test_the_streaming_panel_waits_then_plots_the_engines_the_shares_and_the_runs_staleness_histogram(tmp_path):
    def stream_step(step: int, stale: dict[int, int], partial: float, preempted: int) -> dict:
        return {**step_record(step, time.time() - 50 + step), "rollout/occupancy": 30.0 + step,
                "rollout/in_flight_groups": 8, "rollout/buffer_groups": 4, "rollout/engine_idle_share": 0.25,
                "rollout/trainer_wait_s": 0.5, "rollout/staleness": max(stale), "rollout/staleness_mean": 1.0,
                "rollout/partial_share": partial, "rollout/preempted": preempted, "rollout/samples": 16,
                **{f"rollout/stale_tokens/{a}": n for a, n in stale.items()}}

    run_dir, board = board_after_one_step(tmp_path)
    stream = board.stream
    assert stream.note.visible and not stream.figures.visible and "trainer.streaming=true" in stream.note.object
    with (run_dir / "telemetry.jsonl").open("a") as f:
        f.writelines(json.dumps(stream_step(*x)) + "\n" for x in ((2, {0: 10, 1: 6}, 0.5, 4), (3, {1: 7, 2: 3}, 0.25, 0)))
    board.update()
    assert not stream.note.visible and stream.figures.visible
    data = stream.source.data
    assert data["step"] == [2, 3] and data["occupancy"] == [32.0, 33.0] and data["staleness"] == [1, 2]
    assert data["partial_pct"] == [50.0, 25.0] and data["preempted_pct"] == [25.0, 0.0]
    assert data["engine_idle_pct"] == [25.0, 25.0]
    assert stream.histogram.data == {"staleness": [0, 1, 2], "tokens": [10, 13, 3]}  # summed over the run


def test_sections_the_training_panel_and_the_stuck_calls_alarm(tmp_path):
    run_dir = write_run(tmp_path / "run", [{"kind": "run", "name": "r", "mapping": {}}])
    board = dash.Dashboard(run_dir, control=False)
    assert board.tabs._names == ["Overview", "Rollouts", "Training", "Mapping and resharding", "System",
                                 "Stuck calls", "Service", "Config"]
    steps = [{**step_record(1, time.time()), "actor/pg_loss": 0.5, "actor/grad_norm": 2.0, "timing/generate_s": 1.5,
              "timing/update_actor_s": 0.5},
             {**step_record(2, time.time()), "actor/pg_loss": 0.25, "actor/entropy": 1.1, "timing/generate_s": 1.0,
              "timing/update_actor_s": 0.25, "timing/sync_weights_s": 0.125}]
    call = {"role": "actor", "ranks": [0], "method": "update_actor", "stage": "update_actor",
            "start": time.time() - 30, "deadline_s": 10.0}
    with (run_dir / "telemetry.jsonl").open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in (*steps, {"kind": "running", "calls": [call]}))
    board.update()
    training = board.training.source.data
    assert training["step"] == [1, 2] and training["actor/pg_loss"] == [0.5, 0.25]
    assert training["actor/grad_norm"][0] == 2.0 and math.isnan(training["actor/grad_norm"][1])
    assert board.training.stages == ["generate", "sync_weights", "update_actor"]  # timing/step_s is not a stage
    assert board.training.timing.data["sync_weights"] == [0.0, 0.125]  # no sync in step 1: 0 s
    assert board.tabs._names[5] == "⚠ Stuck calls: a call is late"  # 30 s into a 10 s deadline
    with (run_dir / "telemetry.jsonl").open("a") as f:
        f.write(json.dumps({"kind": "running", "calls": []}) + "\n")
    board.update()
    assert board.tabs._names[5] == "Stuck calls"


def test_the_mismatch_panel_says_why_it_is_empty_until_a_step_measures_the_mismatch(tmp_path):
    run_dir, board = board_after_one_step(tmp_path)
    mismatch = board.mismatch
    assert mismatch.note.visible and not mismatch.fig.visible and "`old_logprob`" in mismatch.note.object
    with (run_dir / "telemetry.jsonl").open("a") as f:
        f.write(json.dumps({**step_record(2, time.time()), "rollout_corr/kl": 0.01, "rollout_corr/k3_kl": 0.02,
                            "rollout_corr/rollout_is_mean": 1.0}) + "\n")
    board.update()
    assert not mismatch.note.visible and mismatch.fig.visible
    assert (mismatch.source.data["step"], mismatch.source.data["kl"]) == ([2], [0.01])


def test_smoothing_is_tensorboards_exponential_average_live_and_after_a_roll_back(tmp_path):
    def smoothed(values, w):  # TensorBoard's: the running average, divided by 1 - w^n
        out, last = [], 0.0
        for n, v in enumerate(values, 1):
            last = last * w + (1 - w) * v
            out.append(last / (1 - w ** n))
        return out

    rewards = [0.0, 1.0, 0.0, 1.0, 0.5]
    run_dir = write_run(tmp_path / "run", [{"kind": "run", "name": "r", "mapping": {}}])
    board = dash.Dashboard(run_dir, control=False)
    with (run_dir / "telemetry.jsonl").open("a") as f:
        f.writelines(json.dumps({**step_record(s, time.time()), "reward/mean": rewards[s - 1]}) + "\n"
                     for s in (1, 2, 3))
    board.update()
    assert board.smoothing.value == 0.6
    assert board.curves.data["reward_smooth"] == pytest.approx(smoothed(rewards[:3], 0.6))
    with (run_dir / "telemetry.jsonl").open("a") as f:  # streamed later: the average goes on
        f.writelines(json.dumps({**step_record(s, time.time()), "reward/mean": rewards[s - 1]}) + "\n" for s in (4, 5))
    board.update()
    assert board.curves.data["reward_smooth"] == pytest.approx(smoothed(rewards, 0.6))
    board.smoothing.value = 0.0  # no smoothing: the values themselves
    assert board.curves.data["reward_smooth"] == pytest.approx(rewards) and board.curves.data["reward"] == rewards
    board.smoothing.value = 0.9
    assert board.curves.data["reward_smooth"] == pytest.approx(smoothed(rewards, 0.9))
    with (run_dir / "telemetry.jsonl").open("a") as f:  # a roll-back to step 2, then step 3 again
        f.write(json.dumps({"kind": "restart", "step": 5, "role": "actor", "rank": 0, "failure": "died",
                            "recreated": ["actor"], "rolled_back_to": 2, "time": time.time()}) + "\n")
        f.write(json.dumps({**step_record(3, time.time()), "reward/mean": 0.25}) + "\n")
    board.update()
    assert board.curves.data["reward_smooth"] == pytest.approx(smoothed([0.0, 1.0, 0.25], 0.9))


def test_the_run_controls_ask_the_controller_and_show_its_answers(tmp_path):
    """Each button writes its request; the reporter carries it out once and says how it went; the
    page shows the answer, the paused state in its status line and the stacks as cards."""
    from hybridlab.telemetry.live import LiveReporter

    run_dir = write_run(tmp_path / "run", [{"kind": "run", "name": "r", "mapping": {}}])
    board = dash.Dashboard(run_dir, control=True)
    board.update()
    assert [b.label for b in board.controls.buttons.values()] == ["Pause", "Resume", "Stop",
                                                                 "Write every worker's stacks"]
    state = {"paused": False, "done": []}

    def pause():
        state["paused"] = True
        state["done"].append("pause")

    def stop():
        raise RuntimeError("no run to stop: no train() or start_background() run is going")

    def stacks():
        path = run_dir / "stacks" / "x-actor-rank0-pid1.txt"
        path.parent.mkdir(exist_ok=True)
        path.write_text('Thread 0x1 (most recent call first):\n  File "train.py", line 3 in update\n')
        return [path]

    sent = []
    reporter = LiveReporter(run_dir, lambda: [], {"pause": pause, "stop": stop, "stacks": stacks},
                            lambda kind, r: sent.append({"kind": kind, **r}), paused=lambda: state["paused"])
    for action in ("pause", "stacks"):
        board.controls.buttons[action].clicks += 1                         # what a click does
        assert sorted(p.suffix for p in (run_dir / "control").iterdir()) == sorted({".pause", f".{action}"})
    reporter.tick()
    reporter.tick()                                                        # each request is answered once
    assert state["done"] == ["pause"] and not list((run_dir / "control").iterdir())
    assert [(r["kind"], r.get("action")) for r in sent] == [("control", "pause"), ("stacks", None)]
    board.controls.feed(sent)
    board.running.feed(sent)
    assert "**paused**" in board._status_text()
    card = board.running.stacks[0]
    assert card.collapsed and card.title == "x-actor-rank0-pid1.txt"
    assert 'File "train.py", line 3 in update' in card.objects[0].object
    sent.clear()
    board.controls.buttons["stop"].clicks += 1
    state["paused"] = False                                                # let go from the notebook
    reporter.tick()
    assert [(r["kind"], r.get("action"), r["ok"]) for r in sent] == [("control", "stop", False),
                                                                    ("control", None, True)]
    board.controls.feed(sent)
    assert "no run to stop" in board.controls.message.object and "paused" not in board._status_text()
    board.controls.buttons["resume"].clicks += 1                           # not offered by this run
    sent.clear()
    reporter.tick()
    assert sent[0]["ok"] is False and "does not offer 'resume'" in sent[0]["error"]


def test_run_controls_are_carried_out_in_the_order_they_were_clicked(tmp_path):
    import os

    from hybridlab.telemetry.live import LiveReporter, request_action

    done = []
    reporter = LiveReporter(tmp_path, lambda: [], {a: (lambda a=a: done.append(a)) for a in ("pause", "resume")},
                            lambda kind, r: None)
    for i, action in enumerate(("resume", "pause")):                       # Resume clicked first, then Pause
        path = request_action(tmp_path, action)
        os.utime(path, ns=(10**18 + i * 10**9, 10**18 + i * 10**9))
    reporter.tick()
    assert done == ["resume", "pause"]                                     # the run ends up paused


def test_a_heat_map_bins_samples_patches_the_filling_bin_and_merges_a_long_history():
    from hybridlab.telemetry.heatmap import HeatMap

    heat = HeatMap("t", "seconds", "util", bin_width=2.0, high=None, max_bins=4)
    heat.add(["gpu10", "gpu2", "gpu10", "gpu2"], [0.5, 0.5, 1.5, 1.5], [10.0, 10.0, 30.0, 30.0])
    heat.flush()
    assert heat.fig.y_range.factors == ["gpu10", "gpu2"]                    # gpu2 above gpu10 (first on top)
    assert heat.source.data["value"] == [20.0, 20.0] and heat.mapper.high == 30.0
    heat.add(["gpu2", "gpu2"], [1.9, 3.0], [80.0, float("nan")])           # the same bin fills on; NaN: no count
    heat.flush()
    assert len(heat.source.data["x"]) == 2 and sorted(heat.source.data["value"]) == [20.0, 40.0]
    heat.add(["gpu2"] * 8, [t + 0.5 for t in range(2, 10)], [100.0] * 8)   # 5 bins of 2 s: past max_bins
    heat.flush()
    data = heat.source.data                                                # bins of 4 s now
    cells = {(row, x): v for row, x, v in zip(data["row"], data["x"], data["value"])}
    assert heat.width == 4.0 and set(data["width"]) == {4.0}
    assert cells == {("gpu2", 2.0): pytest.approx((10 + 30 + 80 + 100 + 100) / 5), ("gpu10", 2.0): 20.0,
                     ("gpu2", 6.0): 100.0, ("gpu2", 10.0): 100.0}
    heat.cut(4.0)                                                          # a roll-back: later bins go
    assert sorted(heat.source.data["x"]) == [2.0, 2.0, 6.0]
    heat.add(["gpu2", "gpu2"], [float("nan"), float("inf")], [1.0, 1.0])   # samples without a time: not counted
    heat.flush()
    assert heat.width == 4.0 and sorted(heat.source.data["x"]) == [2.0, 2.0, 6.0]
    many = HeatMap("t", "step", "busy", bin_width=1, high=1.0, max_bins=300)
    steps = [s for s in range(1, 10_001) for _ in range(64)]               # 64 devices x 10,000 steps
    many.add([f"gpu{d}" for _ in range(10_000) for d in range(64)], steps, [(s % 2) * 1.0 for s in steps])
    many.flush()
    assert many.width == 64 and len(many.source.data["x"]) == 64 * 157      # 157 bins of 64 steps
    assert set(many.source.data["value"][64:-64]) == {0.5}                # each full bin: half 0, half 1


def test_the_x_axis_switches_every_step_curve_to_wall_time_and_back(tmp_path):
    _, board = board_after_one_step(tmp_path)
    figures = board.step_figures()
    assert board.reward_fig in figures and board.training.figs["loss"] in figures
    assert board.axis.times.data["step"] == [1]
    board.x_axis.value = "wall time"
    for fig in figures:
        assert fig.xaxis[0].axis_label == "wall time since the run started (s)"
        for renderer in fig.renderers:
            if renderer.glyph.x == "step" or getattr(renderer.glyph.x, "field", None) == "step":
                assert renderer.glyph.x.transform is board.axis.transform
    with (board.run_dir / "telemetry.jsonl").open("a") as f:  # a remap and a new step while on wall time
        f.write(json.dumps({"kind": "remap", "step": 1, "mapping_after": {}, "time": time.time()}) + "\n")
        f.write(json.dumps(step_record(2, time.time())) + "\n")
    board.update()
    marks = [m for m in board.reward_fig.center if type(m).__name__ == "Span"]
    assert len(marks) == 1 and not marks[0].visible                        # step markers: step axis only
    assert board.axis.times.data["step"] == [1, 2]
    board.x_axis.value = "step"
    assert {fig.xaxis[0].axis_label for fig in figures} == {"step"} and marks[0].visible
    from bokeh.models import CustomJSTransform

    assert not any(isinstance(getattr(r.glyph.x, "transform", None), CustomJSTransform)
                   for f in figures for r in f.renderers)


def test_serving_off_localhost_needs_panels_login(tmp_path):
    from hybridlab.telemetry.serving import check_serving, is_loopback

    assert is_loopback("localhost") and is_loopback("127.0.0.1") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    check_serving("localhost", None, None)
    with pytest.raises(UserError, match="serving on 0.0.0.0 .* give --basic-auth PASSWORD_FILE"):
        check_serving("0.0.0.0", None, None)
    with pytest.raises(UserError, match="--basic-auth: no password file"):
        check_serving("0.0.0.0", str(tmp_path / "missing.json"), None)
    bad = tmp_path / "users.json"
    bad.write_text('{"ann": ""}')
    with pytest.raises(UserError, match="must map each user name to a non-empty password"):
        check_serving("0.0.0.0", str(bad), None)
    check_serving("0.0.0.0", None, "github")


def test_the_timeline_gives_the_spans_that_ended_after_a_time_newest_last():
    from hybridlab.telemetry.timeline import Timeline

    timeline = Timeline()
    timeline.add([Span("actor", 0, "update", float(i), float(i) + 0.5) for i in range(200)])
    timeline.add([Span("rollout", 0, "generate", 100.0, 195.0)])  # a long call, appended when it ended
    assert [s.end for s in timeline.ending_after(196.0)] == [196.5, 197.5, 198.5, 199.5]
    assert [s.role for s in timeline.ending_after(190.0)][-1] == "rollout"


def test_stage_seconds_are_bars_on_a_short_run_and_areas_on_a_long_one():
    from bokeh.models import VArea, VBar

    from hybridlab.telemetry.training_panel import BARS_UP_TO, TrainingPanel

    panel = TrainingPanel()
    steps = [{**step_record(s, 0.0), "timing/update_actor_s": 1.0} for s in range(1, BARS_UP_TO + 1)]
    panel.feed(steps)
    glyphs = [type(r.glyph) for r in panel.time_fig.renderers]
    assert glyphs == [VBar, VBar] and panel.stages == ["generate", "update_actor"]  # a bar per stage and step
    panel.feed([{**step_record(BARS_UP_TO + 1, 0.0), "timing/update_actor_s": 1.0}])  # one step too many for bars
    assert [type(r.glyph) for r in panel.time_fig.renderers] == [VArea, VArea]
    assert len(panel.timing.data["step"]) == BARS_UP_TO + 1 and len(panel.time_fig.legend[0].items) == 2


def test_a_page_opened_on_a_history_draws_no_legend_over_its_first_steps(tmp_path):
    """Opened at step 26, the stacked stage seconds showed no bars for steps 1 to 25: the legend,
    drawn inside the plot at its top left, covered them. Every legend now stands beside its plot,
    after a redraw for a new stage too."""
    from bokeh.models import Legend

    history = [{**step_record(s, time.time()), "timing/update_actor_s": 1.0} for s in range(1, 27)]
    run_dir = write_run(tmp_path / "run", [{"kind": "run", "name": "r", "mapping": {}}, *history])
    board = dash.Dashboard(run_dir, control=False)
    board.update()
    assert board.training.timing.data["step"] == list(range(1, 27))
    with (run_dir / "telemetry.jsonl").open("a") as f:  # a stage first timed now redraws the bars
        f.write(json.dumps({**step_record(27, time.time()), "timing/sync_weights_s": 0.5}) + "\n")
    board.update()
    with_legend = [fig for fig in board.figures() if fig.select(type=Legend)]
    assert board.training.time_fig in with_legend and board.reward_fig in with_legend
    assert [fig for fig in with_legend if any(isinstance(x, Legend) for x in fig.center)] == []
    legend = board.training.time_fig.right[0]
    assert [item.label["value"] for item in legend.items] == ["generate", "update_actor", "sync_weights"]


def test_the_service_section_counts_sessions_clients_and_calls_and_plots_the_loops_losses(tmp_path):
    t = 1_000.0
    calls = [{"kind": "service", "call": "create_session", "seconds": 0.0, "session": "s1", "time": t},
             {"kind": "service", "call": "create_model", "seconds": 4.0, "model": "s1:train:0", "time": t + 1},
             {"kind": "service", "call": "create_sampler", "seconds": 0.0, "sampler": "sampler-3", "time": t + 2},
             {"kind": "service", "call": "create_sampler", "seconds": 0.0, "sampler": "sampler-4", "time": t + 3}]
    calls += [{"kind": "service", "call": "forward_backward", "seconds": 0.5, "model": "s1:train:0",
               "loss_sum": 10.0 - i, "time": t + 50 + i} for i in range(3)]
    calls += [{"kind": "service", "call": "optim_step", "seconds": 0.25, "model": "s1:train:0", "time": t + 70}]
    run_dir = write_run(tmp_path / "run", [{"kind": "run", "name": "tinker", "mapping": {}}])
    board = dash.Dashboard(run_dir, control=False)
    board.update()
    service = board.service
    assert service.table.object == service_panel.WAITING and not service.figures.visible  # a training run's
    with (run_dir / "telemetry.jsonl").open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in calls)
    board.update()
    assert service.figures.visible
    assert service.table.object == "\n".join([
        "**1** sessions, **1** training clients, **2** sampling clients", "",
        "| call | calls | mean s | calls/s (last minute) |", "|---|---|---|---|",
        "| forward_backward | 3 | 0.500 | 0.05 |",     # all three within the minute before the last call
        "| optim_step | 1 | 0.250 | 0.02 |",
        "| create_model | 1 | 4.000 | 0.00 |"])         # 69 s before the last call
    assert service.losses.data == {"call": [0, 1, 2], "loss": [10.0, 9.0, 8.0]}
    assert service.times["optim_step"].data == {"time": [1000 * (t + 70)], "seconds": [0.25]}
    assert "Service" in board.sections
