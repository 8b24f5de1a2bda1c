"""The Tinker SDK's futures, server side: every operation answers a request id at once, and the
SDK polls ``retrieve_future`` until the result is there.

A poll waits up to ``poll_s`` for the result (the SDK re-polls at once on a pending answer, and
gives up on one poll after 45 s), then answers 408 ``try_again``. A result stays retrievable:
the SDK may ask for it again. Failures answer 200 ``{"error", "category"}``, the SDK's shape.
"""
from __future__ import annotations

import asyncio
import collections
import json
from typing import Awaitable, Callable

from aiohttp import web

from hybridlab.errors import UserError

KEEP = 20_000  # finished results kept for re-polls (oldest dropped first)


class FutureStore:
    """Request ids -> results, in the server's event loop."""

    def __init__(self, poll_s: float):
        self.poll_s = poll_s
        self.pending: dict[str, asyncio.Future] = {}
        self.done: collections.OrderedDict[str, web.Response | tuple] = collections.OrderedDict()

    def create(self, request_id: str) -> str:
        """Register a pending operation; returns its id."""
        self.pending[request_id] = asyncio.get_running_loop().create_future()
        return request_id

    def _settle(self, request_id: str, outcome: tuple) -> None:
        self.done[request_id] = outcome
        while len(self.done) > KEEP:
            self.done.popitem(last=False)
        future = self.pending.pop(request_id, None)
        if future is not None and not future.done():
            future.set_result(None)

    def finish(self, request_id: str, payload: dict | bytes, proto: bool = False) -> None:
        """Record a result: a JSON object, or a protobuf body (``proto``)."""
        self._settle(request_id, ("proto", payload) if proto else ("json", payload))

    def fail(self, request_id: str, exc: BaseException) -> None:
        """Record a failure: ``user`` for a request that cannot be served, else ``server``."""
        category = "user" if isinstance(exc, UserError) else "server"
        message = str(exc) or type(exc).__name__
        self._settle(request_id, ("json", {"error": message, "category": category}))

    async def run(self, request_id: str, work: Awaitable) -> None:
        """Await ``work`` and record its result: a dict (JSON), or bytes (a protobuf body)."""
        try:
            result = await work
            self.finish(request_id, result, proto=isinstance(result, bytes))
        except Exception as exc:  # every failure reaches the client as the SDK's error shape
            self.fail(request_id, exc)

    async def retrieve(self, request_id: str) -> web.Response:
        """Return the response to a poll of ``request_id``: its result, or 408 try_again."""
        if request_id not in self.done:
            future = self.pending.get(request_id)
            if future is None:
                raise UserError(f"unknown request_id {request_id!r} (futures live as long as the server)")
            try:
                await asyncio.wait_for(asyncio.shield(future), self.poll_s)
            except asyncio.TimeoutError:
                return web.json_response({"type": "try_again", "request_id": request_id, "queue_state": "active"},
                                         status=408)
        kind, payload = self.done[request_id]
        if kind == "proto":
            return web.Response(body=payload, content_type="application/x-protobuf")
        return web.Response(text=json.dumps(payload), content_type="application/json")


class Sequencer:
    """One training client's operations, started strictly in ``seq_id`` order from 1 (the SDK
    sends forward_backward chunks 2..N before chunk 1)."""

    def __init__(self):
        self.next_seq = 1
        self.seen: dict[int, str] = {}     # seq_id -> request id: a retried seq_id gets the same answer
        self.waiting: dict[int, Callable[[], Awaitable]] = {}

    def add(self, seq_id: int | None, request_id: str, run: Callable[[], Awaitable]) -> None:
        """Start ``run`` now (``seq_id`` None) or once every earlier seq_id has started."""
        if seq_id is None:
            asyncio.ensure_future(run())
            return
        self.seen[seq_id] = request_id
        self.waiting[seq_id] = run
        while self.next_seq in self.waiting:
            asyncio.ensure_future(self.waiting.pop(self.next_seq)())
            self.next_seq += 1
