"""TelemetryHub: a named Ray actor that gathers a run's telemetry and persists it append-only.

Records are dicts with a ``kind``: ``run`` (name, config), ``span`` (a worker call: role, rank,
method, stage, start, end, bytes), ``metrics`` (one RL step), ``eval``, ``sync`` (bytes,
buckets, seconds, reason), ``phase`` (warm start progress, evaluation), ``remap`` (a
RemapReport), ``device`` (one sample of a worker's device: CPU% and resident memory on CPU
machines, utilization and memory through NVML on GPUs, with the process's resident memory and
torch's allocated and reserved CUDA memory), ``running`` (the calls in flight), ``stacks``
(stack files written on request), ``restart``, ``resume`` and ``checkpoint``. Each ``add`` appends JSON lines
to ``RUN_DIR/telemetry.jsonl`` and flushes, so a crash loses at most what was in flight and a
finished or crashed run can be replayed from the file. ``since(offset)`` serves live viewers
from that same file, so the hub holds no copy of the records in memory.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import orjson

TELEMETRY_FILE = "telemetry.jsonl"
ENV_HUB = "HYBRIDLAB_TELEMETRY_HUB"      # workers find the hub by this actor name
NAMESPACE = "hybridlab"


def hub_name(run_dir: str | os.PathLike) -> str:
    """Return the actor name of a run directory's hub (stable for the same absolute path)."""
    digest = hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]
    return f"hybridlab-telemetry-{digest}"


class TelemetryHub:
    """Append-only store of a run's telemetry (wrapped as a Ray actor by ``start_hub``, which
    runs one call at a time: no lock needed)."""

    def __init__(self, run_dir: str):
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        self.path = Path(run_dir) / TELEMETRY_FILE
        self._file = open(self.path, "ab")

    def add(self, kind: str, items: list[dict]) -> int:
        """Append records of ``kind``; returns the file's size in bytes after them."""
        data = "".join(json.dumps({"kind": kind, **item}, default=float) + "\n" for item in items).encode()
        if not self._file.closed:
            self._file.write(data)
            self._file.flush()
        return self.path.stat().st_size

    def size(self) -> int:
        """Return the file's size in bytes; a caller's earlier records are in it (calls run in order)."""
        return self.path.stat().st_size

    def since(self, offset: int) -> tuple[list[dict], int]:
        """Return (the records after byte ``offset`` of the run's file, the offset after them)."""
        return read_records(self.path.parent, offset)

    def close(self) -> None:
        """Close the file (the records stay readable)."""
        self._file.close()


def start_hub(run_dir: str | os.PathLike):
    """Start (or find) the hub actor of ``run_dir`` in the connected Ray cluster; returns its handle."""
    import ray

    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # One thread: Ray runs a caller's calls in the order sent only on a single-threaded actor, and
    # a reader then sees every record sent before its call (the calls are quick file appends).
    actor = ray.remote(num_cpus=0)(TelemetryHub)
    # On the controller's node: the run directory is written there, and the hub outlives any
    # other node of a multi-node cluster that goes away.
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return actor.options(name=hub_name(run_dir), namespace=NAMESPACE, get_if_exists=True,
                         scheduling_strategy=here).remote(str(run_dir))


def find_hub(run_dir: str | os.PathLike):
    """Return the live hub of ``run_dir`` if this process is connected to its Ray cluster, else None."""
    return get_hub(hub_name(run_dir))


def get_hub(name: str | None):
    """Return the live hub actor called ``name`` in the connected Ray cluster, else None."""
    if not name or "ray" not in sys.modules:  # not imported: not connected (and a served page skips the import)
        return None
    import ray

    if not ray.is_initialized():
        return None
    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return None


