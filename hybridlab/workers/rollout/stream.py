"""EngineStream: the rollout engine run continuously (``trainer.streaming``).

A thread of the rollout worker's process owns the in-process vLLM engine and steps it while it
holds requests. The worker's methods, which Ray runs one at a time in the process's main thread,
only touch it between two engine steps: ``submit`` adds prompts (each fans out into its n
samples inside vLLM), ``take`` hands over the groups whose n samples have all finished, and
``pause`` / ``resume`` bracket a weight sync, so the engine stops stepping while every bucket of
the new weights loads in place and then continues with the sequences it was generating (their
earlier tokens keep the log-probs they were sampled with).

Every token records the policy version that sampled it: vLLM labels the engine's steps with
``set_weight_version`` and reports each sample's spans of versions (``weight_versions``). After a
sync, ``partial="keep"`` goes on from the KV cache computed under the old weights (PipelineRL,
Tinker's in-flight sampling); ``"recompute"`` preempts the running requests so that vLLM
recomputes their KV cache under the new weights (AReaL), which vLLM counts as preemptions.
"""
from __future__ import annotations

import contextlib
import copy
import itertools
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

PARTIAL_MODES = ("keep", "recompute")


@dataclass
class StreamStats:
    """What the engine did since the last ``take``: seconds stepping and waiting, the running
    sequences summed over its steps (occupancy), and preemptions."""

    busy_s: float = 0.0
    idle_s: float = 0.0
    engine_steps: int = 0
    running: int = 0          # running sequences, summed over steps
    preempted: int = 0        # samples vLLM preempted (KV-cache pressure, or a recompute sync)
    recomputed: int = 0       # of those, the ones a recompute sync preempted


