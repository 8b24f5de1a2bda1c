"""Named fault-injection points, for tests of what a run survives.

``HYBRIDLAB_FAULT=update_actor@3`` makes the process that reaches point ``update_actor`` during
step 3 kill itself with SIGKILL at that moment (no clean-up, as a crash or an OOM kill would).
Several points: ``generate@5,checkpoint_write@4``. Points in the code: ``generate`` (the
responses are back, nothing scored yet), ``update_actor`` (the actor's weights have changed,
the step is not logged), ``checkpoint_write`` (the trainers' state is written, the checkpoint
not yet complete).

``kill:ROLE:STAGE@STEP`` kills a worker instead: when step STEP's stage STAGE starts, the
controller sends SIGKILL to every process of ROLE (and so of the roles colocated with it), once
per driver process (the retried step runs normally). Only for worker processes on the
controller's node (it signals their process ids).
"""
from __future__ import annotations

import os
import signal
import sys

ENV = "HYBRIDLAB_FAULT"
POINTS = ("generate", "update_actor", "checkpoint_write")


_fired: set[str] = set()   # worker kills already done by this process


def armed() -> dict[str, int]:
    """Return ``{point: step}`` from the environment; raises ValueError naming a bad entry."""
    out = {}
    for item in filter(None, (x.strip() for x in os.environ.get(ENV, "").split(","))):
        name, _, step = item.partition("@")
        kill = name.split(":")
        if not step.isdigit() or (name not in POINTS and (len(kill) != 3 or kill[0] != "kill" or not all(kill))):
            raise ValueError(f"{ENV}: {item!r} is not POINT@STEP with POINT one of {', '.join(POINTS)},"
                             " or kill:ROLE:STAGE@STEP")
        out[name] = int(step)
    return out


def worker_kill(stage: str, step: int) -> list[str]:
    """Return the roles whose processes ``HYBRIDLAB_FAULT`` says to kill as ``stage`` of ``step``
    starts (each entry once per process)."""
    if not os.environ.get(ENV):
        return []
    roles = []
    for name, at in armed().items():
        parts = name.split(":")
        if parts[0] == "kill" and parts[2] == stage and at == step and name not in _fired:
            _fired.add(name)
            roles.append(parts[1])
    return roles


def fault_point(name: str, step: int) -> None:
    """Kill this process with SIGKILL if ``HYBRIDLAB_FAULT`` arms ``name`` at ``step``."""
    if os.environ.get(ENV) and armed().get(name) == step:
        print(f"fault injected: {name} at step {step}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def kill_processes(pids: list[int], what: str) -> None:
    """Send SIGKILL to the worker processes ``pids`` on this node (a ``kill:`` fault); ``what``
    says whose they are and when, for the log."""
    print(f"fault injected: kill {what} (pids {', '.join(map(str, pids))})", file=sys.stderr, flush=True)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
