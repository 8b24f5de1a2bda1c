"""OpenEnv environments the agent tests name in their configs (``tests/openenv_envs.py:NAME``),
written against openenv-core's own types, and a server that drops its connections."""
from __future__ import annotations

import asyncio
import json
import threading
from typing import Any, Optional

from openenv.core.env_server import Action, Environment, Observation, State


class Answer(Action):
    message: str


class Question(Observation):
    text: str


class TwoTries(Environment[Answer, Question, State]):
    """Asks the row's question; the first answer earns nothing (the observation has no reward)
    and is asked again; the second ends the episode and earns 0.5, or 1 when it is right."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State()

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, question: str = "",
              answer: str = "", **kwargs: Any) -> Question:
        self.answer, self._state = answer, State(episode_id=episode_id, step_count=0)
        return Question(text=question)

    def step(self, action: Answer, timeout_s: Optional[float] = None, **kwargs: Any) -> Question:
        self._state.step_count += 1
        if self._state.step_count == 1:
            return Question(text="Are you sure? Answer again.")
        return Question(text="", done=True, reward=1.0 if action.message.strip() == self.answer else 0.5)

    @property
    def state(self) -> State:
        return self._state


class OneSession(TwoTries):
    """TwoTries that declares no concurrent sessions (OpenEnv's default): its server takes one
    episode at a time."""

    SUPPORTS_CONCURRENT_SESSIONS = False


class HangsOnOdd(TwoTries):
    """TwoTries whose step never answers where the right answer is odd."""

    async def step_async(self, action: Answer, timeout_s: Optional[float] = None, **kwargs: Any) -> Question:
        if int(self.answer) % 2:
            await asyncio.sleep(3600)
        return self.step(action)


class DroppingServer:
    """A WebSocket server that speaks OpenEnv's protocol for ``reset`` and drops the connection
    (no close frame) on the first ``step``; serves ``/schema`` for ``Answer``. Runs in a thread
    on 127.0.0.1; ``url`` is its address."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self._serve(),), daemon=True)
        self.thread.start()
        self.ready.wait(10)

    async def _serve(self) -> None:
        from websockets.asyncio.server import serve

        async with serve(self._session, "127.0.0.1", 0, process_request=self._http) as server:
            self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
            self.stop = asyncio.Event()
            self.ready.set()
            await self.stop.wait()

    def _http(self, connection, request):
        if request.path == "/schema":
            return connection.respond(200, json.dumps({"action": Answer.model_json_schema()}))
        return None

    async def _session(self, ws) -> None:
        async for raw in ws:
            if json.loads(raw)["type"] != "reset":
                ws.transport.abort()
                return
            await ws.send(json.dumps({"type": "observation", "data": {
                "observation": {"text": "Say anything."}, "reward": None, "done": False}}))

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(10)
