"""An OpenAI-compatible chat-completions endpoint on loopback, in front of the rollout engine.

An agent written against the OpenAI SDK runs unchanged: it is given an ``openai.AsyncOpenAI``
whose base URL names its trajectory (``http://127.0.0.1:PORT/trajectories/7/v1``), so each
call lands in that trajectory's ``ChatClient`` and is recorded token by token. Any model name
is accepted. Sampling follows the run's settings (``rollout.temperature``, ``top_p``,
``top_k``: the trainer's log-probs assume them; a request's ``temperature``, ``top_p``,
``seed`` and ``stop`` are ignored); a request's ``max_tokens`` or ``max_completion_tokens`` can
only lower the per-turn limit; ``n`` must be 1 and ``stream`` is refused. The server is aiohttp
on the event loop the worker runs for each rollout, beside the engine's pump (vLLM's own
OpenAI server needs ``AsyncLLM``, whose engine runs in another process). A turn that is not
prefix-stable for the agent's messages (an assistant message sent back as ``tool_calls``
without the model's text, under a template that renders them otherwise) is handled as
``conversation`` describes.
"""
from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Callable

from aiohttp import web

try:
    import httpx2 as httpx  # the OpenAI SDK's HTTP client (httpx before it)
except ImportError:
    import httpx

from hybridlab.agents.tool_loop import ChatClient
from hybridlab.agents.tools import CALL_PATTERN, parse_tool_calls


ROUTE = re.compile(r"/trajectories/(?P<trajectory>[^/]+)/v1/chat/completions")


def _error_body(message: str) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error"}}


def _text(content) -> str:
    """Return a message's content as text (OpenAI's list of content parts joined)."""
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def message_problem(messages) -> str | None:
    """Return what is wrong with a request's ``messages``, or None."""
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty list of chat messages"
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return f"messages[{i}] must be an object with a string 'role'"
    return None


def request_problem(body) -> str | None:
    """Return what is wrong with a chat-completions request body, or None."""
    if not isinstance(body, dict):
        return "the request body must be a JSON object"
    problem = message_problem(body.get("messages"))
    if problem:
        return problem
    if body.get("n", 1) != 1:
        return "n must be 1: each call continues one trajectory (start more trajectories instead)"
    if body.get("stream"):
        return "stream is not supported: call without streaming"
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            return f"{key} must be a positive integer, got {value!r}"
    return None


def reply_json(text: str | None, prompt_ids: list[int], token_ids: list[int], call_index: int,
               cut: bool = False) -> dict:
    """Return the chat.completion object for a model turn's ``text`` (None: no turn was left;
    ``cut``: the turn stopped at its token limit, finish_reason "length"),
    with the ids the engine continued and sampled under vLLM's names (``prompt_token_ids``, and
    ``token_ids`` on the choice, as vLLM's server returns them with ``return_token_ids``)."""
    calls = [c for c in parse_tool_calls(text or "") if isinstance(c, dict)]
    message: dict = {"role": "assistant", "content": text or ""}
    if calls:  # as vLLM's Hermes parser answers: the text before the first call, then the calls
        message["content"] = text[:CALL_PATTERN.search(text).start()].strip() or None
        message["tool_calls"] = [{"id": f"call_{call_index}_{k}", "type": "function",
                                  "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
                                 for k, c in enumerate(calls)]
    finish = "length" if text is None or cut else ("tool_calls" if calls else "stop")
    return {"id": f"chatcmpl-{call_index}", "object": "chat.completion", "created": int(time.time()),
            "model": "hybridlab-rollout", "choices": [{"index": 0, "message": message, "finish_reason": finish,
                                                        "logprobs": None, "token_ids": token_ids}],
            "prompt_token_ids": prompt_ids,
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(token_ids),
                      "total_tokens": len(prompt_ids) + len(token_ids)}}


