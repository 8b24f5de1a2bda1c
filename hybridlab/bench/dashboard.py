"""The served dashboard at scale: a synthetic run of many devices and steps replayed into the
page, measured in headless Chromium.

A telemetry file is written as a run of ``devices`` devices and ``steps`` steps would leave it:
a metrics record per step (reward, lengths, losses, stage seconds, each device's busy share),
a weight-sync record per step, a device sample per device per step, and the phase spans of the
last ``span_steps`` steps. The page is served from that run directory (``hybridlab dashboard``'s
server, in this process) and opened in headless Chromium; then new steps are appended one at a
time while the page is watched. The same is measured for a small run (2 devices, 100 steps)
side by side, the baseline of the ratios.

Keys: ``first_render_s`` (from opening the page to every step's reward in the browser's data),
``history_s`` (from opening the page to the last device sample in the System section's heat map),
``update_latency_s`` (median time from appending a step to the file to its reward in the page),
``heap_mb`` (the page's JS heap after the updates), with the small run's figures and the ratios.
"""
from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from hybridlab.environment import processor

# Headless, no GPU, no network but loopback (Chromium's own background connections are refused
# here, many at a time), no first-run or update work. The browser tests use the same.
LAUNCH_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
               "--disable-component-update", "--no-first-run"]
GOALS = {"first_render_s": 3.0, "update_latency_s": 2.0, "heap_mb": 300.0}
STAGES = ("generate", "reward", "old_logprob", "ref_logprob", "update_actor", "sync_weights")

# the rows of the page's reward-curve source (read from the browser's Bokeh document)
CURVE_ROWS = """() => {
  for (const doc of Bokeh.documents) for (const m of doc.all_models) {
    if (m.data === undefined || m.selected === undefined) continue;
    const data = m.data instanceof Map ? Object.fromEntries(m.data) : m.data;
    if ("reward_smooth" in data) return Array.from(data.step);
  }
  return [];
}"""


# how far (seconds since the run started) the page's device-utilization heat map reaches
DEVICE_REACH = """() => {
  let reach = -1;
  for (const doc of Bokeh.documents) for (const m of doc.all_models) {
    if (m.data === undefined || m.selected === undefined) continue;
    const data = m.data instanceof Map ? Object.fromEntries(m.data) : m.data;
    if (!("width" in data) || !data.row.length || !String(data.row[0]).startsWith("GPU ")) continue;
    for (let i = 0; i < data.x.length; i++) reach = Math.max(reach, data.x[i] + data.width[i] / 2);
  }
  return reach;
}"""


def metrics_record(step: int, t: float, devices: int, rng: random.Random) -> dict:
    """Return a metrics record shaped like a real step's (the keys the panels read)."""
    reward = min(1.0, step / 5000) * 0.8 + rng.gauss(0, 0.05)
    record = {"kind": "metrics", "step": step, "time": t, "reward/mean": reward, "accuracy": reward,
              "timing/step_s": 30.0, "rollout/tokens": 250_000, "rollout/straggler_share": rng.random() * 0.2,
              "actor/pg_loss": rng.gauss(0, 0.1), "actor/entropy": 1.2, "actor/ppo_kl": 1e-3,
              "actor/pg_clipfrac": 0.02, "actor/grad_norm": 1.0 + rng.random(), "actor/kl_loss": 1e-3,
              "rollout_corr/kl": 1e-3, "rollout_corr/k3_kl": 1e-3, "rollout_corr/rollout_is_mean": 1.0,
              "rollout_corr/rejected_share": 0.0, "perf/device_busy": 0.8}
    for i, stage in enumerate(STAGES):
        record[f"timing/{stage}_s"] = 30.0 / len(STAGES) + i
    for p, value in (("p10", 100.0), ("p50", 300.0), ("p90", 600.0), ("max", 1024.0)):
        record[f"response_length/{p}"] = value
    for d in range(devices):
        record[f"perf/device_busy/gpu{d}"] = 0.6 + 0.4 * rng.random()
    return record


