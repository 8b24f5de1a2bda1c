"""Where the test suite's time goes: CPU per kind of process, and wall time per era of tests.

    .venv/bin/python scripts/suite_cpu.py run [--out FILE] -- COMMAND ...   (e.g. the `make test` command)
    .venv/bin/python scripts/suite_cpu.py split JUNIT.xml WALL_S REV
    .venv/bin/python scripts/suite_cpu.py modules OUT.json MODULES.jsonl  (a run with HYBRIDLAB_SUITE_MODULES)

``run`` starts COMMAND and, until it exits, reads every process's CPU time from ``/proc`` every
0.3 s; then it prints the CPU seconds and the number of processes of each kind (Ray worker
processes by their actor class, Ray's own daemons, the pytest workers, browsers, ...) and
writes the per-process figures to ``--out`` as JSON. A process that exits between two reads
loses at most its last 0.3 s, and one that starts and exits between two reads is not seen; the
monitor leaves itself out. The suite is bound by CPU on our 2-core machines (docs/tests.md),
so these seconds are what a change to the suite can save.

``split`` divides a run's wall time (``WALL_S``, pytest's last line) between the tests whose
functions already existed at git revision ``REV`` and the tests added since, in proportion to
their summed durations in the JUnit report (``pytest --junitxml``): how much of the suite a
set of issues added, against the allowance each issue gave itself. Tests are matched by function
name, so a new test named as an older one (in another module) counts as older.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TICKS = os.sysconf("SC_CLK_TCK")
# the first that a command line names (hybridlab first: `hybridlab dashboard` is ours, not Ray's)
KINDS = ("hybridlab", "raylet", "gcs_server", "log_monitor", "dashboard", "pytest", "jupyter", "chromium")


def process_kind(cmdline: str, comm: str) -> str:
    """Return the kind of a process: a Ray actor's class (``ray::Host_actor``), or the first of
    KINDS its command line names, or its command name."""
    if cmdline.startswith("ray::"):
        return re.sub(r"[.(].*", "", cmdline.split()[0])
    return next((k for k in KINDS if k in cmdline or k in comm), comm)


def read_processes() -> dict[tuple[str, str], tuple[str, str, float, str]]:
    """Return {(pid, start time): (command line, command name, CPU seconds, parent pid)} of every process."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if pid == str(os.getpid()):
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # it exited meanwhile
            continue
        comm, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        out[(pid, fields[19])] = (cmdline.strip(), comm, (int(fields[11]) + int(fields[12])) / TICKS, fields[1])
    return out


def run(command: list[str], out: Path | None) -> int:
    """Run ``command``, print CPU seconds per process kind; returns its exit status."""
    before = {key: cpu for key, (_, _, cpu, _) in read_processes().items()}  # what ran before counts from here
    seen: dict[tuple[str, str], list] = {}
    child = subprocess.Popen(command)
    while child.poll() is None:
        for key, (cmdline, comm, cpu, ppid) in read_processes().items():
            entry = seen.setdefault(key, [cmdline, comm, 0.0, ppid])
            entry[2] = cpu - before.get(key, 0.0)
            if cmdline and not cmdline.startswith("ray::IDLE"):  # a Ray worker names its actor once it has one
                entry[0] = cmdline
        time.sleep(0.3)
    cpu, count = collections.Counter(), collections.Counter()
    for cmdline, comm, seconds, _ in seen.values():
        kind = process_kind(cmdline, comm)
        cpu[kind] += seconds
        count[kind] += seconds > 0
    for kind, seconds in cpu.most_common(20):
        if seconds < 0.05:
            break
        print(f"{seconds:9.1f} s CPU  {count[kind]:5d} processes  {kind}")
    print(f"{sum(cpu.values()):9.1f} s CPU in all")
    if out:
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime"))
        out.write_text(json.dumps([{"kind": process_kind(c, n), "cmdline": c[:200], "cpu_s": round(s, 2), "pid": pid,
                                    "ppid": ppid, "start": round(boot + int(start) / TICKS, 2)}
                                   for (pid, start), (c, n, s, ppid) in seen.items()]))
    return child.returncode


