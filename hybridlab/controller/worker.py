"""What runs inside a worker process: the Worker base class, ``register`` and the host actor.

A user worker is a plain class (subclass of ``Worker``) whose public methods are marked with
``@register(Dispatch.X)``. It is never a Ray actor itself: a ``WorkerHost`` actor constructs
one or several of them (several = roles colocated in one process, the hybrid engine) and runs
their methods, timing each call as a span.
"""
from __future__ import annotations

import contextlib
import enum
import gc
import os
import random
import sys
import socket
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

import ray

from hybridlab.controller.binding import bind_to_devices, set_threads
from hybridlab.controller.gloo_device import share_one_gloo_device
from hybridlab.controller.watch import STACK_SIGNAL, stack_file
from hybridlab.protocol import Batch
from hybridlab.telemetry.hub import ENV_HUB, DeviceSampler, get_hub


class Dispatch(str, enum.Enum):
    """How a WorkerGroup call fans out to ranks and how results come back."""

    ALL = "all"              # same arguments to every rank; returns the list of per-rank results
    DP = "dp"                # Batch arguments split by data-parallel rank (TP/PP peers share a
                             # chunk; a list of Batches: each one); one rank per DP group answers;
                             # results concatenated
    RANK_ZERO = "rank_zero"  # only rank 0 runs it; returns its result
    RAW = "raw"              # each argument is a per-rank list; returns the list of results


def register(dispatch: Dispatch | str = Dispatch.ALL, blocking: bool = True) -> Callable:
    """Decorator: expose a Worker method on its WorkerGroup with this dispatch mode.

    Returns the method unchanged apart from two attributes the WorkerGroup reads.
    ``blocking=False`` makes the group method return a future by default.
    """
    mode = Dispatch(dispatch)

    def mark(fn):
        fn._hl_dispatch = mode
        fn._hl_blocking = blocking
        return fn

    return mark


def registered_methods(cls) -> dict[str, tuple[Dispatch, bool, str]]:
    """Return ``{name: (dispatch, blocking, doc)}`` for every registered method of ``cls``."""
    out = {}
    for name in dir(cls):
        fn = getattr(cls, name, None)
        if callable(fn) and hasattr(fn, "_hl_dispatch"):
            out[name] = (fn._hl_dispatch, fn._hl_blocking, fn.__doc__ or "")
    return out


class Worker:
    """Base class of role workers. ``rank``, ``world_size`` and ``role`` are set before ``__init__``."""

    rank: int = 0
    world_size: int = 1
    role: str = ""
    peers: dict = {}  # role -> worker object, for the roles colocated in this process

    def dp_info(self) -> tuple[int, int, bool]:
        """Return (data-parallel rank, data-parallel size, answers for its DP group).

        Without model parallelism every rank is its own DP group. Engines with TP/PP override
        this once their parallel state exists.
        """
        return self.rank, self.world_size, True

    @staticmethod
    def init_distributed(backend: str | None = None, timeout_s: float = 120.0) -> None:
        """Join this group's torch.distributed world (gloo on CPU, nccl on GPU) if not joined yet."""
        import datetime

        import torch
        import torch.distributed as dist

        if dist.is_initialized():
            return
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))


def _nbytes(value: Any) -> int:
    if isinstance(value, Batch):
        return value.nbytes
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    nbytes = getattr(value, "nbytes", None)
    return nbytes if isinstance(nbytes, int) else 0


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Run the block with Python's cyclic garbage collector off, then freeze what exists.

    For a worker process's start: importing torch, megatron-core and vLLM creates millions of
    objects, and the collector scanning them again and again cost about a quarter of the
    imports' CPU time on our 2-core machines (8.0 s against 6.2 s, measured). Reference
    counting frees objects as usual throughout; the cycles left behind are collected once at
    the end (about 0.3 s). What remains lives as long as the process, so it is frozen: later
    collections, during the steps, skip it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.collect()
        if enabled:
            gc.enable()
        gc.freeze()


_LIBRARY_ROOTS = tuple({os.path.realpath(p) + os.sep for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)})
_HYBRIDLAB_ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__))) + os.sep


def library_module(module: Any) -> bool:
    """True for a module of an installed package, the standard library (built in or not) or
    hybridlab; False for a user's own (a reward function's file, a notebook's helpers), which a
    warm process of the kernel must not import ahead: a later session imports it as it is then."""
    attrs = getattr(module, "__dict__", {})  # never getattr: a lazy module's __getattr__ would import
    path = attrs.get("__file__")
    if path is None:  # built in, or a namespace package: judged by where its parts live
        paths = list(attrs.get("__path__") or [])
        return all(os.path.realpath(p).startswith((*_LIBRARY_ROOTS, _HYBRIDLAB_ROOT)) for p in paths)
    return os.path.realpath(path).startswith((*_LIBRARY_ROOTS, _HYBRIDLAB_ROOT))


