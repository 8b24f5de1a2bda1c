"""Named fault-injection points, for tests of what a run survives.

``HYBRIDLAB_FAULT=update_actor@3`` makes the process that reaches point ``update_actor`` during
step 3 kill itself with SIGKILL at that moment (no clean-up, as a crash or an OOM kill would).
Several points: ``generate@5,checkpoint_write@4``. Points in the code: ``generate`` (the
responses are back, nothing scored yet), ``update_actor`` (the actor's weights have changed,
the step is not logged), ``checkpoint_write`` (the trainers' state is written, the checkpoint
not yet complete).
"""
from __future__ import annotations

import os
import signal
import sys

ENV = "HYBRIDLAB_FAULT"
POINTS = ("generate", "update_actor", "checkpoint_write")


def armed() -> dict[str, int]:
    """Return ``{point: step}`` from the environment; raises ValueError naming a bad entry."""
    out = {}
    for item in filter(None, (x.strip() for x in os.environ.get(ENV, "").split(","))):
        name, _, step = item.partition("@")
        if name not in POINTS or not step.isdigit():
            raise ValueError(f"{ENV}: {item!r} is not POINT@STEP with POINT one of {', '.join(POINTS)}")
        out[name] = int(step)
    return out


def fault_point(name: str, step: int) -> None:
    """Kill this process with SIGKILL if ``HYBRIDLAB_FAULT`` arms ``name`` at ``step``."""
    if os.environ.get(ENV) and armed().get(name) == step:
        print(f"fault injected: {name} at step {step}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