class Endpoint:
    """``async with Endpoint(make_client) as endpoint``: serve until the block ends;
    ``endpoint.clients[i]`` is trajectory i's record."""

    def __init__(self, make_client: Callable[[int], ChatClient]):
        self.make_client = make_client
        self.clients: dict[int, ChatClient] = {}
        self.port = 0

    def base_url(self, trajectory: int) -> str:
        """Return the OpenAI base URL of trajectory ``trajectory``."""
        return f"http://127.0.0.1:{self.port}/trajectories/{trajectory}/v1"

    async def __aenter__(self) -> "Endpoint":
        app = web.Application()
        app.router.add_post("/trajectories/{trajectory}/v1/chat/completions", self.chat)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        await self.runner.cleanup()

    async def chat(self, request: web.Request) -> web.Response:
        """Return the HTTP response to POST /trajectories/{i}/v1/chat/completions."""
        status, answer = await self.answer(request.match_info["trajectory"], await request.read())
        return web.json_response(answer, status=status)

    async def answer(self, trajectory: str, body: bytes) -> tuple[int, dict]:
        """Return (HTTP status, JSON answer) of a chat-completions request ``body`` for trajectory
        number ``trajectory`` (as the URL spells it)."""
        try:
            number, payload = int(trajectory), json.loads(body)
        except ValueError:
            return 400, _error_body("the request body must be JSON, and the URL must name a trajectory number")
        problem = request_problem(payload)
        if problem:
            return 400, _error_body(problem)
        try:
            return 200, await self._complete(number, payload)
        except Exception as exc:  # the agent sees what failed, not a bare 500
            return 500, _error_body(f"the rollout could not answer: {type(exc).__name__}: {exc}")

    async def _complete(self, trajectory: int, body: dict) -> dict:
        messages = [{**m, "content": _text(m.get("content"))} for m in body["messages"]]
        client = self.clients.get(trajectory) or self.clients.setdefault(trajectory, self.make_client(trajectory))
        if client.trajectory is None and body.get("tools"):
            client.conversation.tools = list(body["tools"])
        cap = body.get("max_completion_tokens") or body.get("max_tokens")
        turns_before = client.trajectory.turns if client.trajectory else 0
        text = await client.complete(messages, limit=cap)
        ids = client.trajectory.all_ids()
        turn = client.trajectory.segments[-1].ids if client.trajectory.turns > turns_before else []
        cut = bool(turn) and len(turn) >= client.last_room
        return reply_json(text, ids[:len(ids) - len(turn)], turn, client.trajectory.turns, cut)


class InProcessTransport(httpx.AsyncBaseTransport):
    """The HTTP transport of the clients handed to agent functions, mounted on the endpoint's own
    address (``mounts``): a request there is answered by ``Endpoint.answer`` in this process,
    without the socket, the HTTP encoding and the server between them. Other addresses keep the
    client's own transport (its connection limits, the environment's proxies).

    Over loopback HTTP a call needs several turns of the event loop before its request reaches
    the engine, and the engine's pump steps the running requests once per turn, so the returning
    trajectories missed several steps each call (``bench agent``: 4.7 ms per call, 74% over the
    raw engine). Answered in-process, the call reaches the engine in the same turn."""

    def __init__(self, endpoint: Endpoint):
        self.endpoint = endpoint

    def mounts(self) -> dict[str, "InProcessTransport"]:
        """Return the ``mounts`` argument of an httpx client that sends the endpoint's calls here."""
        return {f"http://127.0.0.1:{self.endpoint.port}": self}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Return the endpoint's answer to ``request``: the server's JSON answer, a 404 naming a
        path it does not serve, or ``httpx.ReadTimeout`` past the call's read timeout (the
        request is then aborted in the engine)."""
        route = ROUTE.fullmatch(request.url.path)
        if route is None or request.method != "POST":
            return httpx.Response(404, json=_error_body(f"no such endpoint: {request.method} {request.url.path}"))
        read_timeout = (request.extensions.get("timeout") or {}).get("read")
        try:
            status, answer = await _within(self.endpoint.answer(route["trajectory"], await request.aread()),
                                           read_timeout)
        except asyncio.TimeoutError:
            raise httpx.ReadTimeout(f"no answer within the call's timeout of {read_timeout:g} s",
                                    request=request) from None
        return httpx.Response(status, json=answer)


async def _within(awaitable, seconds: float | None):
    """Return what ``awaitable`` returns; raises asyncio.TimeoutError past ``seconds`` (None: no limit)."""
    if seconds is None:
        return await awaitable
    if hasattr(asyncio, "timeout"):  # Python 3.11: in this task, so the call still reaches the engine this turn
        async with asyncio.timeout(seconds):
            return await awaitable
    return await asyncio.wait_for(awaitable, seconds)  # Python 3.10: a task of its own (one turn later)