class RemoteError(Exception):
    """Raised inside a host when a worker method fails; carries the formatted traceback."""

    def __init__(self, role: str, rank: int, method: str, tb: str):
        super().__init__(f"{role}[rank {rank}].{method} failed:\n{tb}")
        self.role, self.rank, self.method, self.tb = role, rank, method, tb

    def __reduce__(self):
        return RemoteError, (self.role, self.rank, self.method, self.tb)


class WorkerHost:
    """One worker process: holds one worker object per colocated role and runs their methods.

    ``host_actor_class`` adds one actor method per registered worker method (``role__method``),
    so a call carries only the user's arguments: Ray serializes every argument separately and
    each costs about 0.1 ms per call.
    """

    def __init__(self, env: dict[str, str]):
        os.environ.update(env)
        self.started_env = dict(env)  # what it was started with (a spare adopted later drops what it no longer has)
        self.workers: dict[str, Worker] = {}
        self.rank = -1
        self.gpu_ids: list[str] | None = None  # set when a spare adopts a bundle's devices
        self.sampler: DeviceSampler | None = None  # device samples for the run's hub, once started
        self._stacks = _register_stack_dump()

    def placement(self) -> dict:
        """Return where this process runs: node id and IP, device ids, process id."""
        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(),
                "gpu_ids": self._gpu_ids(), "pid": os.getpid()}

    def _gpu_ids(self) -> list[str]:
        return self.gpu_ids if self.gpu_ids is not None else [str(g) for g in ray.get_gpu_ids()]

    def warm(self, modules: tuple[str, ...]) -> dict:
        """Import ``modules`` (the engines' heavy imports) so that a role built here later starts
        without them; returns ``placement()`` and the modules that failed to import (the role
        that needs one raises the real error when it is built). Used by spare processes."""
        import importlib
        import sys

        failed = []
        with collector_paused():
            for name in modules:
                try:
                    importlib.import_module(name)
                except (Exception, SystemExit):
                    failed.append(name)
        # A process whose imports loaded the CUDA driver (``torch.cuda.is_available()`` does) has
        # fixed the devices it sees and cannot take one bundle's.
        try:
            with open("/proc/self/maps") as maps:
                touched = "libcuda.so" in maps.read()
        except OSError:
            torch = sys.modules.get("torch")
            touched = bool(torch is not None and torch.cuda.is_initialized())
        return {**self.placement(), "failed_imports": failed, "device_touched": touched}

    def loaded_modules(self, libraries_only: bool = False) -> list[str]:
        """Return the names of the modules this process has imported, in import order (what a
        spare imports ahead of the same roles); with ``libraries_only``, those of installed
        packages, the standard library and hybridlab alone (``library_module``)."""
        import sys

        return [name for name, module in list(sys.modules.items())
                if not name.startswith("__") and (not libraries_only or library_module(module))]

    def adopt(self, lease: dict, threads: int | None = None) -> dict:
        """Take a bundle's devices (``spares.bundle_devices``): their ids and the environment a new
        process there would have (the device variables Ray sets, ``CUDA_VISIBLE_DEVICES``, and the
        session's; variables it was started with that are not among them are removed), before
        anything touches a device, and that process's thread count; returns ``placement()``."""
        self.gpu_ids = list(lease["gpu_ids"])
        for gone in self.started_env.keys() - lease["env"].keys():  # a session's variable the adopter does not set
            os.environ.pop(gone, None)
        os.environ.update(lease["env"])
        if threads is not None:
            set_threads(threads)
        return self.placement()

    def free_port(self) -> int:
        """Return a TCP port that is free on this node (for the torch.distributed rendezvous).

        Chosen at random below the kernel's ephemeral range: a port from ``bind(0)`` is an
        ephemeral one, which any outgoing connection on the node may take as its source port
        before the rendezvous listens on it (EADDRINUSE; seen in the test suite)."""
        try:
            low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
        except (OSError, ValueError, IndexError):
            low = 32768
        pick = random.SystemRandom()
        for _ in range(64):
            port = pick.randrange(max(1024, low - 12000), low)
            with socket.socket() as s:
                try:
                    s.bind(("", port))
                except OSError:
                    continue
                return port
        with socket.socket() as s:  # every try taken: any free port
            s.bind(("", 0))
            return s.getsockname()[1]

    def start(self, rank: int, world_size: int, master: tuple[str, int], roles: dict) -> None:
        """Set the rendezvous environment, pin the threads to the devices' cores (when
        ``HYBRIDLAB_BIND_THREADS=1``), then construct each role's worker object."""
        self.rank, self.world_size = rank, world_size
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0",
                           "MASTER_ADDR": master[0], "MASTER_PORT": str(master[1])})
        bind_to_devices(self._gpu_ids())
        share_one_gloo_device()  # before any role builds its process groups (controller/gloo_device.py)
        self.add_roles(roles)
        self._start_sampler(",".join(roles))

    def add_roles(self, roles: dict) -> None:
        """Construct each role's worker object in this process (``role -> (cls, args, kwargs)``),
        beside the roles it already hosts: at ``start``, or later when a role joins them in place."""
        with collector_paused():  # building imports the engines (megatron-core, vLLM) and the models
            for role, (cls, args, kwargs) in roles.items():
                try:
                    obj = cls.__new__(cls)
                    obj.rank, obj.world_size, obj.role = self.rank, self.world_size, role
                    obj.peers = self.workers  # colocated roles reach each other in memory
                    obj.__init__(*args, **kwargs)
                except BaseException:
                    raise RemoteError(role, self.rank, "__init__", traceback.format_exc()) from None
                self.workers[role] = obj
        if self.sampler is not None:  # a role joined later: its samples name it too
            self.sampler.role = ",".join(self.workers)

    def _start_sampler(self, roles: str) -> None:
        """Send device samples to the run's telemetry hub, if the session named one."""
        hub = get_hub(os.environ.get(ENV_HUB))
        if hub is None:
            return
        self.sampler = DeviceSampler(hub, roles, self.rank, self._gpu_ids()).start()

    def dp_info(self, role: str) -> tuple[int, int, bool]:
        """Return the role's (dp_rank, dp_size, collect) on this rank."""
        return self.workers[role].dp_info()

    def call(self, _header: tuple[str, str, bool], *args, **kwargs):
        """Run ``role.method(*args, **kwargs)`` for ``_header = (role, method, collect)``.

        Returns (result, or None when not collected, span). Arguments travel as top-level call
        arguments so Ray resolves ObjectRefs among them (a Batch chunk stored once) before the
        call starts; the header is one argument because Ray serializes each one separately.
        """
        return self._run(*_header, args, kwargs)

    def _run(self, role: str, method: str, collect: bool, args: tuple, kwargs: dict):
        start = time.time()
        try:
            result = getattr(self.workers[role], method)(*args, **kwargs)
        except BaseException:
            raise RemoteError(role, self.rank, method, traceback.format_exc()) from None
        end = time.time()
        span = (role, self.rank, method, start, end, _nbytes(args) + _nbytes(kwargs),
                _nbytes(result), os.getpid())
        return (result if collect else None), span

    def ping(self) -> bool:
        """Return True (used to check that the process is alive)."""
        return True

    def close(self) -> None:
        """Call ``close()`` on each worker that has one (engines free what outlives the process,
        such as shared-memory segments), before the process is killed."""
        for obj in self.workers.values():
            if hasattr(obj, "close"):
                try:
                    obj.close()
                except Exception:  # the process is going away; a failed clean-up must not stop that
                    traceback.print_exc()
        if self._stacks is not None:
            self._stacks.close()
            Path(self._stacks.name).unlink(missing_ok=True)


