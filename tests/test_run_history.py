"""Reading a run's telemetry as the dashboard does: a long history's curves first and its device
samples parsed in the background, its lines split and parsed (NaN and blank lines too), the runs
beside it, listed on the runs page and overlaid on a run's page (read only when overlaid), and
the status line it derives from the run's phases."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import pytest

from hybridlab.bench.dashboard import write_run as write_bench_run
from hybridlab.telemetry import dashboard as dash
from tests.test_dashboard_panels import step_record, write_run


def test_the_dashboard_overlays_the_reward_of_the_runs_beside_it(tmp_path):
    t = time.time()
    other = write_run(tmp_path / "other", [{"kind": "run", "time": t - 100}],
                      [{"step": s, "reward/mean": s / 10, "time": t - 100 + 10 * s} for s in (1, 2, 3)])
    run_dir = write_run(tmp_path / "this", [{"kind": "run", "name": "this", "mapping": {}}])
    board = dash.Dashboard(run_dir, control=False)
    board.update()
    assert list(board.compare.options) == ["other"]                        # itself is not offered
    assert board.others["other"].steps == []  # not read until overlaid: a folder of long runs would slow the page
    with open(other / "telemetry.jsonl", "rb+") as f:  # a blank first line is skipped
        text = f.read()
        f.seek(0)
        f.write(b"\n" + text)
    board.compare.value = ["other"]
    source = board.overlay.lines["other"][0].data_source
    assert (source.data["step"], source.data["reward"]) == ([1, 2, 3], [0.1, 0.2, 0.3])
    assert source.data["wall"] == pytest.approx([10.0, 20.0, 30.0])       # from the other run's start
    board.x_axis.value = "wall time"
    assert board.overlay.lines["other"][0].glyph.x.field == "wall"
    with open(other / "metrics.jsonl", "a") as f:                          # the other run goes on
        f.write(json.dumps({"step": 4, "reward/mean": 0.9, "time": t - 50}) + "\n")
    for _ in range(dash.OVERLAY_POLLS):
        board.update()
    assert source.data["reward"] == [0.1, 0.2, 0.3, 0.9]


def test_the_runs_page_lists_each_run_with_its_status_and_overlays_selected_curves(tmp_path):
    from hybridlab.telemetry.runs import RunsPage

    now = time.time()
    write_run(tmp_path / "done", [{"kind": "run"}], [{"step": s, "reward/mean": s / 10} for s in (1, 2, 3)],
              summary={"steps": 3, "failed": False})
    write_run(tmp_path / "broke", [{"kind": "run"}], [{"step": 1, "reward/mean": 0.5}], summary={"failed": True})
    live = write_run(tmp_path / "live", [{"kind": "run"}, {"kind": "resume", "step": 1}],
                     [{"step": s, "reward/mean": 0.1} for s in (1, 2)])
    crashed = write_run(tmp_path / "crashed", [{"kind": "run"}], [{"step": 1, "reward/mean": 0.2}])
    for name in ("metrics.jsonl", "telemetry.jsonl"):
        os.utime(crashed / name, (now - 600, now - 600))
    page = RunsPage(tmp_path)
    page.update()
    assert {k: page.runs[k].status for k in page.runs} == {"done": "finished", "broke": "failed",
                                                            "live": "live, resumed", "crashed": "crashed"}
    assert "<td>done</td><td style='color:'>finished</td><td>3</td><td>0.300</td>" in page.table.object
    page.select.value = ["done", "live"]
    with open(live / "metrics.jsonl", "a") as f:  # the live run goes on, evaluated after step 2
        f.write(json.dumps({"step": 2, "eval/accuracy": 0.5}) + "\n")
        f.write(json.dumps({"step": 3, "reward/mean": 0.7}) + "\n")
    page.update()
    curves = {k: line[0].data_source.data["reward"] for k, line in page.overlay.lines.items()}
    assert curves == {"done": [0.1, 0.2, 0.3], "live": [0.1, 0.1, 0.7]}
    assert page.runs["live"].cuts == 0  # an evaluation's line is not a step logged again
    page.select.value = ["live"]
    assert list(page.overlay.lines) == ["live"] and len(page.fig.renderers) == 1


def test_a_long_history_shows_its_curves_first_and_its_device_samples_when_parsed(tmp_path, monkeypatch):
    """Past BIG_HISTORY bytes, the first poll parses everything but the device samples, which a
    thread parses; a later poll hands them over, with the samples that arrived meanwhile."""
    import threading

    from hybridlab.telemetry import record_source

    monkeypatch.setattr(record_source, "BIG_HISTORY", 1000)
    gate = threading.Event()
    parse = record_source.parse_lines
    monkeypatch.setattr(record_source, "parse_lines",  # the thread waits until the test lets it go
                        lambda lines: (threading.current_thread().name != "telemetry-history" or gate.wait(30),
                                       parse(lines))[1])
    t0 = time.time() - 100
    records = [{"kind": "run", "name": "r", "mapping": {}, "time": t0}]
    for step in range(1, 31):
        records += [{"kind": "device", "time": t0 + step, "device": "GPU 0", "role": "actor", "rank": 0,
                     "util": 40.0, "memory_mb": 900.0, "rss_mb": 900.0, "pid": 1}, step_record(step, t0 + step)]
    run_dir = write_run(tmp_path / "run", records)
    board = dash.Dashboard(run_dir, control=False)
    board.update()
    assert board.curves.data["step"] == list(range(1, 31))                 # the curves at once
    assert board.devices.source.data["x"] == [] and "reading the history's device samples" in board.status.object
    assert board.source.loader.ident is None  # not parsing yet: the first page is built without it
    board.source.hold_polls = 5  # as a served page's: held until the browser reports the page drawn
    board.update()
    assert board.source.loader.ident is None
    board.source.release_history()
    with (run_dir / "telemetry.jsonl").open("a") as f:                     # a sample arrives meanwhile
        f.write(json.dumps({**records[1], "time": t0 + 31, "util": 100.0}) + "\n")
    board.update()
    assert board.source.loader.ident is not None  # started by the next poll
    assert board.devices.source.data["x"] == [] and board.source.held[0]["util"] == 100.0
    gate.set()
    board.source.loader.join(30)
    board.update()
    heat = board.devices.source.data  # samples 1 s to 31 s after the run's start, in bins of 5 s: 30 s and 31 s share one
    assert heat["value"] == [40.0] * 6 + [70.0] and "reading" not in board.status.object
    assert board.memory.samples["actor r0"][0] == [t0 + s for s in range(1, 32)]


def test_a_historys_lines_split_into_device_samples_and_the_rest_and_parse_with_nan_and_blanks(monkeypatch):
    from hybridlab.telemetry import record_source
    from hybridlab.telemetry.hub import parse_lines
    from hybridlab.telemetry.record_source import DEVICE, line_bounds, starts_with

    data = (b'{"kind": "device", "util": 1.0}\n{"kind": "dev"}\n{"kind": "metrics", "loss": NaN}\n\n'
            b'{"kind": "device", "util": 2.0}\n')
    starts, ends = line_bounds(data)
    assert list(zip(starts.tolist(), ends.tolist())) == [(0, 31), (32, 47), (48, 80), (81, 81), (82, 113)]
    monkeypatch.setattr(record_source, "SCAN_BLOCK", 7)  # newlines searched in blocks: lines cross them
    assert [b.tolist() for b in line_bounds(data)] == [starts.tolist(), ends.tolist()]
    assert [b.tolist() for b in line_bounds(b"")] == [[], []]
    assert starts_with(data, starts, DEVICE).tolist() == [True, False, False, False, True]  # a short line is not one
    tail = data + b'{"k": 1}\n'  # a last line shorter than the prefix
    assert starts_with(tail, line_bounds(tail)[0], DEVICE).tolist() == [True, False, False, False, True, False]
    records = parse_lines([data[a:b] for a, b in zip(starts.tolist(), ends.tolist())])
    assert [r["kind"] for r in records] == ["device", "dev", "metrics", "device"] and records[3]["util"] == 2.0
    assert math.isnan(records[2]["loss"])  # json.dumps writes NaN, which orjson refuses: parsed by json


def test_a_served_page_of_a_finished_run_draws_its_mapping_without_importing_ray(tmp_path):
    """The served page's process never starts Ray: importing it took 0.4 s of the first page."""

    write_bench_run(tmp_path / "run", devices=2, steps=3, span_steps=1)
    code = ("import sys; from bokeh.document import Document;"
            " from hybridlab.telemetry.dashboard import build_dashboard;"
            f" page = build_dashboard({str(tmp_path / 'run')!r}, template=True); page.server_doc(Document());"
            " print('rollout engine 0 tp1' in page.dashboard.mapping_drawing.object, 'ray' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["True", "False"]


def test_status_line_names_the_phase_from_warm_start_to_evaluation(tmp_path):
    """A viewer who opens the page during the warm start sees the warm start, not 'step 0'."""
    from hybridlab.telemetry.hub import TelemetryHub

    hub = TelemetryHub(str(tmp_path))  # the hub's own file format, written in this process
    board = dash.Dashboard(tmp_path)
    hub.add("run", [{"name": "grpo", "processor": "Test CPU (avx512_bf16, no AMX)"}])
    hub.add("phase", [{"phase": "warm start", "step": 0, "max_steps": 4000}])
    board.update()
    assert board.status.object == "run grpo · warm start step 0/4000 · Test CPU (avx512_bf16, no AMX) · live"
    hub.add("phase", [{"phase": "warm start", "step": 250, "max_steps": 4000, "accuracy": 0.125, "target": 0.5}])
    board.update()
    assert "warm start step 250/4000 · held-out accuracy 12.5% of target 50%" in board.status.object
    hub.add("phase", [{"phase": "evaluate", "step": 0}])
    board.update()
    assert "evaluating after RL step 0" in board.status.object
    hub.add("eval", [{"step": 0, "accuracy": 0.5}])
    hub.add("metrics", [{"step": 1, "reward/mean": 0.25}])
    board.update()
    assert "RL step 1 · mean reward 0.250" in board.status.object
    hub.close()
    (tmp_path / "summary.json").write_text(json.dumps({"failed": False}))
    board.update()  # no new record: the status still follows the run
    assert board.status.object.endswith(" · finished")
