"""The sandbox's cost per execution: a trivial Python program (``pass``) run ``executions`` times
in the sandbox (hybridlab.sandbox: bubblewrap, a pids cgroup, limits, a launcher) and as many
times bare (the same interpreter, a plain subprocess), alternating one of each so both see the
same machine; then what the sandboxed runs left behind.

Keys: ``sandboxed_per_s`` and ``bare_per_s`` (executions per second), ``overhead_ms`` (the
sandbox's added wall time per execution), ``goal_met`` (at most ``goal_ms``, 50), and the leaks
over all of them: ``leaked_processes`` (host processes of the sandbox's user or its cgroups,
zombies included), ``leaked_files`` (its temporary folders), ``leaked_cgroups`` and
``rss_growth_mb`` (this process's resident memory, after against before).
"""
from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path

from hybridlab.config.schema import SandboxConfig
from hybridlab.environment import processor
from hybridlab.sandbox import Sandbox
from hybridlab.sandbox.cgroup import parent_dir, stray_processes
from hybridlab.sandbox.runner import NOBODY

GOAL_MS = 50.0


def _footprint() -> dict:
    return {"processes": len(stray_processes(NOBODY if os.geteuid() == 0 else None)),
            "files": len(list(Path(tempfile.gettempdir()).glob("hybridlab-sandbox-*"))),
            "cgroups": len(list(parent_dir().glob("hybridlab-sandbox-*"))),
            "rss_mb": int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20}


def run(executions: int = 1000) -> dict:
    """Return executions per second sandboxed and bare, the overhead per execution and the leaks."""
    executions = int(executions)
    config = SandboxConfig()
    sandbox = Sandbox(config)
    sandbox.run_python("pass")  # warm the file cache for both
    before = _footprint()
    sandboxed = bare = 0.0
    for _ in range(executions):
        start = time.perf_counter()
        subprocess.run([config.python, "-I", "-B", "-c", "pass"], check=True, env={})
        bare += time.perf_counter() - start
        start = time.perf_counter()
        ran = sandbox.run_python("pass")
        sandboxed += time.perf_counter() - start
        if not ran.ok:
            raise RuntimeError(f"a trivial program failed in the sandbox: {ran}")
    after = _footprint()
    overhead_ms = (sandboxed - bare) / executions * 1000
    return {"executions": executions, "sandboxed_per_s": round(executions / sandboxed, 3),
            "bare_per_s": round(executions / bare, 3), "overhead_ms": round(overhead_ms, 2), "goal_ms": GOAL_MS,
            "goal_met": overhead_ms <= GOAL_MS, "leaked_processes": after["processes"] - before["processes"],
            "leaked_files": after["files"] - before["files"], "leaked_cgroups": after["cgroups"] - before["cgroups"],
            "rss_growth_mb": round(after["rss_mb"] - before["rss_mb"], 1), "processor": processor()}
