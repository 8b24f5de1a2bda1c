"""Streaming rollouts against batch-level asynchrony (issue 61): ``hybridlab bench async --json``.

Two workloads, each on split placement (the actor on one device; the rollout and the reward on
the other), in this order of modes, one session each:

- ``sync``: on-policy, a batch generated per step;
- ``ahead``: today's pipeline, ``trainer.off_policy`` one batch ahead (its straggler share is
  reported: the share of a generate call's decode steps in which only its longest 10% ran);
- ``stream1``, ``stream2``: ``trainer.streaming`` with ``max_staleness`` 1 and 2, keeping the KV
  cache of samples in flight at a sync (``partial_rollouts=keep``);
- ``stream2_recompute``: the same with ``partial_rollouts=recompute``;
- ``colocated``: on-policy on the default hybrid engine (every role in one process per device,
  both devices), the best colocated synchronous mapping on this machine.

Workloads: ``generation`` (bound by generation): reverse with a long tail of string lengths (4
to 200 letters, Pareto 1.2: median 7, p90 26) and up to 256 new tokens, from the tiny model
warm-started on it (cached) so that answers end by themselves; ``training`` (bound by the
update): arith, 16 new tokens, 4 PPO epochs over mini-batches of 4 prompts.

The workload's name says which side bounds it in the batch modes; streaming can move the bound
(generation no longer drains to its longest response), so ``bottleneck_side`` is the busier side
of the best streaming mode and ``bottleneck_busy`` its busy share.

Figures per mode: completion tokens/s (trained completion tokens over the measured steps' wall
time); each side's busy share of that time: the trainer's is the union of the actor's worker
calls; the rollout's is the union of its generate calls in batch modes and, streaming, the
seconds its engines spent stepping (a weight sync pauses them: paused is idle); the engines'
mean occupancy (running sequences per engine step; batch modes: tokens over the longest
response, the decode steps a call takes); the trained tokens' mean and max staleness; the
partial and preempted shares of the trained samples.
"""
from __future__ import annotations

import statistics
import tempfile
import time

from hybridlab.bench.e2e import warm_model
from hybridlab.dataflow.session import RLSession
from hybridlab.environment import processor
from hybridlab.telemetry.busy import union_seconds

SPLIT = ("mapping={pools: {train: {devices: 1}, gen: {devices: 1}}, roles: {actor: {pool: train},"
         " rollout: {pool: gen, colocate: g}, reward: {pool: gen, colocate: g}}}")
MODES = {"sync": [SPLIT], "ahead": [SPLIT, "trainer.off_policy=true"],
         "stream1": [SPLIT, "trainer.streaming=true", "trainer.max_staleness=1"],
         "stream2": [SPLIT, "trainer.streaming=true", "trainer.max_staleness=2"],
         "stream2_recompute": [SPLIT, "trainer.streaming=true", "trainer.max_staleness=2",
                               "trainer.partial_rollouts=recompute"],
         "colocated": []}
GENERATION_TASK = {"min_len": 4, "max_len": 200, "lengths": "long_tail"}
WORKLOADS = {
    "generation": {"bound": "rollout", "overrides": ["data.task=reverse", f"data.task_options={GENERATION_TASK}",
                                                     "rollout.max_new_tokens=256"]},
    "training": {"bound": "trainer", "overrides": ["data.task=arith", "rollout.max_new_tokens=16",
                                                   "rollout.ignore_eos=true", "actor.ppo_epochs=4"]},
}


def _overrides(model: str, work: dict, mode: str, prompts: int, group: int, run_dir: str) -> list[str]:
    return [f"model={model}", "warm_start.max_steps=0", "trainer.devices=2", f"data.prompts_per_step={prompts}",
            f"rollout.n={group}", f"actor.ppo_mini_batch_size={min(4, prompts)}", "data.test_samples=4",
            "trainer.progress=false", "trainer.telemetry=false", f"trainer.run_dir={run_dir}",
            *work["overrides"], *MODES[mode]]


