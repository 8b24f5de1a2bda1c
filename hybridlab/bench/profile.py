"""Where a GRPO step's time goes, and how close its matmuls come to the machine's peak.

- ``matmul_peaks``: fp32 and bf16 GFLOP/s of square matmuls on the benchmark's threads, measured
  in the benchmark process while no worker runs (the same run's reference).
- ``step_profile``: per dataflow stage, the seconds the controller spent in it and the seconds
  the workers spent in its calls (the union of their spans, as the workers timed them). The
  difference is dispatch, Batch serialization, Ray's object transfer and the controller's own
  work around the calls; ``outside_stages_s`` is the controller's work between stages.
- ``peak_fractions``: model FLOPs per second of the rollout and of the update over a peak, by
  the usual estimate (2 x parameters per token forward, 6 x forward and backward; attention's
  context term is not counted, so the fractions are slight underestimates).
"""
from __future__ import annotations

import statistics
import time

import torch

from hybridlab.telemetry.busy import union_seconds
from hybridlab.telemetry.timeline import Span


def matmul_gflops(dtype: torch.dtype, threads: int, max_size: int = 2048, seconds: float = 1.0) -> float:
    """Return GFLOP/s of square matmuls in ``dtype`` on ``threads`` threads: the size doubles
    from 256 until one matmul takes 50 ms (or reaches ``max_size``), so that a dtype without
    hardware support (bf16 on a processor without AVX-512 BF16 or AMX: under 1 GFLOP/s) costs
    seconds, not minutes; then as many as fit in ``seconds``, at least two."""
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    size = 256
    while True:
        a, b = (torch.randn(size, size, generator=g).to(dtype) for _ in range(2))
        start = time.perf_counter()
        a @ b  # also the warm-up: thread pool, kernel selection
        if time.perf_counter() - start > 0.05 or size >= max_size:
            break
        size *= 2
    count, start = 0, time.perf_counter()
    while count < 2 or time.perf_counter() - start < seconds:
        a @ b
        count += 1
    return 2 * size ** 3 * count / (time.perf_counter() - start) / 1e9


def matmul_peaks(threads: int) -> dict[str, float]:
    """Return {"fp32": GFLOP/s, "bf16": GFLOP/s} of this machine's matmuls on ``threads`` threads."""
    return {"fp32": round(matmul_gflops(torch.float32, threads), 1),
            "bf16": round(matmul_gflops(torch.bfloat16, threads), 1)}


def _windowed(spans: list[Span], window: tuple[float, float]) -> list[Span]:
    return [s for s in spans if window[0] <= s.start < window[1]]


def step_profile(spans: list[Span], windows: list[tuple[float, float]], metrics: list[dict]) -> dict:
    """Return the median per step of each stage's controller and worker seconds, their
    difference summed over the stages (``calls_overhead_s``), the controller's seconds outside
    the stages and the bytes the calls moved. ``windows`` are the steps' wall-clock (start, end); ``metrics`` their metrics.
    Under off-policy generation the rollout's calls run ahead, during other stages: that stage's
    worker seconds exceed its controller seconds, and its overhead is counted as 0."""
    stages = [k[len("timing/"):-2] for k in metrics[0] if k.startswith("timing/") and k != "timing/step_s"]
    out: dict = {"stages": {}}
    overheads, outside, moved = [], [], []
    for window, m in zip(windows, metrics):
        in_step = _windowed(spans, window)
        total = 0.0
        for stage in stages:
            workers = union_seconds((s.start, s.end) for s in in_step if s.stage == stage)
            row = out["stages"].setdefault(stage, {"controller_s": [], "workers_s": []})
            row["controller_s"].append(m[f"timing/{stage}_s"])
            row["workers_s"].append(workers)
            total += max(0.0, m[f"timing/{stage}_s"] - workers) if workers else 0.0
        overheads.append(total)
        outside.append(m["timing/step_s"] - sum(m[f"timing/{stage}_s"] for stage in stages))
        moved.append(sum(s.bytes_in + s.bytes_out for s in in_step))
    for row in out["stages"].values():
        for key in ("controller_s", "workers_s"):
            row[key] = round(statistics.median(row[key]), 4)
    out.update(calls_overhead_s=round(statistics.median(overheads), 4),
               outside_stages_s=round(statistics.median(outside), 4),
               call_bytes_per_step=int(statistics.median(moved)))
    return out


def peak_fractions(params: int, tokens: float, rollout_s: float, update_s: float, peak_gflops: float) -> dict:
    """Return the GFLOP/s that the rollout (2 x params x tokens) and the update (6 x params x
    tokens) reach on ``tokens`` real (prompt and response) tokens, and their share of
    ``peak_gflops``."""
    rollout = 2 * params * tokens / rollout_s / 1e9 if rollout_s else 0.0
    update = 6 * params * tokens / update_s / 1e9 if update_s else 0.0
    return {"rollout_gflops": round(rollout, 1), "update_gflops": round(update, 1),
            "rollout_peak_fraction": round(rollout / peak_gflops, 3) if peak_gflops else None,
            "update_peak_fraction": round(update / peak_gflops, 3) if peak_gflops else None}
