"""The training loop behind ``RLSession.train``: steps, evaluations, checkpoints, the summary.

    before = evaluate(); checkpoint (step 0: a dead trainer rolls back to it)
    until the target step:  [wait while paused] -> stop? time up? -> step -> evaluate? -> checkpoint?
    after = evaluate(); checkpoint; summary.json

A resumed session (``RLSession.resume``) goes on from its checkpoint's evaluations and run time.
A step whose worker died may roll the run back to its latest checkpoint (``recovery``): the
loop then runs the lost steps again, and their evaluations are made again.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tqdm.auto import tqdm

from hybridlab.atomic import write_json
from hybridlab.dataflow import checkpoints
from hybridlab.dataflow.recovery import WorkerLost

if TYPE_CHECKING:
    from hybridlab.dataflow.session import RLSession


def run_training(rl: "RLSession", steps: int | None = None) -> dict:
    """Run the loop on a started session; returns the summary (also written to summary.json)."""
    resumed, rl._train_state = rl._train_state, None
    if resumed:  # go on from the checkpoint's evaluations and run time
        steps = steps or max(0, rl.cfg.trainer.steps - rl.step_count)
        curve, before, last = list(resumed["curve"]), resumed["before"], resumed["last"]
        started = time.perf_counter() - resumed["seconds"]
    else:
        steps = steps or rl.cfg.trainer.steps
        started, curve = time.perf_counter(), []
        try:
            before = last = record_eval(rl, curve, 0.0)
        except WorkerLost as lost:  # the workers went before the first step (a lost node)
            before = last = {"step": rl.step_count, "accuracy": float("nan"), "n": 0}
            return stop_lost(rl, lost, before, last, curve, started)
    saved = rl.step_count if resumed else -1
    if rl.cfg.trainer.max_restarts and not checkpoints.checkpoint_dirs(rl.run_dir):
        saved = checkpoint(rl, before, last, curve, started)  # what a dead trainer goes back to
    stopped = "steps"
    first, target = rl.step_count, rl.step_count + steps
    bar = tqdm(total=steps, desc=f"{rl.cfg.name} rl", disable=not rl.cfg.trainer.progress, dynamic_ncols=True)
    while rl.step_count < target:
        started += wait_while_paused(rl, bar)  # paused time is not run time
        t = rl.cfg.trainer  # read each step: update() may change the time limit and evaluations
        if reason := stop_reason(rl, started):
            stopped = reason
            break
        try:
            result = rl.step()
            curve[:] = [c for c in curve if c["step"] < rl.step_count]  # evaluations of steps rolled back
            saved = min(saved, rl.step_count - 1)
            bar.n = rl.step_count - first
            bar.refresh()
            bar.set_postfix(reward=f"{result.metrics.get('reward/mean', float('nan')):.3f}",
                            acc=f"{result.metrics.get('accuracy', float('nan')):.3f}")
            if t.eval_every and rl.step_count % t.eval_every == 0:
                last = record_eval(rl, curve, time.perf_counter() - started)
                bar.write(f"step {rl.step_count}: greedy test accuracy {last['accuracy']:.3f}")
        except WorkerLost as lost:
            bar.close()
            return stop_lost(rl, lost, before, last, curve, started)
        if t.save_every and rl.step_count % t.save_every == 0:
            saved = checkpoint(rl, before, last, curve, started)
        if rl.bad_steps_in_a_row >= t.max_bad_updates:  # skipped updates kept the last good weights
            stopped = (f"{rl.bad_steps_in_a_row} steps in a row had a NaN or inf loss or gradient norm (their updates"
                       " were skipped; the checkpoint holds the last good weights); check the learning rate, the"
                       " rewards and the advantages")
            break
    bar.close()
    with rl._edits.lock:  # a queued edit may drop the pending rollout too
        rl._drop_pending()
    # the last step may just have been evaluated: same weights, so its result stands
    try:
        after = last if curve and curve[-1]["step"] == rl.step_count else \
            record_eval(rl, curve, time.perf_counter() - started)
    except WorkerLost as lost:
        return stop_lost(rl, lost, before, last, curve, started)
    if saved != rl.step_count:  # always a checkpoint at the end and on a stop
        checkpoint(rl, before, after, curve, started)
    return write_summary(rl, before, after, curve, time.perf_counter() - started, stopped)


def wait_while_paused(rl: "RLSession", bar) -> float:
    """Hold the loop here, between steps, while ``pause()`` says so; returns the seconds held."""
    if not rl._edits.paused:
        return 0.0
    bar.set_description(f"{rl.cfg.name} rl (paused)")
    held = rl._edits.wait_while_paused()
    bar.set_description(f"{rl.cfg.name} rl")
    return held


def stop_reason(rl: "RLSession", started: float) -> str | None:
    """Return why the loop must stop before another step (time limit, a stop asked for), or None."""
    t = rl.cfg.trainer
    if time.perf_counter() > started + t.max_minutes * 60:
        return f"time limit ({t.max_minutes:g} min)"
    return "stop requested" if rl._stop_requested else None


def stop_lost(rl: "RLSession", lost: WorkerLost, before: dict, last: dict, curve: list, started: float) -> dict:
    """End a run whose workers are lost: a checkpoint when the trainers still hold the last
    finished step, and a failed summary saying why; returns the summary."""
    if lost.can_save:
        checkpoint(rl, before, last, curve, started)
    return write_summary(rl, before, last, curve, time.perf_counter() - started, str(lost), failed=True)


def checkpoint(rl: "RLSession", before: dict, last: dict, curve: list, started: float) -> int:
    """Checkpoint the run with the loop's progress; returns the step saved."""
    rl._train_state = {"before": before, "last": last, "curve": list(curve), "seconds": time.perf_counter() - started}
    try:
        rl.save_checkpoint()
    finally:
        rl._train_state = None
    return rl.step_count