def _register_stack_dump():
    """Make this process write every thread's Python stack to its stack file on the stack
    signal (CallWatch sends it to a stuck worker); returns the open file, or None if it cannot."""
    import faulthandler

    try:
        path = stack_file(os.getpid())
        path.parent.mkdir(parents=True, exist_ok=True)
        out = open(path, "w")
        faulthandler.register(STACK_SIGNAL, file=out, all_threads=True)
        return out
    except (OSError, RuntimeError, ValueError):  # no writable temp dir, or no signals here
        return None



_HOST_CLASSES: dict[tuple, Any] = {}


def host_actor_class(roles: dict[str, type]):
    """Return the Ray actor class hosting ``roles`` (role -> worker class), with a direct
    ``role__method`` actor method for each registered method; classes are cached."""
    key = tuple(sorted((r, c) for r, c in roles.items()))
    if key not in _HOST_CLASSES:
        def direct(role: str, method: str):
            def run(self, *args, **kwargs):
                return self._run(role, method, True, args, kwargs)
            run.__name__ = f"{role}__{method}"
            return run

        methods = {f"{r}__{m}": direct(r, m) for r, c in roles.items() for m in registered_methods(c)}
        name = "Host_" + "_".join(roles)
        _HOST_CLASSES[key] = ray.remote(type(name, (WorkerHost,), methods))
    return _HOST_CLASSES[key]
