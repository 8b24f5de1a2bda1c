"""How a config field declares what a change of it does to a running session (``setting``),
and the error a config that cannot run raises (``ConfigError``): the base the schema's sections
are written with.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from hybridlab.errors import UserError


class ConfigError(UserError):
    """A configuration that cannot run; the message names the key."""


CHANGES = ("step", "live", "recreate", "remap", "fixed")


def setting(default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING, change: str = "step",
            workers: tuple[str, ...] = (), why: str = "", loss: bool = False) -> Any:
    """Return a config field that says how a change of it applies to a running session:

    - ``step`` (the default): the controller reads it as each step runs, so a change applies from
      the next step on;
    - ``live``: the running workers of the roles ``workers`` take it (``configure``), keeping
      their state;
    - ``recreate``: it is built into the workers of ``workers``, so a change re-creates them (with
      the trainers' state carried in memory);
    - ``remap``: it changes the device mapping (a remap);
    - ``fixed``: it cannot change once the session runs; ``why`` says why.

    ``loss``: one of the settings the actor's policy loss reads (sent with every update)."""
    if change not in CHANGES or (change in ("live", "recreate")) != bool(workers) or (change == "fixed") != bool(why):
        raise ValueError(f"setting: change={change!r} with workers={workers!r}, why={why!r}")
    meta = {"change": change, "workers": workers, "why": why, "loss": loss}
    return dataclasses.field(default=default, default_factory=factory, metadata=meta)
