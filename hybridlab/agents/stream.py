"""Agent trajectories generated continuously (``trainer.streaming`` with ``rollout.tools``,
``rollout.agent`` or ``rollout.env``).

An asyncio event loop in a thread of the rollout process runs the trajectories
(``rollout.TrajectoryRunner``, the same code as a batch's agent rollout). Their model calls go to
the process's ``EngineStream``, whose own thread steps the engine: a weight sync pauses the engine
between two of its steps while tools and environments keep running, and a turn sampled across
the sync records the version that sampled each of its tokens (vLLM's weight-version spans). A
prompt's n trajectories come back together, as a group, once all of them have ended.
"""
from __future__ import annotations

import asyncio
import itertools
import threading
from concurrent.futures import Future
from typing import Any, Callable

from hybridlab.agents.engine import Sampled
from hybridlab.agents.rollout import TrajectoryRunner
from hybridlab.workers.rollout.stream import EngineStream


class StreamEngine:
    """``await engine.generate(ids, params)`` through an EngineStream: the agents' engine
    while streaming. A cancelled call aborts its request."""

    def __init__(self, stream: EngineStream, lora_request: Any = None):
        self.stream, self.lora_request = stream, lora_request

    async def generate(self, prompt_ids: list[int], params: Any) -> Sampled:
        """Return the sampled ids, their log-probs and the version that sampled each."""
        request, future = self.stream.call(prompt_ids, params, self.lora_request)
        try:
            (sample,) = await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self.stream.abort(request)
            raise
        return Sampled(sample["ids"], sample["logprobs"], sample["versions"])


class AgentStream:
    """Runs each submitted prompt's n trajectories as soon as it arrives; ``take`` hands over
    the prompts whose trajectories have all ended (see the module docstring)."""

    def __init__(self, stream: EngineStream, make_runner: Callable[[StreamEngine], TrajectoryRunner],
                 lora_request: Any = None):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="agent-stream", daemon=True)
        self.thread.start()
        self.runner = make_runner(StreamEngine(stream, lora_request))
        try:
            self._run(self.runner.__aenter__()).result(timeout=60)
        except BaseException:  # the endpoint did not start: the loop's thread must not outlive this
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=30)
            raise
        self.numbers = itertools.count()       # trajectory numbers: unique over the stream's life
        self.lock = threading.Lock()
        self.finished: list[dict] = []         # groups whose n trajectories ended, oldest first
        self.pending: set[Future] = set()      # groups still running
        self.error: BaseException | None = None
        self.has_finished = threading.Event()

    def submit(self, prompts: list[tuple[int, dict]], n: int) -> None:
        """Start ``n`` trajectories for each ``(key, sample)``."""
        for key, sample in prompts:
            future = self._run(self._group(key, sample, n))
            with self.lock:
                self.pending.add(future)
            future.add_done_callback(self._done)

    def take(self, wait_s: float = 0.0) -> list[dict]:
        """Return the finished groups (``key``, ``prompt_ids``, ``trajectories``), oldest first,
        after waiting up to ``wait_s`` for one when none has finished; raises what a group raised."""
        if wait_s > 0 and not self.finished and self.pending:
            self.has_finished.wait(wait_s)
        with self.lock:
            self.has_finished.clear()
            if self.error is not None:
                raise RuntimeError(f"an agent trajectory group failed: {self.error!r}") from self.error
            done, self.finished = self.finished, []
            return done

    def in_flight(self) -> int:
        """Return how many groups are still running."""
        with self.lock:
            return len(self.pending)

    def close(self) -> None:
        """Cancel the groups still running, close the endpoint and stop the loop's thread."""
        with self.lock:
            pending, self.pending = list(self.pending), set()
        for future in pending:
            future.cancel()
        try:
            self._run(self.runner.__aexit__(None, None, None)).result(timeout=30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=30)

    def _run(self, coroutine) -> Future:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    async def _group(self, key: int, sample: dict, n: int) -> dict:
        numbers = [next(self.numbers) for _ in range(n)]
        trajectories = await asyncio.gather(*(self.runner.run(i, sample) for i in numbers))
        return {"key": key, "prompt_ids": list(sample["prompt_ids"]), "trajectories": list(trajectories)}

    def _done(self, future: Future) -> None:
        with self.lock:
            if future not in self.pending:  # cancelled by close
                return
            self.pending.discard(future)
            if future.exception() is not None:
                self.error = future.exception()
            else:
                self.finished.append(future.result())
        self.has_finished.set()