def measure(model: str, work: dict, mode: str, prompts: int, group: int, steps: int, warmup: int) -> dict:
    """Run one mode's session: ``warmup`` steps, then ``steps`` measured; returns its figures."""
    with tempfile.TemporaryDirectory(prefix=f"bench-async-{mode}-") as tmp:
        rl = RLSession(None, _overrides(model, work, mode, prompts, group, f"{tmp}/run"))
        rl.start()
        try:
            for _ in range(warmup):
                rl.step()
            since, started = time.time(), time.perf_counter()
            metrics = [rl.step().metrics for _ in range(steps)]
            wall = time.perf_counter() - started
            spans = rl.workers.timeline.spans(since=since)
        finally:
            rl.shutdown()
    streaming = "rollout/occupancy" in metrics[0]
    tokens = sum(m["rollout/tokens"] for m in metrics)
    trainer = union_seconds((s.start, s.end) for s in spans if s.role == "actor")
    rollout = sum(m["rollout/engine_busy_s"] for m in metrics) if streaming else \
        union_seconds((s.start, s.end) for s in spans if s.method in ("generate", "generate_agent"))
    occupancy = [m["rollout/occupancy"] if streaming else m["rollout/tokens"] / max(m["response_length/max"], 1)
                 for m in metrics]
    samples = sum(m.get("rollout/samples", 0) for m in metrics)
    return {"tokens_per_s": round(tokens / wall, 1), "step_s": round(wall / steps, 3),
            "busy": {"rollout": round(min(rollout / wall, 1.0), 3), "trainer": round(min(trainer / wall, 1.0), 3)},
            "occupancy": round(statistics.mean(occupancy), 2),
            "staleness_mean": round(statistics.mean(m.get("rollout/staleness_mean", m["rollout/staleness"])
                                                    for m in metrics), 3),
            "staleness_max": max(m["rollout/staleness"] for m in metrics),
            "partial_share": round(statistics.mean(m.get("rollout/partial_share", 0.0) for m in metrics), 3),
            "preempted_share": round(sum(m.get("rollout/preempted", 0) for m in metrics) / samples, 3) if samples else 0.0,
            "straggler_share": round(statistics.mean(m["rollout/straggler_share"] for m in metrics), 3)}


def workload(name: str, model: str, prompts: int, group: int, steps: int, warmup: int, modes: tuple[str, ...]) -> dict:
    """Run every mode of one workload; returns the figures and the ratios between modes."""
    work = WORKLOADS[name]
    runs = {mode: measure(model, work, mode, prompts, group, steps, warmup) for mode in modes}
    out: dict = {"bound_by": work["bound"], "modes": runs}
    if "ahead" in runs:
        base = runs["ahead"]["tokens_per_s"]
        out["speedup_vs_one_step_ahead"] = {m: round(r["tokens_per_s"] / base, 3) for m, r in runs.items()}
        out["one_step_ahead_straggler_share"] = runs["ahead"]["straggler_share"]
    streams = [m for m in runs if m.startswith("stream")]
    if streams:
        best = max(streams, key=lambda m: runs[m]["tokens_per_s"])
        busy = runs[best]["busy"]
        out["best_streaming"] = best
        out["bottleneck_side"] = max(busy, key=busy.get)  # the busier side sets the pace once streaming
        out["bottleneck_busy"] = busy[out["bottleneck_side"]]
        if "colocated" in runs:
            out["best_streaming_vs_colocated"] = round(runs[best]["tokens_per_s"] / runs["colocated"]["tokens_per_s"], 3)
    return out


def run(model: str = "tiny", prompts_per_step: int = 16, group: int = 4, steps: int = 8, warmup: int = 2,
        warm_steps: int = 400, workloads: str = "both", modes: str = "all") -> dict:
    """Return each workload's figures per mode with the goals (see the module docstring)."""
    names = ("generation", "training") if workloads == "both" else (workloads,)
    if any(n not in WORKLOADS for n in names):
        raise ValueError(f"workloads must be both, generation or training, got {workloads!r}")
    chosen = tuple(MODES) if modes == "all" else tuple(modes.split(","))
    if any(m not in MODES for m in chosen):
        raise ValueError(f"modes must be 'all' or names from {', '.join(MODES)}, got {modes!r}")
    out: dict = {"processor": processor(), "model": model, "prompts_per_step": prompts_per_step, "group": group,
                 "steps": steps, "warmup": warmup}
    for name in names:
        warmed = warm_model(model, "reverse", GENERATION_TASK, warm_steps) if name == "generation" else model
        out[name] = workload(name, warmed, prompts_per_step, group, steps, warmup, chosen)
    gen = out.get("generation", {})
    if "speedup_vs_one_step_ahead" in gen:
        best = max((m for m in gen["modes"] if m.startswith("stream")), key=lambda m: gen["modes"][m]["tokens_per_s"])
        out["goal_speedup_met"] = gen["speedup_vs_one_step_ahead"][best] >= 1.3
    out["goal_bottleneck_busy_met"] = all(out[n].get("bottleneck_busy", 0) >= 0.9 for n in names)
    return out
