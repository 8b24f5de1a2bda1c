"""Telemetry and the live dashboard on a real run: the hub's file, replay, and a served page
watched in headless Chromium while the run progresses."""
from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import pytest

from hybridlab.dataflow.session import RLSession
from hybridlab.telemetry.dashboard import Dashboard

ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"


@pytest.fixture(scope="module")
def rl(ray_local, trained_dir, tmp_path_factory):
    """A GRPO session with telemetry on (tiny, small batches, one device)."""
    run_dir = tmp_path_factory.mktemp("dash") / "run"
    session = RLSession(None, [f"model={trained_dir}", "warm_start.max_steps=0", "data.prompts_per_step=8",
                               "rollout.n=4", "actor.ppo_mini_batch_size=8", "data.test_samples=16",
                               "trainer.eval_every=5", "trainer.progress=false", f"trainer.run_dir={run_dir}"])
    session.start()
    yield session
    session.shutdown()


def _chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        pytest.skip("Debian's chromium is not installed (apt-get install chromium; scripts/install.sh does it as root)")
    return path


def _status_step(page) -> int:
    status = page.get_by_text(re.compile(r"RL step \d+ · mean reward")).first
    status.wait_for(timeout=30_000)
    text = status.text_content()
    found = re.search(r"step\s+(\d+)", text)
    assert found, f"status line reads {text!r}"
    return int(found.group(1))


def test_served_dashboard_renders_and_follows_the_run(rl):
    from playwright.sync_api import sync_playwright

    from hybridlab.telemetry.dashboard import serve

    chromium = _chromium()
    rl.step()  # something to show at once
    server, port = serve(rl.run_dir, port=0, threaded=True)
    run = rl.start_background(40)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, headless=True,
                                        args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                                              "--disable-component-update", "--no-first-run"])
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            page.goto(f"http://localhost:{port}/", timeout=60_000)
            first = _status_step(page)
            deadline = time.time() + 60
            later = first
            while later <= first and time.time() < deadline:
                time.sleep(1.0)
                later = _status_step(page)
            assert later > first, f"status stayed at step {first}"
            page.locator("canvas").first.wait_for(timeout=20_000)
            assert page.locator("canvas").count() >= 4  # reward, sync, phases, devices
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
            browser.close()
    finally:
        run.stop()
        run.wait(600)
        server.stop()
    assert (ARTIFACTS / "dashboard.png").stat().st_size > 10_000


def test_a_setting_that_needs_a_role_adds_it_to_the_default_mapping_and_the_dashboard_marks_it(rl):
    from hybridlab.config import ConfigError

    explicit = json.dumps(rl.mapping.to_dict())  # the same placement, written out: no ref role
    with pytest.raises(ConfigError, match="ref_logprob: runs on role 'ref', which the device mapping does not have"):
        rl.update("actor.use_kl_loss=true", f"mapping={explicit}")
    assert rl.cfg.actor.use_kl_loss is False and "ref" not in rl.session.groups
    rl.update("actor.use_kl_loss=true")  # the default mapping gains the reference model
    report = rl.remaps[-1]
    assert report.roles_added == ["ref"] and report.reason == "update"
    assert "ref_logprob" in rl.dataflow.names and "actor/kl_loss" in rl.step().metrics
    board = Dashboard(rl.run_dir)
    board.update()
    assert board.remaps[-1]["roles_added"] == ["ref"]
    assert "ref (tp1 pp1 dp1, colocated: engine)" in board.mapping_pane.object
    assert f"remapped after step {report.step}" in board.mapping_pane.object
    marks = [m for fig in (board.reward_fig, board.gantt_fig) for m in fig.center if type(m).__name__ == "Span"]
    assert [round(m.location, 1) for m in marks[:1]] == [report.step + 0.5] and len(marks) == 2


def test_hub_file_holds_every_kind_and_replays(rl):
    steps = rl.step_count
    live = Dashboard(rl.run_dir)
    assert live.source.hub is not None  # in the session's process it reads the live hub
    live.update()
    rl.shutdown()  # the hub flushes and goes; the file stays
    live.update()  # switches to the file without repeating what the hub gave
    assert live.curves.data["step"] == list(range(1, steps + 1))
    records = [json.loads(line) for line in (rl.run_dir / "telemetry.jsonl").read_text().splitlines()]
    kinds = {r["kind"] for r in records}
    assert {"run", "span", "metrics", "sync", "eval", "device", "remap"} <= kinds
    stages = {r["stage"] for r in records if r["kind"] == "span"}
    assert {"generate", "reward", "update_actor", "sync_weights"} <= stages
    devices = [r for r in records if r["kind"] == "device"]
    assert all(r["device"].startswith("GPU ") and r["memory_mb"] > 10 for r in devices)
    assert [r["step"] for r in records if r["kind"] == "metrics"] == list(range(1, steps + 1))

    board = Dashboard(rl.run_dir)  # no live hub now: replay from the file
    board.update()
    assert board.curves.data["step"] == list(range(1, steps + 1))
    assert f"step {steps} ·" in board.status.object
    assert len(board.spans.data["worker"]) > 0 and board.devices
    syncs = [r for r in records if r["kind"] == "sync"]
    assert len(board.sync.data["step"]) == len(syncs) == steps + 1  # one per step, one after the remap
    assert [r["step"] for r in syncs if r["reason"] == "step"] == list(range(1, steps + 1))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("how", ["cli", "panel serve"])
def test_the_same_app_is_served_by_the_cli_and_by_panel_serve(rl, how):
    import subprocess
    import sys
    import urllib.request

    port = _free_port()
    app = Path(__file__).resolve().parent.parent / "dashboards" / "live.py"
    cmd = ([sys.executable, "-m", "hybridlab.cli", "dashboard", str(rl.run_dir), "--port", str(port)] if how == "cli"
           else [sys.executable, "-m", "panel", "serve", str(app), "--port", str(port), "--args", str(rl.run_dir)])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://localhost:{port}/" + ("" if how == "cli" else "live")
    try:
        body = ""
        for _ in range(60):
            try:
                body = urllib.request.urlopen(url, timeout=5).read().decode()
                break
            except OSError:
                time.sleep(0.5)
        assert "bokeh" in body.lower(), f"{how}: no page at {url}"
    finally:
        proc.terminate()
        proc.wait(10)


def test_status_line_names_the_phase_from_warm_start_to_evaluation(tmp_path):
    """A viewer who opens the page during the warm start sees the warm start, not 'step 0'."""
    from hybridlab.telemetry.hub import TelemetryHub

    hub = TelemetryHub(str(tmp_path))  # the hub's own file format, written in this process
    board = Dashboard(tmp_path)
    hub.add("run", [{"name": "grpo", "processor": "Test CPU (avx512_bf16, no AMX)"}])
    hub.add("phase", [{"phase": "warm start", "step": 0, "max_steps": 4000}])
    board.update()
    assert board.status.object == "run grpo · warm start step 0/4000 · Test CPU (avx512_bf16, no AMX)"
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