def write_run(run_dir: Path, devices: int, steps: int, span_steps: int, seed: int = 0) -> dict:
    """Write the synthetic run's telemetry file; returns the count of each kind of record."""
    rng = random.Random(seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    start = time.time() - 30.0 * steps
    counts = {"metrics": 0, "sync": 0, "device": 0, "span": 0}
    with open(run_dir / "telemetry.jsonl", "w") as f:
        pools = {"p": {"devices": devices}}
        tp = min(8, devices)
        roles = {"actor": {"pool": "p", "tp": tp, "dp": devices // tp}, "rollout": {"pool": "p", "tp": tp}}
        f.write(json.dumps({"kind": "run", "time": start, "name": run_dir.name, "processor": processor(),
                            "mapping": {"pools": pools, "roles": roles}}) + "\n")
        for step in range(1, steps + 1):
            t = start + 30.0 * step
            lines = [metrics_record(step, t, devices, rng),
                     {"kind": "sync", "step": step, "time": t, "bytes": 2**30, "buckets": 8, "seconds": 0.8,
                      "mode": "collective", "reason": "step", "bytes_per_pair": {"0->0": 2**29, "1->1": 2**29}}]
            lines += [{"kind": "device", "time": t - 15.0, "device": f"GPU {d}", "role": "actor", "rank": d,
                       "util": 50.0 + 50.0 * rng.random(), "memory_mb": 60_000.0, "rss_mb": 9000.0 + d,
                       "gpu_allocated_mb": 50_000.0} for d in range(devices)]
            if step > steps - span_steps:
                lines += [{"kind": "span", "role": "actor", "rank": d, "method": stage, "stage": stage,
                           "start": t - 30.0 + 5 * i, "end": t - 26.0 + 5 * i}
                          for d in range(devices) for i, stage in enumerate(STAGES)]
            for line in lines:
                counts[line["kind"]] += 1
                f.write(json.dumps(line) + "\n")
    return counts


def measure(run_dir: Path, steps: int, devices: int, updates: int, browser_path: str) -> dict:
    """Serve ``run_dir``, open it in headless Chromium and return first render, update latencies
    and heap."""
    from playwright.sync_api import sync_playwright

    from hybridlab.telemetry.serving import serve

    server, port = serve(run_dir, port=0, threaded=True)
    rng = random.Random(1)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=browser_path, headless=True, args=LAUNCH_ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            start = time.perf_counter()
            page.goto(f"http://127.0.0.1:{port}/", timeout=120_000)
            page.wait_for_function(f"() => ({CURVE_ROWS})().length >= {steps}", timeout=300_000, polling=50)
            page.locator("canvas").first.wait_for(timeout=60_000)
            first_render = time.perf_counter() - start
            page.get_by_text("System", exact=True).click()  # the section of the device samples
            last_sample = 30.0 * steps - 15.0  # seconds after the run's start (write_run's timing)
            page.wait_for_function(f"() => ({DEVICE_REACH})() > {last_sample}", timeout=300_000, polling=50)
            history = time.perf_counter() - start
            page.get_by_text("Overview", exact=True).click()
            latencies = []
            for k in range(1, updates + 1):
                step = steps + k
                with open(run_dir / "telemetry.jsonl", "a") as f:
                    f.write(json.dumps(metrics_record(step, time.time(), devices, rng)) + "\n")
                appended = time.perf_counter()
                page.wait_for_function(f"() => ({CURVE_ROWS})().includes({step})", timeout=60_000, polling=20)
                latencies.append(time.perf_counter() - appended)
                time.sleep(0.3)
            cdp = page.context.new_cdp_session(page)
            cdp.send("HeapProfiler.collectGarbage")
            heap = cdp.send("Runtime.getHeapUsage")["usedSize"] / 2**20
            browser.close()
    finally:
        server.stop()
    return {"first_render_s": round(first_render, 2), "history_s": round(history, 2),
            "update_latency_s": round(statistics.median(latencies), 3),
            "update_latency_max_s": round(max(latencies), 3), "heap_mb": round(heap, 1)}


def run(devices: int = 64, steps: int = 10_000, span_steps: int = 20, updates: int = 7) -> dict:
    """Return the dashboard's first render, update latency and heap at ``devices`` x ``steps``,
    against a run of 2 devices and 100 steps measured the same way."""
    import shutil

    from hybridlab.errors import UserError

    for name, value, low in (("devices", devices, 1), ("steps", steps, 1), ("updates", updates, 1),
                             ("span_steps", span_steps, 0)):
        if not isinstance(value, int) or value < low:
            raise UserError(f"benchmark dashboard: {name} must be an integer of at least {low}, got {value!r}")
    browser_path = shutil.which("chromium")
    if browser_path is None:
        raise UserError("benchmark dashboard needs Debian's chromium: run `apt-get install -y chromium` as root")
    with tempfile.TemporaryDirectory() as tmp:
        small_counts = write_run(Path(tmp) / "small", 2, 100, span_steps)
        small = measure(Path(tmp) / "small", 100, 2, updates, browser_path)
        big_counts = write_run(Path(tmp) / "big", devices, steps, span_steps)
        size_mb = (Path(tmp) / "big" / "telemetry.jsonl").stat().st_size / 2**20
        big = measure(Path(tmp) / "big", steps, devices, updates, browser_path)
    return {"benchmark": "dashboard", "processor": processor(), "devices": devices, "steps": steps,
            "records": big_counts,
            "telemetry_mb": round(size_mb, 1), **big,
            "small": {"devices": 2, "steps": 100, "records": small_counts, **small},
            "first_render_vs_small": round(big["first_render_s"] / small["first_render_s"], 2),
            "heap_vs_small": round(big["heap_mb"] / small["heap_mb"], 2),
            "goals": GOALS, "meets_goals": {k: big[k] <= v for k, v in GOALS.items()}}
