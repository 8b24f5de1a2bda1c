"""The in-process vLLM engine, driven from an asyncio event loop.

vLLM's ``AsyncLLM`` always runs its engine core in another process, and hybridlab keeps the
rollout engine in the worker's own process so that weight syncs load tensors in place
(docs/engine.md). So rather than move to ``AsyncLLM`` and load weights through
``collective_rpc`` into a second process, agent rollouts drive the same engine's
``add_request``/``step`` from the worker's event loop: each model call adds a request and
awaits it; one pump task steps the engine while any request is unfinished and hands each
finished output to its caller. Between steps the loop runs the other trajectories' tools, so
a trajectory that waits on a tool never holds back the others, and the engine's continuous
batching decodes every trajectory that is ready together.
"""
from __future__ import annotations

import asyncio
import itertools
import uuid
from typing import Any, NamedTuple

from hybridlab.workers.rollout.vllm_engine import sampled_logprobs


class Sampled(NamedTuple):
    """One model call's answer: the sampled ids, their log-probs and, when the engine labels
    them, the policy version that sampled each (a streaming engine's; None: the rollout's)."""

    ids: list[int]
    logprobs: list[float]
    versions: list[int] | None = None


class AsyncEngine:
    """``await engine.generate(ids, params)`` on an in-process ``vllm.LLM``."""

    def __init__(self, llm: Any, lora_request: Any = None):
        self.engine, self.lora_request = llm.llm_engine, lora_request
        self.waiting: dict[str, asyncio.Future] = {}
        self.prefix = f"agent-{uuid.uuid4().hex[:8]}-"  # ids no other engine user (or earlier rollout) holds
        self.ids = itertools.count()
        self.pump: asyncio.Task | None = None

    async def generate(self, prompt_ids: list[int], params: Any) -> Sampled:
        """Return the sampled ids and their log-probs for one ``n=1`` request. A cancelled call
        aborts its request in the engine."""
        from vllm.inputs import TokensPrompt

        request_id = f"{self.prefix}{next(self.ids)}"
        self.engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt_ids), params,
                                lora_request=self.lora_request)
        future = asyncio.get_running_loop().create_future()
        self.waiting[request_id] = future
        if self.pump is None or self.pump.done():
            self.pump = asyncio.create_task(self._pump())
        try:
            out = await future
        except asyncio.CancelledError:
            if self.waiting.pop(request_id, None) is not None:
                self.engine.abort_request([request_id])
            raise
        return Sampled(*sampled_logprobs(out.outputs[0]))

    async def _pump(self) -> None:
        while self.waiting:
            try:
                outputs = self.engine.step()
            except Exception as exc:  # the engine failed: every waiting call fails with it
                waiting, self.waiting = self.waiting, {}
                for future in waiting.values():
                    if not future.done():
                        future.set_exception(exc)
                raise
            for out in outputs:
                future = self.waiting.pop(out.request_id, None) if out.finished else None
                if future is not None and not future.done():
                    future.set_result(out)
            await asyncio.sleep(0)  # let trajectories whose calls finished run their tools