class EngineStream:
    """An in-process vLLM engine stepped by a thread of its own; see the module docstring."""

    def __init__(self, llm, partial: str = "keep", version: int = 0):
        if partial not in PARTIAL_MODES:
            raise ValueError(f"partial rollouts: {partial!r} is not one of {', '.join(PARTIAL_MODES)}")
        self.llm, self.engine, self.partial = llm, llm.llm_engine, partial
        self.cond = threading.Condition()
        self.gate, self.callers = threading.Lock(), 0  # calls waiting for their turn: the thread lets them in first
        self.groups: dict[str, dict] = {}     # request id -> the group's submission (key, prompt ids, n)
        self.finished: list[dict] = []        # finished groups, oldest first
        self.calls: dict[str, Future] = {}    # request id -> the future of a ``call`` (its samples)
        self.numbers = itertools.count()
        self.paused = self.closed = False
        self.version = version
        self.stats = StreamStats()
        self.preemptions: dict[str, int] = {}  # sample request id -> preemptions seen
        self.error: BaseException | None = None
        self.has_finished = threading.Event()  # set when a group finishes (or the thread fails): wakes ``take``
        self.engine.set_weight_version(str(version))
        self.thread = threading.Thread(target=self._loop, name="rollout-stream", daemon=True)
        self.thread.start()

    def submit(self, prompts: list[tuple[int, list[int], object]], lora_request=None) -> None:
        """Add one request per ``(key, prompt ids, SamplingParams)``; each becomes a group of
        ``params.n`` samples that ``take`` hands over."""
        with self._turn():
            self._raise()
            for key, ids, params in prompts:
                self._add(f"g{key}-{next(self.numbers)}", {"key": key, "prompt_ids": list(ids), "version": self.version},
                          ids, params, lora_request)

    def call(self, ids: list[int], params, lora_request=None) -> tuple[str, Future]:
        """Add one request for a caller to wait on (an agent's model call, an evaluation): returns
        its request id and a future of its ``params.n`` samples (``ids``, ``logprobs``, ``versions``)."""
        request, future = f"call-{next(self.numbers)}", Future()
        with self._turn():
            self._raise()
            self.calls[request] = future
            self._add(request, {"key": request, "prompt_ids": list(ids), "version": self.version}, ids,
                      copy.copy(params), lora_request)
        return request, future

    def abort(self, request: str) -> None:
        """Abort one ``call`` that is no longer waited for."""
        with self._turn():
            if self.groups.pop(request, None) is not None:
                self.engine.abort_request([request])
            self.calls.pop(request, None)

    def generate(self, prompts: list[list[int]], params, lora_request=None) -> list[list[dict]]:
        """Generate beside the stream (an evaluation, a refill) and wait: returns each prompt's
        samples (``ids``, ``logprobs``, ``versions``), in order. The engine is this thread's to
        step, so a plain ``LLM.generate`` must not run while a stream does."""
        futures = [self.call(ids, params, lora_request)[1] for ids in prompts]
        return [future.result() for future in futures]

    def _add(self, request: str, group: dict, ids: list[int], params, lora_request) -> None:
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params.output_kind = RequestOutputKind.FINAL_ONLY  # a group comes back once, whole
        self.groups[request] = group
        self.engine.add_request(request, TokensPrompt(prompt_token_ids=list(ids)), params, lora_request=lora_request)
        self.cond.notify_all()

    def take(self, wait_s: float = 0.0) -> tuple[list[dict], StreamStats, int]:
        """Return (the finished groups, oldest first; the stats since the last take; the groups
        still in the engine), after waiting up to ``wait_s`` for a group to finish when none has.
        The wait holds no lock, so the engine steps meanwhile: a caller that waits here instead
        of polling takes the engine's turn once per finished group, not once per look."""
        if wait_s > 0 and not self.finished and self.groups:
            self.has_finished.wait(wait_s)
        with self._turn():
            self._raise()
            self.has_finished.clear()
            done, self.finished = self.finished, []
            stats, self.stats = self.stats, StreamStats()
            return done, stats, len(self.groups)

    def pause(self) -> None:
        """Stop stepping after the current step (a weight sync follows)."""
        with self._turn():
            self.paused = True

    def resume(self, version: int) -> None:
        """Label the engine's next steps ``version`` (the weights just loaded) and step again; with
        ``partial="recompute"`` the running requests' KV cache is computed again under them."""
        with self._turn():
            self.version = version
            self.engine.set_weight_version(str(version))
            if self.partial == "recompute" and self.groups:
                self.stats.recomputed += len(self._scheduler().running)
                self.llm.reset_prefix_cache(reset_running_requests=True)
            self.paused = False
            self.cond.notify_all()

    def close(self) -> None:
        """Abort what runs and stop the thread."""
        with self._turn():
            self.closed = True
            if self.groups:
                self.engine.abort_request(list(self.groups))
                self.groups.clear()
            for future in self.calls.values():
                future.cancel()
            self.calls.clear()
            self.cond.notify_all()
        self.thread.join(timeout=30)

    @contextlib.contextmanager
    def _turn(self):
        """Hold the engine between two of its steps (the thread waits while a call is waiting)."""
        with self.gate:
            self.callers += 1
        with self.cond:
            try:
                yield
            finally:
                with self.gate:
                    self.callers -= 1
                self.cond.notify_all()

    def _raise(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"the rollout stream's engine thread failed: {self.error!r}") from self.error

    def _loop(self) -> None:
        try:
            while True:
                with self.cond:
                    waited = time.perf_counter()
                    while not self.closed and (self.paused or not self.groups or self.callers):
                        self.cond.wait()
                    self.stats.idle_s += time.perf_counter() - waited
                    if self.closed:
                        return
                    started = time.perf_counter()
                    running = self.engine.get_num_unfinished_requests()
                    outputs = self.engine.step()
                    self.stats.busy_s += time.perf_counter() - started
                    self.stats.engine_steps += 1
                    self.stats.running += running
                    self._count_preemptions()
                    for out in outputs:
                        if out.finished:
                            self._finish(out)
        except BaseException as exc:  # surfaced by the next call into the stream, and to every waiting caller
            with self.cond:
                self.error = exc
                for future in self.calls.values():
                    if not future.done():
                        future.set_exception(RuntimeError(f"the rollout stream's engine thread failed: {exc!r}"))
                self.calls.clear()
            self.has_finished.set()

    def _scheduler(self):
        return self.engine.engine_core.engine_core.scheduler  # the in-process engine's (VLLM_ENABLE_V1_MULTIPROCESSING=0)

    def _count_preemptions(self) -> None:
        """Add the preemptions vLLM made since the last step (each request counts its own)."""
        requests = self._scheduler().requests
        for request_id, request in requests.items():
            seen = self.preemptions.get(request_id, 0)
            if request.num_preemptions > seen:
                self.stats.preempted += request.num_preemptions - seen
                self.preemptions[request_id] = request.num_preemptions
        for gone in [r for r in self.preemptions if r not in requests]:
            del self.preemptions[gone]

    def _finish(self, out) -> None:
        """Move a finished group from the engine to ``finished``, with each sample's tokens,
        log-probs and the version that sampled each token (a call's samples to its future)."""
        group = self.groups.pop(out.request_id, None)
        if group is None:  # aborted meanwhile
            return
        samples = []
        for completion in out.outputs:
            ids = list(completion.token_ids)
            versions = [0] * len(ids)
            for span in completion.weight_versions or []:
                versions[span.start:span.end] = [int(span.version)] * (span.end - span.start)
            samples.append({"ids": ids, "logprobs": [step[t].logprob for step, t in zip(completion.logprobs, ids)],
                            "versions": versions})
        future = self.calls.pop(out.request_id, None)
        if future is not None:  # a call's
            if not future.cancelled():
                future.set_result(samples)
        else:
            self.finished.append({**group, "samples": samples})
            self.has_finished.set()
