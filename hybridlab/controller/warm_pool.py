"""The kernel's warm pool: fresh, pre-imported worker processes that outlive a session.

A notebook kernel (or a long script) that starts one session after another pays, at every
start, for each worker process: Python and Ray, then the torch, megatron-core and vLLM imports
(5-10 s of CPU a process on our 2-core machines). This process-wide pool keeps up to ``size``
processes that have done all of that and hold no devices: a session's ``start()`` adopts them
(``spawn_hosts``, as a remap adopts ``trainer.spare_processes``) instead of starting its own, and
the pool refills in the background once the session's workers are built.

Only processes that have never run a worker are adopted, so nothing of an earlier session
(torch.distributed, Megatron's or vLLM's parallel state, environment variables, thread
affinity, ``gc.freeze``, the device sampler thread, cached user modules) can reach a later one:
a session's own processes are stopped with it, as before. The pool belongs to the Ray
connection it was filled on; a new connection (``ray.shutdown()`` and ``ray.init()`` again, or
another cluster) starts it afresh.

Its size is a setting of the Python process, not of a session's config:
``set_warm_processes(n)``, or ``HYBRIDLAB_WARM_PROCESSES=n`` before the first session. The
default is 1 on a machine without GPUs and 0 with them: a spare holds no device, but on a GPU
node its imports may initialize CUDA, which would fix the devices it can ever take. The
``hybridlab`` command line runs one session per process, so it sets 0.
"""
from __future__ import annotations

import os

import ray

from hybridlab.controller.spares import SparePool

ENV_SIZE = "HYBRIDLAB_WARM_PROCESSES"


class WarmPool:
    """Fresh worker processes kept for the next session of this Python process."""

    def __init__(self, size: int | None = None):
        self.size = default_size() if size is None else _checked(size)
        self.spares: SparePool | None = None
        self._job = None  # the Ray job (driver connection) the spares belong to
        self._psutil: dict = {}  # pid -> psutil.Process, kept so that cpu_percent measures between samples

    def pool(self) -> SparePool | None:
        """Return the spares of the current Ray connection (None when the pool is off or empty);
        spares of an earlier connection died with it and are forgotten."""
        job = ray.get_runtime_context().get_job_id() if ray.is_initialized() else None
        if self.spares is not None and job != self._job:
            self.spares = None
        return self.spares if self.size else None

    def refill(self, roles: dict[str, type], env: dict[str, str], modules: list[str]) -> None:
        """Start spares up to ``size`` that can host ``roles`` (role -> worker class) and import
        ``modules`` (the libraries a session's workers imported: ``WorkerHost.loaded_modules``
        with ``libraries_only``); they warm up in the background."""
        if not self.size:
            return
        if self.pool() is None:
            self.spares, self._job = SparePool(roles, env), ray.get_runtime_context().get_job_id()
        self.spares.add_roles(roles)
        self.spares.learn_modules(modules)
        self.spares.resize(self.size)

    def resize(self, n: int) -> None:
        """Keep ``n`` processes from now on (0: none; extra ones stop at once)."""
        self.size = _checked(n)
        if self.pool() is not None:
            self.spares.resize(min(self.size, self.spares.target))

    def samples(self) -> list[dict]:
        """Return a ``device`` sample of the pool for the dashboard's System section (its warmed-up
        processes on this node: their summed resident memory in MB and CPU %), or [] when empty."""
        import psutil

        here = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        procs = [p for p in self.processes() if p["node_id"] == here]
        for gone in self._psutil.keys() - {p["pid"] for p in procs}:  # adopted or stopped since the last sample
            del self._psutil[gone]
        rss = cpu = 0.0
        for p in procs:
            try:
                proc = self._psutil.setdefault(p["pid"], psutil.Process(p["pid"]))
                rss, cpu = rss + proc.memory_info().rss / 2**20, cpu + proc.cpu_percent(None)
            except psutil.Error:  # adopted or stopped meanwhile
                continue
        if not procs:
            return []
        return [{"device": "cpu", "role": "warm pool", "rank": 0, "util": cpu, "memory_mb": rss, "rss_mb": rss,
                 "processes": len(procs)}]

    def processes(self) -> list[dict]:
        """Return each warmed-up spare's placement (node, pid) that has finished warming up."""
        pool = self.pool()
        if pool is None or not pool.spares:
            return []
        ready, _ = ray.wait([s.warmed for s in pool.spares], num_returns=len(pool.spares), timeout=0)
        out = []
        for ref in ready:
            try:
                out.append(ray.get(ref))
            except ray.exceptions.RayError:  # it died: take() drops it when a session asks
                continue
        return out


def _checked(n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"warm processes must be a whole number >= 0, got {n!r}")
    return n


def default_size() -> int:
    """Return the pool's size when nobody set one: ``HYBRIDLAB_WARM_PROCESSES``, else 1 on a
    machine without GPUs and 0 with them."""
    value = os.environ.get(ENV_SIZE)
    if value is not None:
        if not value.isdigit():
            raise ValueError(f"{ENV_SIZE} must be a whole number >= 0, got {value!r}")
        return int(value)
    return 0 if _has_gpus() else 1


def _has_gpus() -> bool:
    """True when this machine has NVIDIA GPUs (asked of the driver's device files, not of CUDA:
    initializing CUDA in the controller is what the pool must avoid)."""
    return any(os.path.exists(p) for p in ("/dev/nvidia0", "/proc/driver/nvidia/gpus"))


_POOL: WarmPool | None = None


def warm_pool() -> WarmPool:
    """Return this Python process's warm pool (created on first use)."""
    global _POOL
    if _POOL is None:
        _POOL = WarmPool()
    return _POOL


def set_warm_processes(n: int) -> None:
    """Keep ``n`` fresh, pre-imported worker processes for the sessions this Python process
    starts next (0 turns the pool off and stops its processes)."""
    warm_pool().resize(n)
