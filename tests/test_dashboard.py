"""Telemetry and the live dashboard on a real run: the hub's file, replay, and a served page
watched in headless Chromium while the run progresses."""
from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import pytest

from browser import LAUNCH_ARGS, chromium

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


def _finished(rl) -> list[int]:
    """End the module's session (its hub writes the telemetry file out; a test run alone first
    runs a step); returns the steps the telemetry file holds."""
    if rl.workers is not None:
        if rl.state.step_count == 0:
            rl.step()
        rl.shutdown()
    records = [json.loads(line) for line in (rl.run_dir / "telemetry.jsonl").read_text().splitlines()]
    return [r["step"] for r in records if r["kind"] == "metrics"]


def _pull(url: str, monkeypatch, cookie: str | None = None) -> dict:
    """What a client of the page at ``url`` receives: the Bokeh document of its session, pulled
    over the page's websocket as a browser gets it (with ``cookie``: e.g. Panel's login). Returns
    its button labels, its panes' text and the row count of each data source (keyed by its
    sorted column names). A refused session raises OSError."""
    import bokeh.client.connection
    import panel.models  # noqa: F401  (registers Panel's Bokeh models, e.g. the template's Location)
    from bokeh.client import pull_session
    from bokeh.models import Button, ColumnDataSource
    from tornado.httpclient import HTTPRequest

    with monkeypatch.context() as patch:
        if cookie:  # bokeh's client sends no cookies of its own
            patch.setattr(bokeh.client.connection, "HTTPRequest",
                          lambda ws_url, **kw: HTTPRequest(ws_url, headers={"Cookie": cookie}, **kw))
        session = pull_session(url=url)
    try:
        models = list(session.document.models)
    finally:
        session.close()
    sizes: dict[str, int] = {}
    for model in models:
        if isinstance(model, ColumnDataSource) and model.data:
            keys = sorted(model.data)
            sizes[",".join(keys)] = max(sizes.get(",".join(keys), 0), len(model.data[keys[0]]))
    return {"buttons": sorted(m.label for m in models if isinstance(m, Button)),
            "text": "\n".join(m.text for m in models if isinstance(getattr(m, "text", None), str)), "sizes": sizes}


def _as_another_machine(monkeypatch) -> None:
    """Make the served pages take 127.0.0.1, the only address these tests connect from, for
    another machine's: a page's control actions then show only for a logged-in user."""
    from hybridlab.telemetry import serving

    loopback = serving.is_loopback
    monkeypatch.setattr(serving, "is_loopback", lambda address: address != "127.0.0.1" and loopback(address))


def _wait_for_page(url: str):
    """Return the response to the first GET of ``url`` that the starting server answers."""
    import urllib.request

    for _ in range(120):
        try:
            return urllib.request.urlopen(url, timeout=5)
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"no page at {url}")


def _assert_shows_the_run(served: dict, rl, steps: list[int]) -> None:
    """The page is this run's dashboard: its status line and its reward curve, one row per step."""
    shown = re.search(rf"run {re.escape(rl.cfg.name)} · RL step (\d+) · mean reward", served["text"])
    assert shown and int(shown.group(1)) == steps[-1], served["text"][:2000]
    assert served["sizes"].get("accuracy,accuracy_smooth,reward,reward_smooth,step") == len(steps) == steps[-1]


