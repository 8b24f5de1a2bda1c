"""The step, and what runs steps: ``step``, ``train``, ``start_background``, ``evaluate`` and the
weight sync, as part of RLSession (a mixin; the state they use is set up in session.py).

    rl.step():
        at a step boundary: edits queued meanwhile (update, remap, a new dataflow) apply first
        with recovery: a dead or stuck worker is re-created, state restored, the step run again
            batch = the next prompts
            batch, metrics = the dataflow's stages on it, e.g. GRPO's
                generate -> reward -> old_logprob, ref_logprob -> advantages -> update_actor
                -> sync_weights                      (dataflow/graph.py runs dataflow/stages.py)
            the step's records: skipped updates, timing, device busy -> metrics.jsonl, telemetry
"""
from __future__ import annotations

import functools
import threading
import time
import warnings

from hybridlab.controller.binding import one_torch_thread
from hybridlab.dataflow.context import StepContext
from hybridlab.dataflow.evaluation import accuracy_report, eval_scores
from hybridlab.dataflow.generations import generation_rows, generations_dir, write_generations
from hybridlab.dataflow.graph import StepResult
from hybridlab.dataflow.prompts import prompt_batch
from hybridlab.dataflow.recovery import with_recovery
from hybridlab.dataflow.rows import batch_rows
from hybridlab.dataflow.train_loop import run_training
from hybridlab.protocol import Batch
from hybridlab.reshard.transfer import sync_mapped
from hybridlab.telemetry.busy import session_busy
from hybridlab.verl import metrics as verl_metrics


