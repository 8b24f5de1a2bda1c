"""Spare worker processes, warmed up ahead of need, so that a remap (or a role re-created after a
fault) builds its workers in processes that already exist instead of starting new ones.

Starting a worker process is most of what a remap costs: Python and Ray (about 5 s for a bare
Ray actor on our 2-core CPU machines), then the torch, megatron-core and vLLM imports (another
5-7 s). A session with ``spares=N`` keeps N processes that have done all of that and hold no
devices. When a process set needs a process on a device bundle:

1. a ``bundle_devices`` task runs in the bundle with the resources the worker would take; Ray
   runs it in one of its pooled task processes (milliseconds once one exists) and it returns the
   bundle's node and device ids, exactly what Ray would give a new worker process there;
2. a spare on that node (a ready one, else one still warming up, waited for) adopts the device
   ids and thread count a new process would get (``CUDA_VISIBLE_DEVICES`` and
   ``OMP_NUM_THREADS``, set before anything touches a device) and becomes the bundle's worker
   process. Inside it ``ray.get_gpu_ids()`` is empty (Ray placed the task, not the spare);
   ``CUDA_VISIBLE_DEVICES``, which the engines use, is the bundle's.

The placement group keeps the bundle reserved for the session; what Ray's bookkeeping does not
see is that an adopted spare uses it (the session places nothing else there beyond its mapping,
so the bundle is never over-committed). Spares cost memory while idle and CPU while they warm
up; the pool is refilled after the remap that used them, never during one.
"""
from __future__ import annotations

import dataclasses
import os
import time
import warnings
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayError

from hybridlab.controller.worker import host_actor_class

WARM_TIMEOUT_S = 300.0  # a spare still warming up this long after it started is stuck: it is dropped


@ray.remote(num_cpus=0)
def bundle_devices() -> dict:
    """Return the node id, device ids and device variables Ray gives a process in this bundle."""
    env = {var: os.environ[var] for var in ("CUDA_VISIBLE_DEVICES",) if var in os.environ}
    return {"node_id": ray.get_runtime_context().get_node_id(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "env": env}


@dataclasses.dataclass
class Spare:
    """One spare process: its actor, the node it runs on, and its pending warm-up."""

    actor: Any
    node_id: str
    warmed: Any                # ObjectRef of WorkerHost.warm(...)
    roles: dict[str, type]     # the roles its host class can run (role -> worker class)
    started: float = dataclasses.field(default_factory=time.monotonic)

    def can_host(self, roles: dict[str, type]) -> bool:
        """Return True if this spare's host class runs ``roles`` (role -> worker class)."""
        return all(self.roles.get(r) is c for r, c in roles.items())


class SparePool:
    """Up to ``target`` warmed-up processes of one host class, spread over the cluster's nodes."""

    def __init__(self, roles: dict[str, type], env: dict[str, str]):
        self.roles, self.env = dict(roles), {k: str(v) for k, v in env.items()}
        self.modules: list[str] = []  # learned from running workers (learn_modules)
        self.target = 0
        self.spares: list[Spare] = []
        self.taken = 0  # spares that became worker processes, over the pool's life
        self.disabled = ""  # why spares cannot be used here (then none are started)

    def learn_modules(self, names: list[str]) -> None:
        """Add modules a running worker process imported (in its order) to what spares import."""
        known = set(self.modules)
        self.modules += [n for n in names if n not in known]

    def add_roles(self, roles: dict[str, type]) -> None:
        """Let spares started from now on host ``roles`` too (e.g. a role a remap added)."""
        self.roles.update(roles)

    def resize(self, n: int) -> None:
        """Keep ``n`` spares: start the missing ones (they warm up in the background), stop extras."""
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"spares must be a whole number >= 0, got {n!r}")
        self.target = n
        while len(self.spares) > n:
            ray.kill(self.spares.pop().actor, no_restart=True)
        self.refill()

    def refill(self) -> None:
        """Start spares until there are ``target`` (they warm up in the background)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if len(self.spares) >= self.target or self.disabled:
            return
        nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU", 0) > 0)
        actor_class = host_actor_class(self.roles)
        modules = tuple(self.modules)
        while len(self.spares) < self.target:
            node = nodes[(len(self.spares) + self.taken) % len(nodes)] if nodes else ""
            strategy = NodeAffinitySchedulingStrategy(node, soft=False) if node else "DEFAULT"
            actor = actor_class.options(num_cpus=0, num_gpus=0, scheduling_strategy=strategy,
                                        runtime_env={"env_vars": self.env} if self.env else None).remote(self.env)
            self.spares.append(Spare(actor, node, actor.warm.remote(modules), dict(self.roles)))
            bundle_devices.options(scheduling_strategy=strategy).remote()  # a pooled task process on its node

    def wait_ready(self, timeout: float | None = None) -> int:
        """Wait until every spare has warmed up (at most ``timeout`` s); returns how many are ready."""
        refs = [s.warmed for s in self.spares]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout) if refs else ([], [])
        return len(ready)

    def take(self, node_id: str, roles: dict[str, type]) -> Any | None:
        """Remove and return a live spare on ``node_id`` that can host ``roles`` (a ready one
        first; else one still warming up, waited for: it is further along than a new process),
        or None if there is none. Dead or stuck spares met on the way are dropped."""
        if self.disabled:
            return None
        on_node = [s for s in self.spares if s.node_id in (node_id, "") and s.can_host(roles)]
        ready, _ = ray.wait([s.warmed for s in on_node], num_returns=len(on_node), timeout=0) if on_node else ([], [])
        for spare in sorted(on_node, key=lambda s: s.warmed not in ready):
            self.spares.remove(spare)
            try:
                left = max(1.0, WARM_TIMEOUT_S - (time.monotonic() - spare.started))
                warmed = ray.get(spare.warmed, timeout=left)
                ray.get(spare.actor.ping.remote(), timeout=10.0)  # it may have died since it warmed up
            except (RayError, GetTimeoutError):  # died or stuck: try the next one
                ray.kill(spare.actor, no_restart=True)
                continue
            if warmed["device_touched"]:
                ray.kill(spare.actor, no_restart=True)
                self.disable("a spare's imports initialized CUDA, so spares cannot take devices on this cluster;"
                             " remaps start new processes")
                return None
            self.taken += 1
            return spare.actor
        return None

    def disable(self, why: str) -> None:
        """Stop every spare and start no more, saying ``why`` (a warning, and ``disabled``)."""
        self.disabled = why
        warnings.warn(why)
        while self.spares:
            ray.kill(self.spares.pop().actor, no_restart=True)

    def shutdown(self) -> None:
        """Stop every spare."""
        self.resize(0)