def _status_step(page) -> int:
    """The RL step the page's status line names: "RL step N · mean reward ...", or "evaluating
    after RL step N" while the run evaluates (the page may show that for a while when the server
    thread, in the training process, gets little of its one core)."""
    status = page.get_by_text(re.compile(r"run \S+ · (evaluating after )?RL step \d+")).first
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
# The sources each section's plots draw from, by their columns (a section is built when opened).
SECTION_COLUMNS = {
    "Overview": ["accuracy,accuracy_smooth,reward,reward_smooth,step",      # reward curves, raw and smoothed
                 "max,p10,p50,p90,step,straggler_pct,tokens_per_s",        # tokens/s and stragglers
                 "row,value,width,x"],                                     # device busy heat map
    "Rollouts": ["max,p10,p50,p90,step,straggler_pct,tokens_per_s"],       # length distribution
    "Training": ["is_mean,k3_kl,kl,rejected_pct,step"],                    # rollout-vs-trainer mismatch
    "Mapping and resharding": ["alpha,dst,label,mb,src",                   # the last sync's plan
                               "mb,seconds,step"],                         # sync history
    "System": ["row,value,width,x",                                        # device utilization heat map
               "gpu_mb,mb,t", "step,t,y",                                  # memory per worker, step ends
               "color,left,right,stage,worker"],                           # phase timeline
}
CONTROL_BUTTONS = ["Pause", "Resume", "Stop", "Write every worker's stacks"]
SMOOTHED = """() => {
  for (const doc of Bokeh.documents) for (const m of doc.all_models) {
    if (m.data === undefined || m.selected === undefined) continue;
    const data = m.data instanceof Map ? Object.fromEntries(m.data) : m.data;
    if ("reward_smooth" in data) return [Array.from(data.reward), Array.from(data.reward_smooth)];
  }
  return null;
}"""
AXIS_LABELS = """() => Bokeh.documents.flatMap((doc) => [...doc.all_models].filter((m) => m.axis_label !== undefined)
                                                    .map((m) => m.axis_label))"""


def _every_section_has_data(page) -> None:
    """Open each section and check that the browser holds data in each of its plots' sources."""
    for section, columns in SECTION_COLUMNS.items():
        page.get_by_text(section, exact=True).click()
        page.locator("canvas:visible").first.wait_for(timeout=30_000)
        deadline = time.time() + 30
        while True:
            sizes = page.evaluate(PAGE_SOURCES)
            missing = [c for c in columns if sizes.get(c, 0) == 0]
            if not missing or time.time() > deadline:
                break
            time.sleep(0.5)
        assert not missing, f"section {section}: no data in the page's sources with columns {missing}: {sizes}"


def _smoothing_and_axis_change_the_plots(page) -> None:
    """The sidebar's smoothing slider changes the smoothed curve in the browser (Home: no
    smoothing, so it equals the raw one), and the x-axis switch renames the step axes."""
    page.get_by_text("Overview", exact=True).click()
    raw, smooth = page.evaluate(SMOOTHED)
    assert smooth != raw                               # smoothed at 0.6 (the steps' rewards differ)
    page.locator(".noUi-handle").first.focus()
    page.keyboard.press("Home")                        # smoothing 0
    same = f"() => {{ const v = ({SMOOTHED})(); return JSON.stringify(v[0]) === JSON.stringify(v[1]); }}"
    page.wait_for_function(same, timeout=30_000)
    page.get_by_text("wall time", exact=True).click()
    page.wait_for_function(f"() => ({AXIS_LABELS})().includes('wall time since the run started (s)')", timeout=30_000)
    assert "step" not in page.evaluate(AXIS_LABELS)    # every step axis switched
    page.get_by_text("step", exact=True).click()


