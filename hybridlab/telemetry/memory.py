"""Memory creep: the slope of a worker's resident memory after warm-up, and the leak alarm.

The same measure serves ``bench soak`` (per 100 steps, over a long run) and the dashboard's
alarm: after warm-up (``WARMUP_STEPS``, or the first third of the steps when that is more), the
least-squares slope of resident memory against the step number. The alarm is raised when the
slope is above ``LEAK_PCT_PER_100_STEPS`` percent of the memory per 100 steps both over all the
steps after warm-up (at least ``MIN_STEPS``) and over their second half: growth that stays, not
a start-up ramp that flattens.
"""
from __future__ import annotations

import numpy as np

LEAK_PCT_PER_100_STEPS = 1.0
WARMUP_STEPS = 50      # at least; and never less than the first third of the steps so far
MIN_STEPS = 50         # steps after warm-up before the slope is judged


def slope_per_100(steps, values) -> float:
    """Return the least-squares slope of ``values`` over ``steps``, per 100 steps (0 if flat in x)."""
    x, y = np.asarray(steps, dtype=float), np.asarray(values, dtype=float)
    if len(x) < 2:
        return 0.0
    dx = x - x.mean()
    sxx = float(dx @ dx)
    return 100 * float(dx @ (y - y.mean())) / sxx if sxx else 0.0


def step_at(times, ends) -> np.ndarray:
    """Return, for each sample time, the fractional step it falls in (``ends``: the sorted end
    times of steps 1, 2, ...; a time between two ends interpolates)."""
    t, ends = np.asarray(times, dtype=float), np.asarray(ends, dtype=float)
    i = np.searchsorted(ends, t, side="left")
    inner = (i > 0) & (i < len(ends))
    out = np.where(i == 0, 0.0, float(len(ends)))
    j = i[inner]
    out[inner] = j + (t[inner] - ends[j - 1]) / np.maximum(ends[j] - ends[j - 1], 1e-9)
    return out


def leak_check(times: list[float], mb: list[float], step_ends: list[float]) -> dict | None:
    """Return ``{"slope_mb", "slope_pct", "recent_pct", "leak"}`` (per 100 steps) for one worker's
    samples (``times``, ``mb``) given the end times of the run's steps, or None before there are
    enough steps after warm-up to judge."""
    warmup = max(WARMUP_STEPS, len(step_ends) // 3)
    if len(step_ends) < warmup + MIN_STEPS:
        return None
    after = step_ends[warmup - 1]
    times, mb = np.asarray(times, dtype=float), np.asarray(mb, dtype=float)
    keep = times >= after
    if keep.sum() < 4:
        return None
    steps = step_at(times[keep], step_ends)
    values = mb[keep]
    mean = float(values.mean())
    slope = slope_per_100(steps, values)
    half = len(steps) // 2
    recent = 100 * slope_per_100(steps[half:], values[half:]) / mean
    pct = 100 * slope / mean
    return {"slope_mb": slope, "slope_pct": pct, "recent_pct": recent,
            "leak": bool(pct > LEAK_PCT_PER_100_STEPS and recent > LEAK_PCT_PER_100_STEPS)}