class Stepping:
    """RLSession's steps and the loops over them."""

    def step(self) -> StepResult:
        """Run one RL step through the dataflow; returns its Batch and metrics (also logged)."""
        if self.workers is None:
            self.start()
        if self.broken:
            raise RuntimeError(self.broken)
        with one_torch_thread(), self.boundary.step():  # edits queued during the last step apply before this one
            return with_recovery(self, self._step)  # a dead or stuck worker: re-created, the step run again

    def context(self) -> StepContext:
        """Return a fresh StepContext of this session: what a stage sees (config, worker groups,
        the run's state, the sync), e.g. to call a stage's helpers by hand."""
        return StepContext(self.cfg, self.workers, self.state, self._dataflow.names, self.sync_weights)

    def _step(self, ctx: StepContext) -> StepResult:
        """The step itself: the next prompts through the dataflow, then the step's records."""
        t, state = self.cfg.trainer, self.state
        self.workers.watch.configure(t.call_deadline_floor_s, t.call_deadline_s)
        start, wall = time.perf_counter(), time.time()
        trace: list[tuple[str, list[str]]] = []
        batch, metrics = self._dataflow.run(ctx, state.prompts.next(), trace=trace)
        seconds = time.perf_counter() - start
        tokens = int(batch["response_mask"].sum()) if "response_mask" in batch else 0
        bad = int(metrics.get("actor/skipped", 0) + metrics.get("critic/skipped", 0))
        state.count_bad_updates(bad)
        if bad:
            ctx.warn(f"step {state.step_count + 1}: {bad} update(s) skipped for a NaN or inf loss or gradient norm;"
                     " the weights stay as they were")
        metrics["faults/bad_updates"] = state.bad_updates
        metrics["faults/worker_restarts"] = state.worker_restarts
        metrics.setdefault("rollout/staleness", 0)
        metrics.update({"timing/step_s": seconds, "perf/tokens_per_s": tokens / seconds if seconds else 0.0,
                        "warnings": len(ctx.warnings)})
        metrics.update(session_busy(self.workers, wall, time.time()))
        if t.verl_names:
            metrics.update(verl_metrics.step_metrics(metrics))
        state.add_step(metrics)
        if t.rollout_data_dir:
            write_generations(generations_dir(t.rollout_data_dir, self.run_dir), state.step_count,
                              generation_rows(batch, self.tokenizer, state.step_count))
        self.log.write(state.step_count, metrics)
        self.trackers.log(state.step_count, metrics)
        self.emit("metrics", {"step": state.step_count, **metrics})
        result = StepResult(state.step_count, batch, metrics, trace)
        for callback in list(self.step_callbacks):
            try:
                callback(result)
            except Exception as exc:  # a display hook must never stop training
                warnings.warn(f"step callback {callback!r} failed: {exc!r}", RuntimeWarning)
        return result

    def sync_weights(self, reason: str = "step"):
        """Copy the actor's weights into the rollout engines now; returns the SyncReport (the
        dataflow's sync_weights stage calls this, and a remap with ``reason="remap"``)."""
        lora = self.cfg.actor.lora
        transfer = functools.partial(sync_mapped, self.workers.groups, self.mapping, self.spec,
                                     adapter=lora.rank > 0 and lora.sync == "adapter")
        if self.cfg.trainer.streaming:  # the engines keep generating: a step's sync does not wait for them
            report = self.state.stream.sync(self.context(), transfer, wait=reason != "step")
        else:
            report = transfer()
        self.state.rollout_version = self.state.actor_version
        self.emit("sync", {"step": self.state.step_count + (reason == "step"), "bytes": report.bytes_moved,
                            "buckets": report.buckets, "seconds": report.seconds, "mode": report.mode,
                            "reason": reason, "bytes_per_pair": report.plan.get("bytes_per_pair", {})})
        return report

    def evaluate(self, samples: list | None = None) -> dict:
        """Return the current rollout weights' accuracy on the test prompts, answered as the
        ``evaluation`` section says (one greedy answer each by default): ``{"accuracy", "n",
        "reward_mean"}`` over every answer, and under ``"verl"`` verl's validation entries when
        the run logs verl's names."""
        samples = samples if samples is not None else self.test_samples
        if not samples:
            return {"accuracy": float("nan"), "n": 0, "reward_mean": float("nan")}
        prompts = prompt_batch(samples, self.tokenizer, list(range(len(samples))), self._prompt_fit())

        def scores(ctx: StepContext) -> Batch:
            self.state.stream.settle()  # streaming: the last sync's load is read first (a failed one raises)
            return eval_scores(ctx, prompts)

        # under the step lock: a remap or an edit waits for the evaluation as for a step; the dashboard
        # labels its calls by stage
        with self.boundary.lock, self.workers.timeline.staged("evaluate"), one_torch_thread():
            scored = with_recovery(self, scores)
        out = accuracy_report(scored, len(samples))
        if self.cfg.trainer.verl_names and "reward_answer" in scored.objects:
            n = self.cfg.evaluation.n
            out["verl"] = verl_metrics.validation_metrics(
                [s.data_source for s in samples for _ in range(n)], [i for i in range(len(samples)) for _ in range(n)],
                scored["token_level_scores"].sum(-1).tolist(), scored.objects["reward_answer"])
        return out

    def decoded(self, batch: Batch, limit: int = 16) -> list[dict]:
        """Return the first ``limit`` rows of a step's batch as readable dicts (prompt, response,
        length, reward, log-prob means, advantage) for a notebook table."""
        return [{k: v for k, v in row.items() if k != "#"} for row in batch_rows(batch[:limit], self.tokenizer)]

    def train(self, steps: int | None = None) -> dict:
        """Run ``steps`` steps (default trainer.steps; after ``resume``, the remaining ones)
        within trainer.max_minutes, evaluating greedy accuracy before, every
        trainer.eval_every steps and after, checkpointing every trainer.save_every steps, at
        the end and on a stop; writes and returns the summary (``summary.json``)."""
        if self.workers is None:
            self.start()
        self.training = True
        try:
            return run_training(self, steps)
        finally:  # a pause or stop asked for after the last step must not hold the next run
            self.training = False
            self.stop_requested = False
            self.boundary.resume()

    def start_background(self, steps: int | None = None) -> "BackgroundRun":
        """Run ``train(steps)`` in a background thread so the notebook kernel stays responsive;
        returns a handle with ``done()``, ``stop()`` and ``wait()``."""
        if self.workers is None:
            self.start()
        if self.background is not None and not self.background.done():
            raise RuntimeError("a background run is going: stop() or wait() for it before starting another")
        self.background = BackgroundRun(self, steps)
        return self.background


class BackgroundRun:
    """``RLSession.train`` running in a thread; the kernel stays free while it runs."""

    def __init__(self, rl: "Stepping", steps: int | None):
        self.rl, self.summary, self.error = rl, None, None
        self._thread = threading.Thread(target=self._run, args=(steps,), name="hybridlab-train", daemon=True)
        self._thread.start()

    def _run(self, steps: int | None) -> None:
        try:
            self.summary = self.rl.train(steps)
        except BaseException as exc:  # kept for wait() to re-raise in the kernel's thread
            self.error = exc

    def done(self) -> bool:
        """Return True once training has finished (or failed)."""
        return not self._thread.is_alive()

    def stop(self) -> None:
        """Ask the run to stop after the current step (it still evaluates and writes its summary)."""
        self.rl.request_stop()

    def wait(self, timeout: float | None = None) -> dict | None:
        """Wait for the run to end; returns its summary (re-raises its error), or None if it is
        still running after ``timeout`` seconds."""
        self._thread.join(timeout)
        if self.error is not None:
            raise self.error
        return self.summary

    def __repr__(self) -> str:
        state = "done" if self.done() else f"running, step {self.rl.state.step_count}"
        return f"BackgroundRun({state})"