def test_served_dashboard_renders_and_follows_the_run(rl):
    from playwright.sync_api import sync_playwright

    from hybridlab.telemetry.serving import serve

    browser_path = chromium()
    rl.step()  # something to show at once
    rl.step()  # and two different rewards to smooth
    server, port = serve(rl.run_dir, port=0, threaded=True)
    run = None
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=browser_path, headless=True, args=LAUNCH_ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            page.goto(f"http://localhost:{port}/", timeout=60_000)
            first = _status_step(page)
            assert first == rl.state.step_count
            _smoothing_and_axis_change_the_plots(page)
            run = _stepping(rl)  # until the test stops it: the page follows a run that goes on
            deadline = time.time() + 120
            later = first
            while later <= first and time.time() < deadline:
                time.sleep(1.0)
                later = _status_step(page)
            assert later > first, f"status stayed at step {first}"
            _every_section_has_data(page)
            page.get_by_text("Stuck calls", exact=True).click()
            page.get_by_text("running for").first.wait_for(timeout=60_000)  # a call in flight, in the table
            assert [b.text_content().strip() for b in page.locator("#sidebar button").all()
                    if b.text_content().strip() in CONTROL_BUTTONS] == CONTROL_BUTTONS
            page.get_by_role("button", name="Pause").click()  # steps run by hand here: no training loop to hold
            page.get_by_text("pause: no run to pause").wait_for(timeout=30_000)
            page.get_by_role("button", name="Write every worker's stacks").click()
            page.get_by_text(re.compile(r"stack files written")).wait_for(timeout=30_000)
            page.get_by_text(re.compile(r"-actor-rank0-pid\d+\.txt")).first.click()  # a collapsed card opens
            page.get_by_text("most recent call first").first.wait_for(timeout=30_000)  # the workers' stacks
            assert sorted(p.name for p in (rl.run_dir / "stacks").glob("*-rank0-pid*.txt"))
            ARTIFACTS.mkdir(exist_ok=True)
            for tab, name in (("Overview", "dashboard.png"), ("Mapping and resharding", "dashboard-mapping.png")):
                page.get_by_text(tab, exact=True).click()
                page.locator("canvas:visible").first.wait_for(timeout=20_000)
                page.screenshot(path=str(ARTIFACTS / name), full_page=True)
            browser.close()
    finally:
        if run is not None:
            run()  # stops the stepping and waits for its last step
            rl.train(1)  # evaluations and a summary, which the tests below read from the run's files
        server.stop()
    assert (ARTIFACTS / "dashboard.png").stat().st_size > 10_000
    assert (ARTIFACTS / "dashboard-mapping.png").stat().st_size > 10_000


