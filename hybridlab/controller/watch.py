"""CallWatch: every worker call in flight, its deadline, and the stacks of a stuck one.

    watch = CallWatch(floor_s=120)         # one per WorkerSet; every WorkerGroup reports to it
    watch.running()                        # [{role, rank, method, stage, elapsed_s, deadline_s, late}]
    watch.deadline("rollout", "generate", "generate")

A call's deadline is ``factor`` times the longest of the recent calls of the same role, method
and stage (as the controller saw them: from submission to answer), never below ``floor_s``;
before such a call has ever finished, it is ``first_s`` (a first call compiles and warms
caches). ``fixed_s`` replaces all of that with one number. A call that does ``units`` steps of
work (a training step's optimizer steps, one per mini-batch) is timed per step: its deadline is
a one-step call's times ``units``, or before any has finished ``first_s`` for the first step and
``floor_s`` for each other one. A call past its deadline is stuck:
the group that waits for it writes the stacks of its processes with ``dump_stacks`` and
reports it like a dead worker (``WorkerError`` of kind ``"stuck"``), so the run's recovery
re-creates it. A stuck call stays in ``running()`` (late) until its processes are replaced
(``forget``): they are still busy with it, and a viewer polling once a second sees it. A call
whose answer is read later (a streaming step's sync leaves its last load to the engines:
``GroupFuture.unwatch``) is off the list; its deadline counts from when it is read.

Stacks come from ``faulthandler`` in each worker process (registered on SIGUSR1 by the host),
which prints every Python thread's stack even when the process is busy in C code. The signal
is sent by a small Ray task on the worker's own node, so this works on a multi-node cluster.
"""
from __future__ import annotations

import collections
import itertools
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

STACK_SIGNAL = signal.SIGUSR1
FACTOR = 5.0        # a call may take this many times the longest recent one of its kind
HISTORY = 20        # recent calls remembered per (role, method, stage)


def stack_file(pid: int) -> Path:
    """Return where the worker process ``pid`` writes its stacks on its own node."""
    return Path(tempfile.gettempdir()) / "hybridlab-stacks" / f"{pid}.txt"


class CallWatch:
    """The calls in flight and their deadlines (thread-safe); see the module docstring."""

    def __init__(self, floor_s: float = 120.0, fixed_s: float = 0.0, first_s: float = 600.0,
                 stacks_dir: Path | None = None):
        self.floor_s, self.fixed_s, self.first_s = floor_s, fixed_s, first_s
        self.stacks_dir = stacks_dir or Path(tempfile.gettempdir()) / "hybridlab-stacks" / "dumps"
        self._recent: dict[tuple[str, str, str], collections.deque] = {}
        self._calls: dict[int, dict] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def configure(self, floor_s: float, fixed_s: float) -> None:
        """Change the floor and the fixed deadline (0: derived) for calls from now on."""
        self.floor_s, self.fixed_s = floor_s, fixed_s

    def deadline(self, role: str, method: str, stage: str, units: int = 1) -> float:
        """Return the seconds a new call of ``role.method`` in ``stage`` doing ``units`` steps of
        work may take."""
        if self.fixed_s:
            return self.fixed_s * units
        with self._lock:
            recent = self._recent.get((role, method, stage))
            longest = max(recent) if recent else None  # per step of work
        if longest is None:
            return self.first_s + (units - 1) * self.floor_s
        return max(self.floor_s, FACTOR * longest) * units

    def begin(self, role: str, method: str, stage: str, ranks: list[int], pids: list[int], units: int = 1) -> int:
        """Record a call just submitted, of ``units`` steps of work; returns its id for ``end``."""
        call = {"role": role, "method": method, "stage": stage, "ranks": ranks, "pids": pids, "units": units,
                "start": time.time(), "deadline_s": self.deadline(role, method, stage, units)}
        with self._lock:
            call_id = next(self._ids)
            self._calls[call_id] = call
        return call_id

    def end(self, call_id: int, ok: bool) -> None:
        """Forget a call; a successful one's duration per step feeds the deadline of the next ones."""
        with self._lock:
            call = self._calls.pop(call_id, None)
            if call is not None and ok:
                key = (call["role"], call["method"], call["stage"])
                per_step = (time.time() - call["start"]) / call["units"]
                self._recent.setdefault(key, collections.deque(maxlen=HISTORY)).append(per_step)

    def forget(self, roles: set[str]) -> None:
        """Drop the calls in flight and the recent call times of ``roles`` (their processes were
        replaced: new ones warm up again, so their first calls get ``first_s`` again)."""
        with self._lock:
            for call_id in [i for i, c in self._calls.items() if c["role"] in roles]:
                del self._calls[call_id]
            for key in [k for k in self._recent if k[0] in roles]:
                del self._recent[key]

    def started(self, call_id: int) -> float:
        """Return when the call was submitted (``time.time()``)."""
        with self._lock:
            call = self._calls.get(call_id)
        return call["start"] if call else time.time()

    def running(self) -> list[dict]:
        """Return the calls in flight, oldest first: role, ranks, method, stage, start (wall
        clock), elapsed_s, deadline_s and late (past the deadline)."""
        now = time.time()
        with self._lock:
            calls = sorted(self._calls.values(), key=lambda c: c["start"])
        return [{"role": c["role"], "ranks": c["ranks"], "method": c["method"], "stage": c["stage"],
                 "start": c["start"], "elapsed_s": round(now - c["start"], 3), "deadline_s": c["deadline_s"],
                 "late": now - c["start"] > c["deadline_s"]} for c in calls]


