"""The hybridlab files whose functions run during one RL step of the default run, in the order
they first run, in the controller and in every worker process (docs/architecture.md).

    .venv/bin/python scripts/step_files.py [--json] [KEY=VALUE ...]   (--json: the last line)

Every Python process of the run (this one, and the Ray workers, which inherit PYTHONPATH from
the local cluster this script starts) loads ``sitecustomize`` from a temporary folder; it
records, with ``sys.setprofile``, when each function of a hybridlab file is called. The script
runs one step to warm up, then a second step, and counts the files called between the second
step's start and end. The overrides shrink the default GRPO run (the tiny model, no warm start,
small batches) without changing its dataflow or mapping.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = str(ROOT / "hybridlab") + os.sep
SMALL = ["model=tiny", "warm_start.max_steps=0", "data.prompts_per_step=4", "rollout.n=4", "rollout.max_new_tokens=4",
         "actor.ppo_mini_batch_size=4", "data.test_samples=4", "trainer.progress=false", "trainer.telemetry=false"]

# Loaded by every Python process started with this folder on PYTHONPATH.
SITECUSTOMIZE = '''
import json, os, sys, threading, time
_root, _out = os.environ["HYBRIDLAB_STEP_FILES_ROOT"], os.environ["HYBRIDLAB_STEP_FILES_DIR"]
_calls = {}  # file -> times (s) of the calls into it, rounded to 1 ms

def _profile(frame, event, arg):
    if event == "call":
        name = frame.f_code.co_filename
        if name.startswith(_root):
            _calls.setdefault(name, set()).add(round(time.time(), 3))

def _dump():
    while True:
        time.sleep(0.5)
        path = os.path.join(_out, f"{os.getpid()}.json")
        with open(path + ".tmp", "w") as f:
            json.dump({"argv": sys.argv[:3], "calls": {k: sorted(v) for k, v in list(_calls.items())}}, f)
        os.replace(path + ".tmp", path)

sys.setprofile(_profile)
threading.setprofile(_profile)
threading.Thread(target=_dump, daemon=True).start()
'''


def files_in(window: tuple[float, float], trace_dir: Path) -> dict[str, list[str]]:
    """Return, per process (pid: argv), the hybridlab files called within ``window``, in the
    order of their first call in it."""
    out = {}
    for path in sorted(trace_dir.glob("*.json")):
        record = json.loads(path.read_text())
        first = {f: min(t for t in times if window[0] <= t <= window[1])
                 for f, times in record["calls"].items() if any(window[0] <= t <= window[1] for t in times)}
        if first:
            label = f"{path.stem}: {' '.join(record['argv'])[:60]}"
            out[label] = [str(Path(f).relative_to(ROOT)) for f in sorted(first, key=first.get)]
    return out


def main(argv: list[str]) -> int:
    """Run the measurement and print it (a line per file, or one JSON object with --json); returns 0."""
    as_json = "--json" in argv
    overrides = SMALL + [a for a in argv if a != "--json"]
    trace_dir = Path(tempfile.mkdtemp(prefix="step-files-"))
    hook_dir = trace_dir / "hook"
    hook_dir.mkdir()
    (hook_dir / "sitecustomize.py").write_text(SITECUSTOMIZE)
    os.environ.pop("RAY_ADDRESS", None)  # a cluster of its own, started with the hook on its path
    os.environ.update(HYBRIDLAB_STEP_FILES_ROOT=PACKAGE, HYBRIDLAB_STEP_FILES_DIR=str(trace_dir),
                      PYTHONPATH=os.pathsep.join(filter(None, [str(hook_dir), os.environ.get("PYTHONPATH")])))
    sys.path.insert(0, str(hook_dir))
    import sitecustomize  # noqa: F401  (this process too)

    from hybridlab.dataflow.session import RLSession

    with RLSession(None, [*overrides, f"trainer.run_dir={trace_dir / 'run'}"]) as rl:
        rl.step()  # the first step also runs one-time set-up
        start = time.time()
        rl.step()
        window = (start, time.time())
        time.sleep(1.5)  # every process has written its record since
        per_process = files_in(window, trace_dir)
    files = sorted({f for fs in per_process.values() for f in fs})
    if as_json:
        print(json.dumps({"files": len(files), "names": files, "per_process": per_process}))
    else:
        for label, fs in per_process.items():
            print(f"{label}\n  " + "\n  ".join(fs))
        print(f"{len(files)} files in all")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
