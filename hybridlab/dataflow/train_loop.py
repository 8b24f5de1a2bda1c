"""The training loop behind ``RLSession.train``: steps, evaluations, checkpoints, the summary.

    before = evaluate(); checkpoint (step 0: a dead trainer rolls back to it)
    until the target step:  [wait while paused] -> stop? time up? -> step -> evaluate? -> checkpoint?
    after = evaluate(); checkpoint; summary.json

A resumed session (``RLSession.resume``) goes on from its checkpoint's evaluations and run time.
A step whose worker died may roll the run back to its latest checkpoint (``recovery``): the
loop then runs the lost steps again, and their evaluations are made again.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from tqdm.auto import tqdm

from hybridlab.atomic import write_json
from hybridlab.dataflow import checkpoints
from hybridlab.dataflow.recovery import WorkerLost
from hybridlab.dataflow.run_state import TrainProgress

if TYPE_CHECKING:
    from hybridlab.dataflow.session import RLSession


def run_training(rl: "RLSession", steps: int | None = None) -> dict:
    """Run the loop on a started session; returns the summary (also written to summary.json)."""
    state = rl.state
    progress, state.train_progress = state.train_progress, None
    resumed = progress is not None  # then go on from the checkpoint's evaluations and run time
    if resumed:
        steps, saved = steps or max(0, rl.cfg.trainer.steps - state.step_count), state.step_count
    else:
        steps, saved, progress = steps or rl.cfg.trainer.steps, -1, TrainProgress(before={}, last={}, curve=[])
    progress.start_clock()
    if not resumed:
        try:
            progress.before = progress.last = record_eval(rl, progress)
        except WorkerLost as lost:  # the workers went before the first step (a lost node)
            progress.before = progress.last = {"step": state.step_count, "accuracy": float("nan"), "n": 0}
            return stop_lost(rl, lost, progress)
        if rl.cfg.trainer.max_restarts and not checkpoints.checkpoint_dirs(rl.run_dir):
            saved = checkpoint(rl, progress)  # what a dead trainer goes back to
    stopped = "steps"
    first, target = state.step_count, state.step_count + steps
    bar = tqdm(total=steps, desc=f"{rl.cfg.name} rl", disable=not rl.cfg.trainer.progress, dynamic_ncols=True)
    while state.step_count < target:
        progress.hold(wait_while_paused(rl, bar))  # paused time is not run time
        t = rl.cfg.trainer  # read each step: update() may change the time limit and evaluations
        if reason := stop_reason(rl, progress):
            stopped = reason
            break
        try:
            result = rl.step()
            progress.curve[:] = [c for c in progress.curve if c["step"] < state.step_count]  # steps rolled back
            saved = min(saved, state.step_count - 1)
            bar.n = state.step_count - first
            bar.refresh()
            bar.set_postfix(reward=f"{result.metrics.get('reward/mean', float('nan')):.3f}",
                            acc=f"{result.metrics.get('accuracy', float('nan')):.3f}")
            if t.eval_every and state.step_count % t.eval_every == 0:
                progress.last = record_eval(rl, progress)
                bar.write(f"step {state.step_count}: greedy test accuracy {progress.last['accuracy']:.3f}")
        except WorkerLost as lost:
            bar.close()
            return stop_lost(rl, lost, progress)
        if t.save_every and state.step_count % t.save_every == 0:
            saved = checkpoint(rl, progress)
        if state.bad_steps_in_a_row >= t.max_bad_updates:  # skipped updates kept the last good weights
            stopped = (f"{state.bad_steps_in_a_row} steps in a row had a NaN or inf loss or gradient norm (their"
                       " updates were skipped; the checkpoint holds the last good weights); check the learning"
                       " rate, the rewards and the advantages")
            break
    bar.close()
    return finish(rl, progress, saved, stopped)


def finish(rl: "RLSession", progress: TrainProgress, saved: int, stopped: str) -> dict:
    """End the loop: drop the rollouts ahead, evaluate (unless the last step just was), checkpoint
    (unless step ``saved`` is the last) and write the summary; returns it."""
    with rl.boundary.lock:  # a queued edit may drop the pending rollout too
        rl.state.ahead.drop(rl.state.prompts)
    curve, step = progress.curve, rl.state.step_count
    try:  # the last step may just have been evaluated: same weights, so its result stands
        after = progress.last if curve and curve[-1]["step"] == step else record_eval(rl, progress)
    except WorkerLost as lost:
        return stop_lost(rl, lost, progress)
    progress.last = after
    if saved != step:  # always a checkpoint at the end and on a stop
        checkpoint(rl, progress)
    return write_summary(rl, progress, stopped)


def wait_while_paused(rl: "RLSession", bar) -> float:
    """Hold the loop here, between steps, while ``pause()`` says so; returns the seconds held."""
    if not rl.boundary.paused:
        return 0.0
    bar.set_description(f"{rl.cfg.name} rl (paused)")
    held = rl.boundary.wait_while_paused()
    bar.set_description(f"{rl.cfg.name} rl")
    return held


def stop_reason(rl: "RLSession", progress: TrainProgress) -> str | None:
    """Return why the loop must stop before another step (time limit, a stop asked for), or None."""
    t = rl.cfg.trainer
    if t.max_minutes and progress.elapsed() > t.max_minutes * 60:
        return f"time limit ({t.max_minutes:g} min)"
    return "stop requested" if rl.stop_requested else None


def stop_lost(rl: "RLSession", lost: WorkerLost, progress: TrainProgress) -> dict:
    """End a run whose workers are lost: a checkpoint when the trainers still hold the last
    finished step, and a failed summary saying why; returns the summary."""
    if lost.can_save:
        checkpoint(rl, progress)
    return write_summary(rl, progress, str(lost), failed=True)


def checkpoint(rl: "RLSession", progress: TrainProgress) -> int:
    """Checkpoint the run with the loop's progress; returns the step saved."""
    rl.save_checkpoint(progress)
    return rl.state.step_count