def _signal_and_read(pids: list[int], wait_s: float) -> dict[int, str]:
    """On the workers' node: send the stack signal to ``pids``; returns pid -> what they wrote."""
    sizes = {}
    for pid in pids:
        path = stack_file(pid)
        if not path.is_file():  # no handler registered: the signal's default action would kill it
            sizes[pid] = -2
            continue
        sizes[pid] = path.stat().st_size
        try:
            os.kill(pid, STACK_SIGNAL)
        except ProcessLookupError:
            sizes[pid] = -1
    out: dict[int, str] = {}
    deadline = time.time() + wait_s
    for pid, size in sizes.items():
        path = stack_file(pid)
        text = {-1: "(the process is gone)", -2: "(this process has no stack dump handler)"}.get(size, "")
        while size >= 0 and time.time() < deadline:
            if path.is_file() and path.stat().st_size > size:
                time.sleep(0.2)  # let it finish writing every thread
                text = path.read_bytes()[size:].decode(errors="replace")
                break
            time.sleep(0.05)
        out[pid] = text or "(no stack written: the process did not react to the signal)"
    return out


def dump_stacks(placements: list[dict], out_dir: Path, label: str, wait_s: float = 5.0) -> list[Path]:
    """Write the Python stacks of the worker processes at ``placements`` (as WorkerGroup gives
    them: node_id and pid per rank) to ``out_dir/<label>-rank<r>-pid<pid>.txt``; returns the files."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    reader = ray.remote(num_cpus=0)(_signal_and_read)
    by_node: dict[str, list[int]] = {}
    for p in placements:
        by_node.setdefault(p["node_id"], []).append(p["pid"])
    refs = {node: reader.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
            .remote(pids, wait_s) for node, pids in by_node.items()}
    texts: dict[int, str] = {}
    for node, ref in refs.items():
        try:
            texts.update(ray.get(ref, timeout=wait_s + 30))
        except Exception as exc:  # the node itself may be in trouble: say so in the files
            texts.update({pid: f"(could not reach the node to dump stacks: {exc!r})" for pid in by_node[node]})
    out_dir.mkdir(parents=True, exist_ok=True)
    files = []
    for rank, p in enumerate(placements):
        path = out_dir / f"{label}-rank{rank}-pid{p['pid']}.txt"
        path.write_text(texts.get(p["pid"], ""))
        files.append(path)
    return files