def by_module(processes: list[dict], modules_log: Path) -> dict:
    """Return CPU seconds and process counts per test module and per what started each process.

    ``modules_log`` has a JSON line ``{"pid", "module", "time"}`` each time a pytest worker begins
    a module (``HYBRIDLAB_SUITE_MODULES`` set for the run: tests/conftest.py writes it). A process
    belongs to the pytest worker among its ancestors and to the module that worker was running
    when the process started; what started it is its ancestor just below that worker (an
    in-process Ray cluster's raylet or GCS for a session's workers, a `hybridlab` driver, a
    notebook kernel, a benchmark's own Python process, ...)."""
    starts: dict[str, list[tuple[float, str]]] = collections.defaultdict(list)
    for line in modules_log.read_text().splitlines():
        r = json.loads(line)
        starts[str(r["pid"])].append((r["time"], r["module"]))
    parent = {p["pid"]: p["ppid"] for p in processes}
    kind = {p["pid"]: p["kind"] for p in processes}
    cpu, count = collections.Counter(), collections.Counter()
    for p in processes:
        chain, pid = [], p["pid"]
        while pid in parent and pid not in starts and len(chain) < 50:
            chain.append(pid)
            pid = parent[pid]
        if pid not in starts:
            module, starter = "(outside the tests)", p["kind"]
        elif not chain:
            module, starter = "(the pytest processes themselves)", "pytest"
        else:
            module = next((m for t, m in reversed(starts[pid]) if t <= p["start"]), starts[pid][0][1])
            starter = kind[chain[-1]] if chain else "pytest worker"
            starter = "session (Ray cluster of the test process)" if starter in ("raylet", "gcs_server") else starter
        cpu[(module, starter)] += p["cpu_s"]
        count[(module, starter)] += p["cpu_s"] > 0
    modules = collections.Counter()
    for (module, _), seconds in cpu.items():
        modules[module] += seconds
    return {"modules": {m: round(s, 1) for m, s in modules.most_common()},
            "by_starter": [{"module": m, "started_by": k, "cpu_s": round(s, 1), "processes": count[(m, k)]}
                           for (m, k), s in cpu.most_common()]}


def test_functions(rev: str) -> set[str]:
    """Return the names of the test functions under tests/ at git revision ``rev``."""
    text = subprocess.run(["git", "grep", "-h", "-o", "-E", r"def test_\w+", rev, "--", "tests"], cwd=ROOT,
                          capture_output=True, text=True, check=True).stdout
    return {line.removeprefix("def ") for line in text.split()} - {"def"}


def split(junit: Path, wall_s: float, rev: str) -> dict:
    """Return the summed test seconds, test count and share of ``wall_s`` of the tests whose
    functions existed at ``rev`` (``then``) and of those added since (``since``), with the
    added ones' seconds per module."""
    existing = test_functions(rev)
    seconds, count, modules = collections.Counter(), collections.Counter(), collections.Counter()
    for case in ET.parse(junit).iter("testcase"):
        era = "then" if case.get("name").split("[")[0] in existing else "since"
        seconds[era] += float(case.get("time"))
        count[era] += 1
        if era == "since":
            modules[case.get("classname")] += float(case.get("time"))
    total = sum(seconds.values())
    if not total:
        raise SystemExit(f"{junit}: no test durations to split")
    return {era: {"test_s": round(seconds[era], 1), "tests": count[era],
                  "wall_s": round(wall_s * seconds[era] / total, 1)} for era in ("then", "since")} | {
        "since_by_module": {m: round(s, 1) for m, s in modules.most_common()}, "rev": rev}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    run_verb = verbs.add_parser("run", help="run a command and print CPU seconds per process kind")
    run_verb.add_argument("--out", type=Path, help="write the per-process figures here (JSON)")
    run_verb.add_argument("command", nargs=argparse.REMAINDER)
    split_verb = verbs.add_parser("split", help="divide a run's wall time between tests older and newer than REV")
    split_verb.add_argument("junit", type=Path)
    split_verb.add_argument("wall_s", type=float)
    split_verb.add_argument("rev")
    module_verb = verbs.add_parser("modules", help="CPU per test module and per what started each process")
    module_verb.add_argument("processes", type=Path, help="run --out's file")
    module_verb.add_argument("modules_log", type=Path, help="the HYBRIDLAB_SUITE_MODULES file of the same run")
    args = parser.parse_args()
    if args.verb == "modules":
        print(json.dumps(by_module(json.loads(args.processes.read_text()), args.modules_log), indent=1))
        return 0
    if args.verb == "split":
        print(json.dumps(split(args.junit, args.wall_s, args.rev), indent=1))
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("run: give the command to measure after --")
    return run(command, args.out)


if __name__ == "__main__":
    sys.exit(main())
