"""The notebook control plane in a real browser: JupyterLab served on localhost with a token,
notebooks/03_device_mapping.ipynb run top to bottom in headless Chromium, the mapping editor
rendered, a role moved to another pool with the keyboard and Apply clicked, the report shown."""
from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from browser import LAUNCH_ARGS, chromium

pytestmark = pytest.mark.usefixtures("ray_address")  # the notebook's kernel attaches to the run's shared Ray cluster

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "artifacts"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def lab(trained_dir, tmp_path):
    """JupyterLab on 127.0.0.1 with a token, serving a copy of the notebook; yields its URL base
    and token."""
    chromium()  # before starting JupyterLab
    shutil.copy(ROOT / "notebooks" / "03_device_mapping.ipynb", tmp_path)
    port, token = _free_port(), secrets.token_hex(16)
    ray_tmp = Path("/tmp") / f"hlray-lab-{os.getpid()}"
    env = {**os.environ, "HYBRIDLAB_NOTEBOOK_FAST": "1", "HYBRIDLAB_NOTEBOOK_MODEL": str(trained_dir),
           "HYBRIDLAB_NOTEBOOK_RUN_DIR": str(tmp_path / "run"), "RAY_TMPDIR": str(ray_tmp),
           # the server's runtime files and settings stay in the test's folder, not the home folder
           "JUPYTER_RUNTIME_DIR": str(tmp_path / "jupyter-runtime"), "JUPYTER_CONFIG_DIR": str(tmp_path / "jupyter-config"),
           "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "lab-settings"), "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "lab-ws")}
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--ip=127.0.0.1", f"--port={port}", "--no-browser",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={tmp_path}", "--LabApp.expose_app_in_browser=True",
         "--ServerApp.open_browser=False", *(["--allow-root"] if os.geteuid() == 0 else []),
         # loopback only: no news feed, no update check, no PyPI extension manager
         "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
         "--LabApp.extension_manager=readonly"],
        env=env, stdout=open(tmp_path / "lab.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        try:
            urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2).read()
            break
        except OSError:
            if time.time() > deadline or server.poll() is not None:
                server.kill()
                raise AssertionError("JupyterLab did not start:\n" + (tmp_path / "lab.log").read_text()[-3000:])
            time.sleep(0.5)
    try:
        yield base, token
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # shuts the kernel down, which stops its Ray cluster
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_mapping_editor_in_jupyterlab_applies_a_change_clicked_in_the_browser(lab):
    from playwright.sync_api import sync_playwright

    browser_path = chromium()
    base, token = lab
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=browser_path, headless=True, args=LAUNCH_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1400})
        page.goto(f"{base}/lab/tree/03_device_mapping.ipynb?token={token}", timeout=120_000)
        page.wait_for_function("window.jupyterapp && window.jupyterapp.shell.currentWidget"
                               " && window.jupyterapp.shell.currentWidget.sessionContext"
                               " && window.jupyterapp.shell.currentWidget.sessionContext.session", timeout=120_000)
        page.wait_for_function("window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.status === 'idle'",
                               timeout=120_000)
        page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
        # the cell that applies the separate placement shows its report, then the last editor renders
        page.get_by_text("Applied after step").first.wait_for(timeout=420_000)
        page.wait_for_function("window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.status === 'idle'"
                               " && document.querySelectorAll('input[placeholder=\"reward pool\"]').length === 2",
                               timeout=300_000)
        editor = page.locator(".jp-OutputArea-output").filter(has=page.locator('input[placeholder="reward pool"]')).last
        assert "device 1" in editor.inner_text()  # the drawing of the separate placement
        editor.locator('input[placeholder="reward pool"]').fill("main")
        editor.locator('input[placeholder="reward group"]').fill("")
        editor.get_by_role("button", name="Apply").click()
        editor.get_by_text("Applied after step").wait_for(timeout=300_000)
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "lab_mapping_editor.png"), full_page=True)
        report = editor.get_by_text("Applied after step").inner_text()
        assert re.search(r"re-created [^;]*\breward\b", report), report  # the role that moved got new processes
        browser.close()
    assert (ARTIFACTS / "lab_mapping_editor.png").stat().st_size > 10_000