def record_eval(rl: "RLSession", curve: list[dict], seconds: float) -> dict:
    """Evaluate now, append the point to ``curve``, log and emit it; returns the evaluation."""
    rl._emit("phase", {"phase": "evaluate", "step": rl.step_count})
    ev = rl.evaluate()
    curve.append({"step": rl.step_count, "accuracy": ev["accuracy"], "seconds": round(seconds, 1)})
    rl.log.write(rl.step_count, {"eval/accuracy": ev["accuracy"]})
    rl.trackers.log(rl.step_count, {"eval/accuracy": ev["accuracy"]})
    rl._emit("eval", {"step": rl.step_count, "accuracy": ev["accuracy"]})
    return ev


def write_summary(rl: "RLSession", before: dict, after: dict, curve: list, seconds: float, stopped: str,
                  failed: bool = False) -> dict:
    """Write and return ``summary.json``: accuracies, steps, timings, curve, restarts,
    environment, config; ``failed``: the run stopped on lost workers."""
    step_s = sum(h.get("timing/step_s", 0.0) for h in rl.history)
    sync_s = sum(h.get("sync/seconds", 0.0) for h in rl.history)
    summary = {
        "run_dir": str(rl.run_dir), "name": rl.cfg.name, "algorithm": rl.cfg.algorithm.adv_estimator,
        "dataflow": rl.dataflow.names, "model": rl.cfg.model, "task": rl.cfg.data.task,
        "accuracy_before": before["accuracy"], "accuracy_after": after["accuracy"], "eval_n": after["n"],
        "steps": rl.step_count, "stopped_by": stopped, "failed": failed, "rl_seconds": round(seconds, 1),
        "worker_restarts": rl.worker_restarts, "restarts": rl.restarts,
        "mean_step_s": round(step_s / len(rl.history), 3) if rl.history else None,
        "sync_fraction_of_step": round(sync_s / step_s, 4) if step_s else None,
        "eval_curve": curve, "warm_start": rl.warm_start_info,
        "environment": rl.environment, "config": rl.cfg.to_dict(),
    }
    write_json(rl.run_dir / "summary.json", summary)
    return summary
