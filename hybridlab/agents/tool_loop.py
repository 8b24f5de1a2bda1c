"""The built-in agent: the model talks, calls tools in its template's format, reads their
answers, and talks again, until it answers without a tool call or a limit ends the run."""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from hybridlab.agents.conversation import Conversation
from hybridlab.agents.engine import AsyncEngine
from hybridlab.agents.tools import Tool, call_tool, parse_tool_calls
from hybridlab.agents.trajectory import MODEL, Trajectory


@dataclasses.dataclass
class AgentLimits:
    """How far one trajectory may go (the ``rollout`` settings of the same names)."""

    max_turns: int                # model turns (rollout.max_turns)
    max_tokens: int               # tokens per model turn (rollout.max_new_tokens)
    budget: int                   # tokens after the first prompt, every source (rollout.max_trajectory_tokens)
    tool_timeout_s: float         # a tool call running longer is cut off (0: no limit)
    context: int                  # the model's context: prompt and response together
    agent_timeout_s: float = 0.0  # an agent function running longer is cut off (0: no limit)


class ChatClient:
    """One trajectory's model: ``await client.complete(messages)`` samples the next turn from
    the in-process engine and records it (``Conversation``)."""

    def __init__(self, engine: AsyncEngine, tokenizer: Any, sampling: Any, limits: AgentLimits, version: int,
                 seed: int | None, tools: list[dict] | None = None):
        self.engine, self.sampling, self.limits, self.version, self.seed = engine, sampling, limits, version, seed
        self.conversation = Conversation(tokenizer, tools)
        self.lock = asyncio.Lock()  # one call at a time: each continues the record the last one left
        self.last_room = 0          # the token limit of the last call (its turn was cut off when it used it all)

    @property
    def trajectory(self) -> Trajectory:
        """The record so far."""
        return self.conversation.trajectory

    async def complete(self, messages: list[dict], source: str | None = None, limit: int | None = None) -> str | None:
        """Return the model's next turn's text, or None when no turn is left: the trajectory has
        made rollout.max_turns calls, or its token budget or the model's context has no room
        (``limit``: a caller's lower cap on this turn's tokens)."""
        async with self.lock:
            ids = self.conversation.prompt(messages, source)
            used = len(ids) - len(self.trajectory.prompt_ids)
            room = min(self.limits.max_tokens, self.limits.budget - used, self.limits.context - len(ids),
                       self.limits.max_tokens if limit is None else limit)
            if self.trajectory.turns >= self.limits.max_turns:
                room = 0
            self.last_room = max(room, 0)
            if room <= 0:
                return None
            seed = None if self.seed is None else hash((self.seed, self.trajectory.turns)) & 0x7FFFFFFF
            out = await self.engine.generate(ids, self.sampling(room, seed))
            return self.conversation.record_reply(out.ids, out.logprobs, self.version if out.versions is None
                                                  else out.versions)


async def run_tool_agent(client: ChatClient, messages: list[dict], tools: dict[str, Tool],
                         limits: AgentLimits) -> Trajectory:
    """Run the built-in agent on a prompt's messages; returns its trajectory, whose
    ``final_text`` is the last model turn (what the reward scores; ``error`` set when a turn
    could not be rendered)."""
    messages = list(messages)
    try:
        for turn in range(limits.max_turns):
            text = await client.complete(messages)
            if text is None:
                break
            messages.append({"role": "assistant", "content": text})
            client.trajectory.final_text = text
            calls = parse_tool_calls(text)
            if not calls or turn + 1 == limits.max_turns:
                break
            results = await asyncio.gather(*(call_tool(tools, c, limits.tool_timeout_s) for c in calls))
            for result in results:
                record_tool_use(client.trajectory, result)
                messages.append({"role": "tool", "name": result.name, "content": result.content})
    except Exception as exc:  # e.g. a template that cannot render a message: this trajectory ends, the run goes on
        if client.trajectory is None:
            raise
        client.trajectory.error = f"{type(exc).__name__}: {exc}"
    return client.trajectory


def record_tool_use(trajectory: Trajectory, result: Any) -> None:
    """Count one tool call (and its error or timeout) in the trajectory's statistics."""
    trajectory.tool_calls += 1
    trajectory.tool_errors += int(result.error)
    trajectory.tool_timeouts += int(result.timed_out)
    calls, errors, seconds = trajectory.tools_used.get(result.name, (0, 0, 0.0))
    trajectory.tools_used[result.name] = (calls + 1, errors + int(result.error), seconds + result.seconds)


def drop_trailing_context(trajectory: Trajectory) -> None:
    """Remove the context after the model's last turn (no model token follows it, so it
    trains nothing and costs compute)."""
    while trajectory.segments and trajectory.segments[-1].source != MODEL:
        trajectory.segments.pop()
