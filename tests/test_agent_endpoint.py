"""The agents' OpenAI-compatible endpoint as an agent's client reaches it: answered in-process
(``InProcessTransport``) for the client the rollout hands out, over loopback HTTP for anything
else, with the same answers either way. No engine is needed: the requests here are refused
before a model call, or answered by a second endpoint over the network."""
from __future__ import annotations

import asyncio
import json
import urllib.request

import openai
import pytest

from hybridlab.agents.endpoint import Endpoint, InProcessTransport


def _never(i: int):
    raise AssertionError(f"a refused request must not start trajectory {i}")


def _post(url: str, body: dict) -> tuple[int, dict]:
    """POST ``body`` over plain HTTP (urllib in a thread: the endpoint's loop keeps serving)."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_the_handed_out_client_is_answered_in_process_as_the_server_answers_over_http():
    async def main() -> None:
        async with Endpoint(_never) as endpoint, Endpoint(_never) as other:
            http = openai.DefaultAsyncHttpxClient(transport=InProcessTransport(endpoint))
            client = openai.AsyncOpenAI(base_url=endpoint.base_url(3), api_key="x", max_retries=0, http_client=http)
            messages = [{"role": "user", "content": "hi"}]
            # over loopback HTTP, as an agent's own client reaches the endpoint
            status, body = await asyncio.to_thread(_post, f"{endpoint.base_url(3)}/chat/completions",
                                                   {"model": "any", "messages": messages, "n": 2})
            assert status == 400 and body["error"]["message"].startswith("n must be 1: each call continues")
            # another address goes out over the network: the second endpoint's server answers
            elsewhere = openai.AsyncOpenAI(base_url=other.base_url(0), api_key="x", max_retries=0, http_client=http)
            with pytest.raises(openai.BadRequestError, match="max_tokens must be a positive integer, got 0"):
                await elsewhere.chat.completions.create(model="any", messages=messages, max_tokens=0)
            # with the endpoint's server stopped, the handed-out client is still answered: in this process
            await endpoint.runner.cleanup()  # (cleaned up again on leaving: a no-op)
            with pytest.raises(urllib.error.URLError):
                await asyncio.to_thread(_post, f"{endpoint.base_url(3)}/chat/completions", {"messages": messages})
            with pytest.raises(openai.BadRequestError, match="n must be 1: each call continues one trajectory"):
                await client.chat.completions.create(model="any", messages=messages, n=2)
            with pytest.raises(openai.BadRequestError, match="stream is not supported"):
                await client.chat.completions.create(model="any", messages=messages, stream=True)
            with pytest.raises(openai.NotFoundError, match="no such endpoint: POST /trajectories/3/v1/completions"):
                await client.completions.create(model="any", prompt="hi")
            await http.aclose()

    asyncio.run(main())