def _stepping(rl):
    """Step ``rl`` in a thread, resting after each step as long as it took (at least 0.5 s), so
    the run takes at most half of the core it shares with the browser on any processor; returns
    the function that stops it and waits for its last step. At full speed the tiny run left the
    page no time to answer (a locator, even a screenshot, timed out after 30 s) when the other
    core was busy too, and with a fixed 0.5 s rest so did a step twice as slow (the AVX2-only
    machine: a tab's click found it never stable); start_background itself is tested in
    test_widgets and test_remap."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            started = time.perf_counter()
            rl.step()
            stop.wait(max(0.5, time.perf_counter() - started))

    thread = threading.Thread(target=loop, daemon=True, name="dashboard-test-steps")
    thread.start()

    def stopped() -> None:
        stop.set()
        thread.join(600)

    return stopped


def test_a_setting_that_needs_a_role_adds_it_to_the_default_mapping_and_the_dashboard_marks_it(rl):
    from hybridlab.config import ConfigError

    explicit = json.dumps(rl.mapping.to_dict())  # the same placement, written out: no ref role
    with pytest.raises(ConfigError, match="ref_logprob: runs on role 'ref', which the device mapping does not have"):
        rl.update("actor.use_kl_loss=true", f"mapping={explicit}")
    assert rl.cfg.actor.use_kl_loss is False and "ref" not in rl.workers.groups
    rl.update("actor.use_kl_loss=true")  # the default mapping gains the reference model
    report = rl.state.remaps[-1]
    assert report.roles_added == ["ref"] and report.reason == "update"
    assert (report.roles_recreated, report.processes_started, report.bytes_moved) == ([], 0, 0)  # joined in place
    assert "ref_logprob" in rl.dataflow.names and "actor/kl_loss" in rl.step().metrics
    board = Dashboard(rl.run_dir)
    board.update()
    assert board.remaps[-1]["roles_added"] == ["ref"]
    assert "ref (tp1 pp1 dp1, colocated: engine)" in board.mapping_pane.object
    assert f"remapped after step {report.step}" in board.mapping_pane.object
    marks = [m for fig in (board.reward_fig, board.gantt_fig) for m in fig.center if type(m).__name__ == "Span"]
    assert [round(m.location, 1) for m in marks[:1]] == [report.step + 0.5] and len(marks) == 2


def test_hub_file_holds_every_kind_and_replays(rl):
    if rl.state.step_count == 0:  # run alone: the remap and the steps with an evaluation the tests above make
        rl.update("actor.use_kl_loss=true")
        rl.train(1)
    steps = rl.state.step_count
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
    assert len(board.spans.data["worker"]) > 0 and len(board.devices.source.data["x"]) > 0
    syncs = [r for r in records if r["kind"] == "sync"]
    # one per step: the remap that added the reference built it beside the actor and moved no weights
    assert len(board.sync.data["step"]) == len(syncs) == steps
    assert [r["step"] for r in syncs if r["reason"] == "step"] == list(range(1, steps + 1))


def test_the_hub_writes_one_callers_records_in_the_order_they_were_sent(ray_local, tmp_path):
    """A refused remap then an accepted one, sent a moment apart, must read so in the file: a
    hub serving calls on several threads wrote them either way round. ``flush`` waits for them."""
    from hybridlab.telemetry.run import RunTelemetry

    telemetry = RunTelemetry(tmp_path)
    telemetry.start({}, {"name": "order"})
    try:
        for i in range(300):  # fire and forget, as the session's emit does
            telemetry.emit("control", {"i": i})
        telemetry.flush()
        records = [json.loads(line) for line in (tmp_path / "telemetry.jsonl").read_text().splitlines()]
        assert [r["i"] for r in records if r["kind"] == "control"] == list(range(300))
    finally:
        telemetry.close()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("how", ["cli", "panel serve"])
def test_the_same_app_is_served_by_the_cli_and_by_panel_serve(rl, how, monkeypatch):
    """Each serves this run's dashboard, with the run controls for a browser on this machine."""
    import subprocess
    import sys

    steps = _finished(rl)
    port = _free_port()
    app = Path(__file__).resolve().parent.parent / "dashboards" / "live.py"
    cmd = ([sys.executable, "-m", "hybridlab.cli", "dashboard", str(rl.run_dir), "--port", str(port)] if how == "cli"
           else [sys.executable, "-m", "panel", "serve", str(app), "--port", str(port), "--args", str(rl.run_dir)])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}/" + ("" if how == "cli" else "live")
    try:
        assert "bokeh" in _wait_for_page(url).read().decode().lower(), f"{how}: no page at {url}"
        served = _pull(url, monkeypatch)
        _assert_shows_the_run(served, rl, steps)
        assert served["buttons"] == sorted(CONTROL_BUTTONS)  # a loopback client may use the run controls
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_page_served_off_localhost_shows_nothing_without_login(rl, tmp_path, monkeypatch):
    """Bound to 0.0.0.0 (reached here through 127.0.0.1 only), the page needs Panel's login: a
    client without it gets the login form, no page and no session, so no control action; a
    logged-in client gets the page with the run controls. 127.0.0.1 counts as another
    machine here, so the button shows because of the login, not because the client is local."""
    import http.cookiejar
    import urllib.parse
    import urllib.request

    from hybridlab.errors import UserError
    from hybridlab.telemetry.serving import free_port, serve

    steps = _finished(rl)
    with pytest.raises(UserError, match="give --basic-auth PASSWORD_FILE"):
        serve(rl.run_dir, address="0.0.0.0", threaded=True)
    _as_another_machine(monkeypatch)
    users = tmp_path / "users.json"
    users.write_text(json.dumps({"ann": "s3cret-pass"}))
    port = free_port("0.0.0.0")
    server, port = serve(rl.run_dir, port=port, address="0.0.0.0", threaded=True, basic_auth=str(users))
    base = f"http://127.0.0.1:{port}"
    try:
        response = _wait_for_page(f"{base}/")
        body = response.read().decode()
        assert response.url.startswith(f"{base}/login")  # sent to the login form
        assert 'name="password"' in body and "docs_json" not in body and rl.run_dir.name not in body
        with pytest.raises(OSError, match="HTTP-Error. Disconnected with error code: 403"):
            _pull(f"{base}/", monkeypatch)  # the page's websocket, where button clicks travel, is refused

        jar = http.cookiejar.CookieJar()
        client = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))

        def log_in(password: str):
            form = urllib.parse.urlencode({"username": "ann", "password": password}).encode()
            return client.open(f"{base}/login", data=form, timeout=60)

        wrong = log_in("wrong")
        assert wrong.url.startswith(f"{base}/login?error=") and "user" not in {c.name for c in jar}
        right = log_in("s3cret-pass")
        assert right.url == f"{base}/" and "docs_json" in right.read().decode()
        cookie = "; ".join(f"{c.name}={c.value}" for c in jar)
        served = _pull(f"{base}/", monkeypatch, cookie=cookie)
        _assert_shows_the_run(served, rl, steps)
        assert served["buttons"] == sorted(CONTROL_BUTTONS)  # logged in: the run controls
    finally:
        server.stop()