class DeviceSampler:
    """A thread in a worker process that sends one device sample per second to the hub.

    On CPU machines it reports this process's CPU% and resident memory (psutil), attributed
    to the logical device(s) the worker holds; with NVML (``nvidia-ml-py``) it reports each
    visible GPU's utilization and memory.
    """

    def __init__(self, hub, role: str, rank: int, devices: list[str], period_s: float = 1.0):
        self.hub, self.role, self.rank, self.devices, self.period = hub, role, rank, devices, period_s
        self._stop = threading.Event()
        self._last = None                # the previous add() call, to notice the hub going away
        self._thread = threading.Thread(target=self._loop, name="device-sampler", daemon=True)

    def start(self) -> "DeviceSampler":
        """Start sampling in the background; returns self."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop sampling."""
        self._stop.set()

    def _loop(self) -> None:
        import psutil
        import ray

        proc = psutil.Process()
        proc.cpu_percent(None)
        nvml = _nvml()
        while not self._stop.wait(self.period):
            now = time.time()
            process = {"pid": proc.pid, "rss_mb": proc.memory_info().rss / 2**20, **_torch_cuda_memory()}
            if nvml is not None:
                samples = [dict(time=now, device=f"GPU {d}", role=self.role, rank=self.rank, **nvml(int(d)), **process)
                           for d in self.devices]
            else:
                device = ",".join(self.devices)
                samples = [{"time": now, "device": f"GPU {device}" if self.devices else "cpu", "role": self.role,
                            "rank": self.rank, "util": proc.cpu_percent(None), "memory_mb": process["rss_mb"],
                            **process}]
            previous = self._last
            if previous is not None and ray.wait([previous], timeout=0)[0]:
                try:
                    ray.get(previous)
                except Exception:  # the hub is gone (the run is over): stop quietly
                    return
            try:
                self._last = self.hub.add.remote("device", samples)
            except Exception:
                return


def _torch_cuda_memory() -> dict:
    """Return this process's CUDA memory through torch (allocated and reserved MB), or {} when it
    has not used CUDA (CPU machines; only the CPU path has run on our machines)."""
    import sys

    torch = sys.modules.get("torch")  # never import torch (or start CUDA) just to sample
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    return {"gpu_allocated_mb": torch.cuda.memory_allocated() / 2**20,
            "gpu_reserved_mb": torch.cuda.memory_reserved() / 2**20}


def _nvml() -> Any:
    try:
        import pynvml

        pynvml.nvmlInit()
        if pynvml.nvmlDeviceGetCount() == 0:
            return None
    except Exception:
        return None

    def sample(index: int) -> dict:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        util = pynvml.nvmlDeviceGetUtilizationRates(handle)
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        return {"util": float(util.gpu), "memory_mb": mem.used / 2**20}
    return sample


def read_lines(run_dir: str | os.PathLike, offset: int = 0) -> tuple[list[bytes], int]:
    """Return (the complete lines of the run's telemetry file after byte ``offset``, new offset);
    a half-written last line is left for the next read."""
    data, offset = read_bytes(run_dir, offset)
    return data.splitlines(), offset


def read_bytes(run_dir: str | os.PathLike, offset: int = 0) -> tuple[bytes, int]:
    """Return (the complete lines of the run's telemetry file after byte ``offset`` as one bytes
    object, new offset); a half-written last line is left for the next read."""
    return read_complete_lines(Path(run_dir) / TELEMETRY_FILE, offset)


def read_complete_lines(path: Path, offset: int = 0) -> tuple[bytes, int]:
    """Return (the complete lines of the log at ``path`` after byte ``offset`` as one bytes object,
    new offset; nothing while the file does not exist); a half-written last line is left."""
    if not path.is_file():
        return b"", offset
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1
    return data[:end], offset + end


def parse_lines(lines: list[bytes]) -> list[dict]:
    """Return the records of telemetry lines (blank ones skipped)."""
    try:  # orjson is 4x faster than json here: a long run's first page parses 30,000 records
        return [orjson.loads(line) for line in lines]
    except orjson.JSONDecodeError:  # NaN or inf (which json.dumps writes and orjson refuses), a blank line
        return [_parse_line(line) for line in lines if line.strip()]


def _parse_line(line: bytes) -> dict:
    try:
        return orjson.loads(line)
    except orjson.JSONDecodeError:
        return json.loads(line)  # NaN and inf, or the error that names a damaged line


def read_records(run_dir: str | os.PathLike, offset: int = 0) -> tuple[list[dict], int]:
    """Return (complete records in the run's telemetry file after byte ``offset``, new offset);
    a half-written last line is left for the next read."""
    lines, offset = read_lines(run_dir, offset)
    return parse_lines(lines), offset
