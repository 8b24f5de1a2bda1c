"""Thread binding on CPU nodes: each worker process pinned to the cores of its own devices.

On a CPU-only Ray cluster a "device" is a logical GPU that stands for a share of the node's
cores. Ray reserves CPUs per bundle but does not pin anything, so two processes on two devices
still let the OS move their threads across all cores, and an idle rollout engine's thread can
land on the core the actor's matmuls run on. With ``trainer.bind_threads`` each worker process
pins all its threads to its devices' cores (``HYBRIDLAB_BIND_THREADS=1`` in the workers'
environment; read by ``Host.start``). vLLM's own ``VLLM_CPU_OMP_THREADS_BIND`` applies only to
its multiprocess executor, not to the in-process engine our rollout worker runs.
"""
from __future__ import annotations

import contextlib
import os
import sys
import types
from typing import Iterator

BIND_ENV = "HYBRIDLAB_BIND_THREADS"


def device_cores(allowed: list[int], devices_on_node: int, device_ids: list[int]) -> list[int]:
    """Return the cores of ``device_ids`` when the node's ``allowed`` cores are dealt out in
    equal consecutive blocks, block g to device g (ids taken modulo ``devices_on_node``, for
    nodes whose ids do not start at 0; more devices than cores: device g gets core ``g mod
    cores``). No devices: all allowed cores."""
    cores = sorted(allowed)
    if devices_on_node <= 0 or not device_ids or not cores:
        return cores
    slots = {g % devices_on_node for g in device_ids}
    block = len(cores) // devices_on_node
    if block == 0:
        return sorted({cores[g % len(cores)] for g in slots})
    return sorted(c for g in slots for c in cores[g * block:(g + 1) * block])


def set_threads(threads: int) -> None:
    """Make this process run ``threads`` OpenMP/torch threads: the variable for what starts
    later, and torch's pool if torch is loaded already."""
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Run the block with one torch (OpenMP) thread in this thread, then put this thread's
    number back. Torch keeps the number per thread, set from the process's last one at a
    thread's first torch call: threads that used torch before keep theirs, and those whose first
    call falls inside the block (the dataflow's stage threads) keep one. The controller runs its
    steps so, on every machine: its tensors are small, and a second OpenMP thread, spinning after
    each operation, took CPU from the actor and the engines on the cores they are pinned to
    (verl's controller, a Ray actor, runs with ``OMP_NUM_THREADS=1`` too). In a process where
    vLLM's CPU engine runs in-process, the threads stay as the engine bound them: once it has,
    vLLM replaces ``torch.set_num_threads`` with a stand-in that only warns."""
    import torch

    if not isinstance(torch.set_num_threads, types.BuiltinFunctionType):  # vLLM's Python stand-in
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def pin_process(cores: list[int]) -> list[int]:
    """Pin every thread of this process (and so the threads they start later) to ``cores`` and
    cap its OpenMP/torch threads at their number; returns the cores this thread now runs on."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except (ProcessLookupError, PermissionError):  # a thread that ended meanwhile
            pass
    if int(os.environ.get("OMP_NUM_THREADS") or len(cores)) > len(cores):  # they would always contend
        set_threads(len(cores))
    return sorted(os.sched_getaffinity(0))


def bind_to_devices(device_ids: list[str]) -> list[int] | None:
    """If ``HYBRIDLAB_BIND_THREADS=1``, pin this Ray worker process to its devices' cores
    (``device_cores`` over the node's logical GPUs); returns the cores, or None when binding
    is off or the platform cannot pin."""
    if os.environ.get(BIND_ENV) != "1" or not hasattr(os, "sched_setaffinity"):
        return None
    import ray

    node = ray.get_runtime_context().get_node_id()
    devices = next((int(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n["NodeID"] == node), 0)
    cores = device_cores(sorted(os.sched_getaffinity(0)), devices, [int(g) for g in device_ids])
    try:
        return pin_process(cores)
    except OSError:  # cores this process may not use (a cgroup changed under it): stay unpinned
        return None
