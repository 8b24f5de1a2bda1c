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
    """A GRPO session with telemetry on (tiny, small batches, one device); the actor recomputes
    the old log-probs, so the steps measure the rollout-vs-trainer mismatch."""
    run_dir = tmp_path_factory.mktemp("dash") / "run"
    session = RLSession(None, [f"model={trained_dir}", "warm_start.max_steps=0", "data.prompts_per_step=8",
                               "rollout.n=4", "actor.ppo_mini_batch_size=8", "data.test_samples=16",
                               "trainer.eval_every=5", "trainer.progress=false", f"trainer.run_dir={run_dir}",
                               "actor.use_rollout_log_probs=false"])
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


# The rows of every ColumnDataSource in the page's Bokeh documents, keyed by its sorted columns.
PAGE_SOURCES = """() => {
  const sizes = {};
  for (const doc of Bokeh.documents) {
    for (const model of doc.all_models) {
      if (model.data === undefined || model.selected === undefined) continue;
      const data = model.data instanceof Map ? Object.fromEntries(model.data) : model.data;
      const keys = Object.keys(data).sort();
      if (keys.length) sizes[keys.join(",")] = Math.max(sizes[keys.join(",")] || 0, data[keys[0]].length);
    }
  }
  return sizes;
}"""
PANEL_COLUMNS = ["accuracy,reward,step",                          # reward curves
                 "color,left,right,stage,worker",                 # phase timeline
                 "memory_mb,t,util",                              # device utilization
                 "gpu_mb,mb,t",                                   # memory per worker
                 "step,t,y",                                      # step markers on the memory plot
                 "busy,step",                                     # device busy per step
                 "max,p10,p50,p90,step,straggler_pct,tokens_per_s",  # rollout lengths, tokens/s, stragglers
                 "alpha,dst,label,mb,src",                        # the last sync's plan
                 "mb,seconds,step",                               # sync history
                 "is_mean,k3_kl,kl,rejected_pct,step"]            # rollout-vs-trainer mismatch


def test_served_dashboard_renders_and_follows_the_run(rl):
    from playwright.sync_api import sync_playwright

    from hybridlab.telemetry.serving import serve

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
            assert page.locator("canvas").count() >= 10  # reward, sync, phases, memory, devices, busy, rollout x2,
            #                                               sync plan, mismatch
            page.get_by_text("running for").first.wait_for(timeout=30_000)  # a call in flight, in the table
            sizes = page.evaluate(PAGE_SOURCES)  # what the browser's Bokeh document holds, per data source
            for columns in PANEL_COLUMNS:
                assert sizes.get(columns, 0) > 0, f"no data in the page's source with columns {columns}: {sizes}"
            page.get_by_role("button", name="Write every worker's stacks").click()
            page.get_by_text("most recent call first").first.wait_for(timeout=30_000)  # the workers' stacks
            assert sorted(p.name for p in (rl.run_dir / "stacks").glob("*-rank0-pid*.txt"))
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


def test_a_page_served_off_localhost_shows_nothing_without_login(rl, tmp_path):
    """Bound to 0.0.0.0 (reached here through 127.0.0.1 only), the page needs Panel's login."""
    import urllib.request

    from playwright.sync_api import sync_playwright

    from hybridlab.errors import UserError
    from hybridlab.telemetry.serving import free_port, serve

    with pytest.raises(UserError, match="give --basic-auth PASSWORD_FILE"):
        serve(rl.run_dir, address="0.0.0.0", threaded=True)
    users = tmp_path / "users.json"
    users.write_text(json.dumps({"ann": "s3cret-pass"}))
    port = free_port("0.0.0.0")
    server, port = serve(rl.run_dir, port=port, address="0.0.0.0", threaded=True, basic_auth=str(users))
    try:
        for _ in range(60):
            try:
                response = urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5)
                break
            except OSError:
                time.sleep(0.5)
        body = response.read().decode()
        assert response.url.startswith(f"http://127.0.0.1:{port}/login")  # sent to the login form
        assert 'name="password"' in body and "docs_json" not in body and rl.run_dir.name not in body
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=_chromium(), headless=True,
                                        args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                                              "--disable-component-update", "--no-first-run"])
            page = browser.new_page()
            page.goto(f"http://127.0.0.1:{port}/", timeout=60_000)
            assert page.locator("canvas").count() == 0
            page.fill("input[name=username]", "ann")
            page.fill("input[name=password]", "wrong")
            page.locator("input[name=password]").press("Enter")
            page.wait_for_load_state()
            assert page.locator("canvas").count() == 0 and "/login" in page.url
            page.fill("input[name=username]", "ann")
            page.fill("input[name=password]", "s3cret-pass")
            page.locator("input[name=password]").press("Enter")
            page.get_by_text(re.compile(r"RL step \d+ · mean reward")).first.wait_for(timeout=60_000)
            page.get_by_role("button", name="Write every worker's stacks").wait_for(timeout=10_000)  # logged in
            browser.close()
    finally:
        server.stop()


def test_the_memory_estimate_matches_the_measured_resident_memory(rl):
    """hybridlab explain's estimate of the worker process against its median resident memory in
    this run (one process: actor, rollout, reward and ref colocated), within a factor of 1.5."""
    import statistics

    from hybridlab.explain import explain

    records = [json.loads(line) for line in (rl.run_dir / "telemetry.jsonl").read_text().splitlines()]
    (_, members), = rl.mapping.process_sets()
    assert set(members) == {"actor", "rollout", "ref", "reward"}
    measured = statistics.median(r["rss_mb"] for r in records if r["kind"] == "device"
                                 and set(r["role"].split(",")) == set(members))
    estimate = explain(rl.cfg, rl.model_dir).memory_mb["+".join(members)]
    assert 1 / 1.5 <= estimate / measured <= 1.5, (estimate, measured)


def test_the_runs_page_lists_the_run_in_the_browser(rl):
    """``hybridlab dashboard RUNS_ROOT``: the run under the folder, with its status and last step."""
    from playwright.sync_api import sync_playwright

    from hybridlab.telemetry.serving import serve

    server, port = serve(rl.run_dir.parent, threaded=True)
    steps = [json.loads(line)["step"] for line in (rl.run_dir / "metrics.jsonl").read_text().splitlines()]
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=_chromium(), headless=True,
                                        args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                                              "--disable-component-update", "--no-first-run"])
            page = browser.new_page()
            page.goto(f"http://localhost:{port}/", timeout=60_000)
            page.get_by_text("last step").first.wait_for(timeout=30_000)  # the table's header
            rows = [r.locator("td").all_text_contents() for r in page.locator("tr").all()]
            assert [r[:3] for r in rows if r] == [[rl.run_dir.name, "finished", str(steps[-1])]]  # summary written
            browser.close()
    finally:
        server.stop()