def test_control_actions_show_on_this_machine_and_not_to_another_without_login(rl, monkeypatch):
    """Served without login (on localhost), a browser on this machine gets the run controls;
    a client from another machine (127.0.0.1 counted as one) gets the same page without it."""
    from hybridlab.telemetry.serving import serve

    steps = _finished(rl)
    server, port = serve(rl.run_dir, threaded=True)
    url = f"http://127.0.0.1:{port}/"
    try:
        _wait_for_page(url).read()
        local = _pull(url, monkeypatch)
        _assert_shows_the_run(local, rl, steps)
        assert local["buttons"] == sorted(CONTROL_BUTTONS)
        _as_another_machine(monkeypatch)
        remote = _pull(url, monkeypatch)
        _assert_shows_the_run(remote, rl, steps)
        assert remote["buttons"] == []  # no control action: it has no button to click
    finally:
        server.stop()


def test_the_login_form_works_in_the_browser(rl, tmp_path, monkeypatch):
    """Panel's login page in headless Chromium: a wrong password stays on it with nothing shown,
    the right one opens the dashboard with its control action (127.0.0.1 counted as another
    machine, so the button shows because of the login)."""
    from playwright.sync_api import sync_playwright

    from hybridlab.telemetry.serving import free_port, serve

    browser_path = chromium()
    _finished(rl)
    _as_another_machine(monkeypatch)
    users = tmp_path / "users.json"
    users.write_text(json.dumps({"ann": "s3cret-pass"}))
    port = free_port("0.0.0.0")
    server, port = serve(rl.run_dir, port=port, address="0.0.0.0", threaded=True, basic_auth=str(users))
    try:
        _wait_for_page(f"http://127.0.0.1:{port}/").read()
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=browser_path, headless=True, args=LAUNCH_ARGS)
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

    if "ref" not in rl.mapping.roles:  # run alone: the reference the tests above add, and steps with it
        rl.update("actor.use_kl_loss=true")
        rl.step()
        rl.step()
    _finished(rl)  # every sample written out
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

    if not (rl.run_dir / "summary.json").is_file():  # run alone: the finished run the tests above leave
        rl.train(1)
    _finished(rl)
    server, port = serve(rl.run_dir.parent, threaded=True)
    steps = [json.loads(line)["step"] for line in (rl.run_dir / "metrics.jsonl").read_text().splitlines()]
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium(), headless=True,
                                        args=LAUNCH_ARGS)
            page = browser.new_page()
            page.goto(f"http://localhost:{port}/", timeout=60_000)
            page.get_by_text("last step").first.wait_for(timeout=30_000)  # the table's header
            rows = [r.locator("td").all_text_contents() for r in page.locator("tr").all()]
            assert [r[:3] for r in rows if r] == [[rl.run_dir.name, "finished", str(steps[-1])]]  # summary written
            browser.close()
    finally:
        server.stop()
