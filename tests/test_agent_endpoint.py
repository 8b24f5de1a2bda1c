"""The agents' OpenAI-compatible endpoint as an agent's client reaches it: answered in-process
(``InProcessTransport``, mounted on the endpoint's address) for the client the rollout hands
out, over loopback HTTP for anything else. The requests here are refused or time out before a
model call, so no engine is started: the chat clients get none."""
from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import openai
import pytest

from hybridlab.agents.endpoint import Endpoint, InProcessTransport
from hybridlab.agents.tool_loop import AgentLimits, ChatClient


def _post(url: str, body: dict) -> tuple[int, dict]:
    """POST ``body`` over plain HTTP (urllib in a thread: the endpoint's loop keeps serving)."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_the_handed_out_client_is_answered_in_process_and_other_addresses_over_http(tiny_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    limits = AgentLimits(max_turns=4, max_tokens=8, budget=64, tool_timeout_s=0.0, context=256)

    def chat_client(i: int) -> ChatClient:  # no engine: nothing here reaches a model call
        return ChatClient(None, tokenizer, lambda tokens, seed: None, limits, 0, None)

    async def main() -> None:
        async with Endpoint(chat_client) as endpoint, Endpoint(chat_client) as other:
            http = openai.DefaultAsyncHttpxClient(mounts=InProcessTransport(endpoint).mounts())
            client = openai.AsyncOpenAI(base_url=endpoint.base_url(3), api_key="x", max_retries=0, http_client=http)
            messages = [{"role": "user", "content": "hi"}]
            # over loopback HTTP, as a client an agent builds itself reaches the endpoint
            status, body = await asyncio.to_thread(_post, f"{endpoint.base_url(3)}/chat/completions",
                                                   {"model": "any", "messages": messages, "n": 2})
            assert status == 400 and body["error"]["message"].startswith("n must be 1: each call continues")
            # another address keeps the client's own transport: the second endpoint's server answers
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
            # a call's own timeout holds in-process too: this trajectory's earlier call still holds it
            busy = endpoint.clients.setdefault(3, chat_client(3))
            await busy.lock.acquire()
            with pytest.raises(openai.APITimeoutError):  # (a call that ignored it would end at 30 s, otherwise)
                await asyncio.wait_for(client.chat.completions.create(model="any", messages=messages, timeout=0.3), 30)
            busy.lock.release()
            await http.aclose()

    asyncio.run(main())
