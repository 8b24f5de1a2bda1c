"""The hybridlab functions that run during one RL step of the default run, in the controller and in
every worker process, with their lines, classed by what their module is (docs/architecture.md,
"What a reader must read").

    .venv/bin/python scripts/step_files.py [--json] [KEY=VALUE ...]   (--json: the last line)

Every Python process of the run (this one, and the Ray workers, which inherit PYTHONPATH from
the local cluster this script starts) loads ``sitecustomize`` from a temporary folder; it
records, with ``sys.setprofile``, when each function of a hybridlab file is called (to the
millisecond) and the lines its code spans. The script runs one step to warm up, then a second
step, and keeps the functions called between the second step's start and end, both rounded
outwards to the millisecond. The overrides shrink the default GRPO run (the tiny model, no warm
start, small batches) without changing its dataflow or mapping.
"""
from __future__ import annotations

import json
import math
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = str(ROOT / "hybridlab") + os.sep
SMALL = ["model=tiny", "warm_start.max_steps=0", "data.prompts_per_step=4", "rollout.n=4", "rollout.max_new_tokens=4",
         "actor.ppo_mini_batch_size=4", "data.test_samples=4", "trainer.progress=false", "trainer.telemetry=false"]
CLASSES = ("step logic", "distributed plumbing", "service")

# Loaded by every Python process started with this folder on PYTHONPATH.
SITECUSTOMIZE = '''
import json, os, sys, threading, time
_root, _out = os.environ["HYBRIDLAB_STEP_FILES_ROOT"], os.environ["HYBRIDLAB_STEP_FILES_DIR"]
_calls = {}  # (file, qualified name, first line, last line) -> times (s) of its calls, rounded to 1 ms

def _span(code):
    lines = [line for _, _, line in code.co_lines() if line]
    return code.co_firstlineno, max(lines, default=code.co_firstlineno)

def _profile(frame, event, arg):
    if event == "call":
        code = frame.f_code
        if code.co_filename.startswith(_root):
            key = (code.co_filename, code.co_qualname, *_span(code))
            _calls.setdefault(key, set()).add(round(time.time(), 3))

def _dump():
    while True:
        time.sleep(0.5)
        path = os.path.join(_out, f"{os.getpid()}.json")
        with open(path + ".tmp", "w") as f:
            json.dump({"argv": sys.argv[:3], "calls": [[*k, sorted(v)] for k, v in list(_calls.items())]}, f)
        os.replace(path + ".tmp", path)

sys.setprofile(_profile)
threading.setprofile(_profile)
threading.Thread(target=_dump, daemon=True).start()
'''


def module_classes(doc: Path = ROOT / "docs" / "architecture.md") -> list[tuple[str, str]]:
    """Return (path prefix, class) rows of the module table in ``doc`` ("What a reader must
    read"), longest prefix first: a module is in the class of the longest prefix naming it."""
    rows = []
    for line in doc.read_text().splitlines():
        m = re.match(r"^\| (step logic|distributed plumbing|service) \| (.+) \|$", line)
        if m:
            rows += [(p.strip("` "), m.group(1)) for p in m.group(2).split(",")]
    return sorted(rows, key=lambda r: -len(r[0]))


def class_of(module: str, rows: list[tuple[str, str]]) -> str:
    """Return the class of a module path (``dataflow/step.py``) by the table's longest prefix."""
    for prefix, cls in rows:
        if module == prefix or prefix.endswith("/") and module.startswith(prefix):
            return cls
    raise KeyError(f"{module} is in no row of the module table in docs/architecture.md")


def functions_in(window: tuple[float, float], trace_dir: Path) -> dict[str, list[dict]]:
    """Return, per process (pid: argv), the hybridlab functions called within ``window`` (its
    bounds rounded outwards to the millisecond, as the call times are), in the order of their
    first call in it: module, qualified name, lines."""
    low, high = math.floor(window[0] * 1000) / 1000, math.ceil(window[1] * 1000) / 1000
    out = {}
    for path in sorted(trace_dir.glob("*.json")):
        record = json.loads(path.read_text())
        first = {}
        for file, name, start, end, times in record["calls"]:
            inside = [t for t in times if low <= t <= high]
            if inside:
                module = str(Path(file).relative_to(ROOT / "hybridlab"))
                first[(module, name, end - start + 1)] = min(inside)
        if first:
            label = f"{path.stem}: {' '.join(record['argv'])[:60]}"
            out[label] = [{"module": m, "function": f, "lines": n} for m, f, n in sorted(first, key=first.get)]
    return out


def summary(per_process: dict[str, list[dict]], rows: list[tuple[str, str]]) -> dict:
    """Return the functions (each once, over every process) and their lines per module class."""
    unique = {(f["module"], f["function"]): f["lines"] for fs in per_process.values() for f in fs}
    lines = {cls: 0 for cls in CLASSES}
    functions = {cls: 0 for cls in CLASSES}
    for (module, _), n in unique.items():
        cls = class_of(module, rows)
        lines[cls] += n
        functions[cls] += 1
    return {"functions": len(unique), "lines": sum(unique.values()), "functions_by_class": functions,
            "lines_by_class": lines, "modules": len({m for m, _ in unique})}


def main(argv: list[str]) -> int:
    """Run the measurement and print it (a line per function, or one JSON object with --json); returns 0."""
    as_json = "--json" in argv
    overrides = SMALL + [a for a in argv if a != "--json"]
    rows = module_classes()  # a missing table fails before the run
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
        per_process = functions_in(window, trace_dir)
    totals = summary(per_process, rows)
    if as_json:
        print(json.dumps({**totals, "per_process": per_process}))
    else:
        for label, fs in per_process.items():
            print(f"{label}\n  " + "\n  ".join(f"{f['module']}:{f['function']} ({f['lines']})" for f in fs))
        print(json.dumps(totals))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