def record_eval(rl: "RLSession", progress: TrainProgress) -> dict:
    """Evaluate now, append the point to the progress's curve, log and emit it; returns the evaluation."""
    step, seconds = rl.state.step_count, round(progress.elapsed(), 1)
    rl.emit("phase", {"phase": "evaluate", "step": step})
    ev = rl.evaluate()
    progress.curve.append({"step": step, "accuracy": ev["accuracy"], "seconds": seconds})
    rl.log.write(step, {"eval/accuracy": ev["accuracy"], **ev.get("verl", {})})
    rl.trackers.log(step, {"eval/accuracy": ev["accuracy"], **ev.get("verl", {})})
    rl.emit("eval", {"step": step, "accuracy": ev["accuracy"]})
    return ev


def write_summary(rl: "RLSession", progress: TrainProgress, stopped: str, failed: bool = False) -> dict:
    """Write and return ``summary.json``: accuracies (``progress.before`` and ``.last``), steps,
    timings, curve, restarts, environment, config; ``failed``: the run stopped on lost workers."""
    before, after = progress.before, progress.last
    step_s = sum(h.get("timing/step_s", 0.0) for h in rl.state.history)
    sync_s = sum(h.get("sync/seconds", 0.0) for h in rl.state.history)
    summary = {
        "run_dir": str(rl.run_dir), "name": rl.cfg.name, "algorithm": rl.cfg.algorithm.adv_estimator,
        "dataflow": rl.dataflow.names, "model": rl.cfg.model, "task": rl.cfg.data.task,
        "accuracy_before": before["accuracy"], "accuracy_after": after["accuracy"], "eval_n": after["n"],
        "steps": rl.state.step_count, "stopped_by": stopped, "failed": failed,
        "rl_seconds": round(progress.elapsed(), 1),
        "worker_restarts": rl.state.worker_restarts, "restarts": rl.state.restarts,
        "mean_step_s": round(step_s / len(rl.state.history), 3) if rl.state.history else None,
        "sync_fraction_of_step": round(sync_s / step_s, 4) if step_s else None,
        "eval_curve": progress.curve, "warm_start": rl.warm_start_info,
        "environment": rl.environment, "config": rl.cfg.to_dict(),
    }
    write_json(rl.run_dir / "summary.json", summary)
    return summary
