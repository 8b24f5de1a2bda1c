"""Device busy fractions from call spans: how much of a step each device spent in worker calls.

A worker call occupies the devices of its process for the span's duration (as the worker saw
it). Overlapping calls on one device (colocated roles, or a call submitted while another runs)
count once: the union of the intervals. ``busy / step time`` per device is the figure that
compares a colocated with a split placement (``perf/device_busy`` in the metrics).
"""
from __future__ import annotations

from typing import Callable, Iterable

from hybridlab.telemetry.timeline import Span


def union_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """Return the total length of the union of ``(start, end)`` intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def busy_fractions(spans: Iterable[Span], device_of: Callable[[str, int], list[str]], start: float,
                   end: float) -> dict[str, float]:
    """Return device -> the share of ``[start, end]`` in which a call ran on it; ``device_of(role,
    rank)`` names the devices of a worker (a device with no call in the window is not listed)."""
    window = end - start
    if window <= 0:
        return {}
    per_device: dict[str, list[tuple[float, float]]] = {}
    for s in spans:
        left, right = max(s.start, start), min(s.end, end)
        if right <= left:
            continue
        for device in device_of(s.role, s.rank):
            per_device.setdefault(device, []).append((left, right))
    return {d: union_seconds(iv) / window for d, iv in sorted(per_device.items())}


def busy_metrics(fractions: dict[str, float], devices: list[str]) -> dict[str, float]:
    """Return ``perf/device_busy`` (the mean over ``devices``, idle ones counting 0) and
    ``perf/device_busy/<device>`` per device (``GPU 0`` is written ``gpu0``)."""
    if not devices:
        return {}
    out = {f"perf/device_busy/{d.lower().replace(' ', '')}": fractions.get(d, 0.0) for d in devices}
    out["perf/device_busy"] = sum(fractions.get(d, 0.0) for d in devices) / len(devices)
    return out


def session_busy(session, start: float, end: float) -> dict[str, float]:
    """Return the ``busy_metrics`` of a controller WorkerSet's devices over ``[start, end]``
    (wall clock), from its timeline's spans and its workers' placements."""
    placed: dict[tuple[str, int], list[str]] = {}
    for role, group in session.groups.items():
        for rank, p in enumerate(group.placements):
            placed[(role, rank)] = [f"GPU {g}" for g in p.get("gpu_ids", [])] or ["cpu"]
    devices = sorted({d for ds in placed.values() for d in ds})
    fractions = busy_fractions(session.timeline.ending_after(start), lambda r, k: placed.get((r, k), []), start, end)
    return busy_metrics(fractions, devices)
