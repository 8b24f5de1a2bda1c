"""Streaming rollouts against batch-level asynchrony (issue 61): ``hybridlab bench async --json``.

Two workloads, each on split placement (the actor on one device; the rollout and the reward on
the other), in this order of modes, all in one session switched between them live (``rl.update``
of the four settings below, then the mode's own warm-up steps):

- ``sync``: on-policy, a batch generated per step;
- ``ahead``: today's pipeline, ``trainer.off_policy`` one batch ahead (its straggler share is
  reported: the share of a generate call's decode steps in which only its longest 10% ran);
- ``stream1``, ``stream2``: ``trainer.streaming`` with ``max_staleness`` 1 and 2, keeping the KV
  cache of samples in flight at a sync (``partial_rollouts=keep``);
- ``stream2_recompute``: the same with ``partial_rollouts=recompute``;
- ``colocated``: on-policy on the default hybrid engine (every role in one process per device,
  both devices), the best colocated synchronous mapping on this machine; a session of its own.

Workloads: ``generation`` (bound by generation): reverse with a long tail of string lengths (4
to 200 letters, Pareto 1.2: median 7, p90 26) and up to 256 new tokens, from the tiny model
warm-started on it (cached) so that answers end by themselves; ``training`` (bound by the
update): arith, 16 new tokens, 4 PPO epochs over mini-batches of 4 prompts.

The workload's name says which side bounds it in the batch modes; streaming can move the bound
(generation no longer drains to its longest response), so ``bottleneck_side`` is the busier side
of the best streaming mode and ``bottleneck_busy`` its busy share.

Between two modes the session goes through on-policy (``OFF``), so that a stream is closed, and
the prompt stream restarts from its first position: each mode draws the same prompts. The
actor's learning rate is 0: each step runs the whole update (forward, backward, AdamW's step)
and the weight sync but leaves the policy as it was, so every mode generates from the same
policy. What still differs from a session per mode: the later modes run in warmer processes,
and the batch modes' sampling seeds follow the step count (streaming's follow the prompts).

Figures per mode: the trained samples' mean response length (streaming trains the groups that
finish first, so over a few measured steps its samples can be shorter than a batch's);
completion tokens/s (trained completion tokens over the measured steps' wall time); each side's
busy share of that time: the trainer's is the union of the actor's worker
calls; the rollout's is the union of its generate calls in batch modes and, streaming, the
seconds its engines spent stepping (a weight sync pauses them: paused is idle); the engines'
mean occupancy (running sequences per engine step; batch modes: tokens over the longest
response, the decode steps a call takes); ``generate_stage_share``, the share of the time the
steps spent in the generate stage: on-policy a whole generation; one batch ahead the take of
the batch generated ahead (its wait for the engines falls in the next sync, which queues
behind the generation in flight); streaming the take of finished groups with any wait for
them (the sync waits on the engines too, for the calls sent before it and for each weight
bucket's load but the last: the tiny model has one bucket); the trained tokens' mean and max staleness; the
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
# each mode's placement (None: the default hybrid engine) and its settings, every one of the four spelled
# so that a session switched from any mode to it lands in exactly that mode
OFF = {"trainer.off_policy": "false", "trainer.streaming": "false", "trainer.max_staleness": "1",
       "trainer.partial_rollouts": "keep"}
MODES: dict[str, tuple[str | None, dict[str, str]]] = {
    "sync": (SPLIT, OFF),
    "ahead": (SPLIT, {**OFF, "trainer.off_policy": "true"}),
    "stream1": (SPLIT, {**OFF, "trainer.streaming": "true"}),
    "stream2": (SPLIT, {**OFF, "trainer.streaming": "true", "trainer.max_staleness": "2"}),
    "stream2_recompute": (SPLIT, {**OFF, "trainer.streaming": "true", "trainer.max_staleness": "2",
                                  "trainer.partial_rollouts": "recompute"}),
    "colocated": (None, OFF)}
GENERATION_TASK = {"min_len": 4, "max_len": 200, "lengths": "long_tail"}
WORKLOADS = {
    "generation": {"bound": "rollout", "overrides": ["data.task=reverse", f"data.task_options={GENERATION_TASK}",
                                                     "rollout.max_new_tokens=256"]},
    "training": {"bound": "trainer", "overrides": ["data.task=arith", "rollout.max_new_tokens=16",
                                                   "rollout.ignore_eos=true", "actor.ppo_epochs=4"]},
}


def _overrides(model: str, work: dict, placement: str | None, prompts: int, group: int, run_dir: str) -> list[str]:
    return [f"model={model}", "warm_start.max_steps=0", "trainer.devices=2", f"data.prompts_per_step={prompts}",
            f"rollout.n={group}", f"actor.ppo_mini_batch_size={min(4, prompts)}", "data.test_samples=4",
            "trainer.progress=false", "trainer.telemetry=false", f"trainer.run_dir={run_dir}",
            "actor.lr=0",  # the whole update runs, the policy stays: every mode generates the same answers
            *work["overrides"], *([placement] if placement else [])]


def measure_modes(model: str, work: dict, modes: list[str], prompts: int, group: int, steps: int,
                  warmup: int) -> dict[str, dict]:
    """Run ``modes`` (one placement) in one session, switched live from one to the next: each
    mode's settings, ``warmup`` steps, then ``steps`` measured; returns each mode's figures."""
    out = {}
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
        rl = RLSession(None, _overrides(model, work, MODES[modes[0]][0], prompts, group, f"{tmp}/run"))
        rl.start()
        first = rl.state.prompts.state()
        try:
            for mode in modes:
                rl.update(*(f"{key}={value}" for key, value in OFF.items()))  # a stream closes, its prompts go back
                if rl.state.stream.rows or rl.state.ahead.pending:
                    raise RuntimeError(f"bench async: prompts still pending before mode {mode}")
                rl.state.prompts.restart(first)  # every mode draws the same prompts
                rl.update(*(f"{key}={value}" for key, value in MODES[mode][1].items()))
                for _ in range(warmup):
                    rl.step()
                since, started = time.time(), time.perf_counter()
                metrics = [rl.step().metrics for _ in range(steps)]
                wall = time.perf_counter() - started
                out[mode] = figures(metrics, rl.workers.timeline.spans(since=since), wall, steps)
        finally:
            rl.shutdown()
    return out


def figures(metrics: list[dict], spans: list, wall: float, steps: int) -> dict:
    """Return one mode's figures from its measured steps' ``metrics`` and call ``spans``."""
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
            "generate_stage_share": round(sum(m["timing/generate_s"] for m in metrics) / wall, 3),
            "occupancy": round(statistics.mean(occupancy), 2),
            "response_length_mean": round(statistics.mean(m["response_length/mean"] for m in metrics), 2),
            "staleness_mean": round(statistics.mean(m.get("rollout/staleness_mean", m["rollout/staleness"])
                                                    for m in metrics), 3),
            "staleness_max": max(m["rollout/staleness"] for m in metrics),
            "partial_share": round(statistics.mean(m.get("rollout/partial_share", 0.0) for m in metrics), 3),
            "preempted_share": round(sum(m.get("rollout/preempted", 0) for m in metrics) / samples, 3) if samples else 0.0,
            "straggler_share": round(statistics.mean(m["rollout/straggler_share"] for m in metrics), 3)}


def workload(name: str, model: str, prompts: int, group: int, steps: int, warmup: int, modes: tuple[str, ...]) -> dict:
    """Run every mode of one workload; returns the figures and the ratios between modes."""
    work = WORKLOADS[name]
    runs: dict[str, dict] = {}
    for placement in dict.fromkeys(MODES[m][0] for m in modes):  # a session per placement, its modes in MODES' order
        same = [m for m in MODES if m in modes and MODES[m][0] == placement]
        runs.update(measure_modes(model, work, same, prompts, group, steps, warmup))
    runs = {m: runs[m] for m in modes}
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
