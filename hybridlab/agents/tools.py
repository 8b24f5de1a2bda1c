"""Tools: plain Python functions the model calls through its chat template's tool-call format.

A tool is a function with type hints and a Google-style docstring; its JSON schema (what the
chat template shows the model) comes from ``transformers.utils.get_json_schema``. The model
calls it in the Hermes format that Qwen's templates use::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12*34"}}
    </tool_call>

A call never stops the run: a tool that raises answers with its error text, one that runs past
``timeout_s`` is cut off and answers that it timed out, and a malformed call or an unknown tool
name gets an error message back, so the model can learn from it. What a tool returns is its
answer: a string as it is, anything else as JSON (``None`` answers ``null``).
"""
from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import re
import threading
import time
from typing import Any, Callable

from hybridlab.errors import UserError
from hybridlab.user_code import load_object

CALL_PATTERN = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclasses.dataclass
class Tool:
    """A callable tool and the schema the model is shown."""

    name: str
    fn: Callable[..., Any]
    schema: dict

    @classmethod
    def from_function(cls, fn: Callable[..., Any], setting: str = "rollout.tools") -> "Tool":
        """Return the tool for ``fn``; raises UserError naming ``setting`` when its signature
        or docstring cannot give a schema (every argument needs a type hint and a description)."""
        from transformers.utils import get_json_schema

        try:
            schema = get_json_schema(fn)
        except Exception as exc:  # transformers raises its own DocstringParsingException / TypeHintParsingException
            raise UserError(f"{setting}: cannot read a tool schema from {getattr(fn, '__name__', fn)!r}: {exc}"
                            " (a tool needs a type hint on every argument and a Google-style docstring"
                            " describing each one under 'Args:')") from None
        return cls(fn.__name__, fn, schema)


@dataclasses.dataclass
class ToolResult:
    """What one call answered, and how it went."""

    name: str
    content: str
    error: bool = False
    timed_out: bool = False
    seconds: float = 0.0


def load_tools(spec: str | list[str] | None) -> dict[str, Tool]:
    """Return the tools a ``rollout.tools`` value names (``module:function`` or
    ``file.py:function`` entries, comma-separated or a list; an entry may name a list of
    functions), keyed by name; raises UserError on a bad entry or a repeated name."""
    if not spec:
        return {}
    entries = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else list(spec)
    tools: dict[str, Tool] = {}
    for entry in entries:
        found = load_object(entry, "rollout.tools")
        for fn in found if isinstance(found, (list, tuple)) else [found]:
            if not callable(fn):
                raise UserError(f"rollout.tools: {entry} is a {type(fn).__name__}, not a function")
            tool = Tool.from_function(fn)
            if tool.name in tools:
                raise UserError(f"rollout.tools: two tools are named {tool.name!r}")
            tools[tool.name] = tool
    return tools


def parse_tool_calls(text: str) -> list[dict | str]:
    """Return the tool calls in a model turn, in order: ``{"name", "arguments"}`` for each
    well-formed one, or the error message for a malformed one."""
    calls: list[dict | str] = []
    for body in CALL_PATTERN.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as exc:
            calls.append(f"error: the tool call is not valid JSON ({exc.msg} at character {exc.pos})")
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            calls.append('error: a tool call must be a JSON object {"name": ..., "arguments": {...}}')
            continue
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some templates and models send the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            calls.append(f"error: the arguments of {call['name']!r} must be a JSON object")
            continue
        calls.append({"name": call["name"], "arguments": arguments})
    return calls


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)


def _in_daemon_thread(fn: Callable[[], Any]) -> asyncio.Future:
    """Return a future of ``fn()`` run in a daemon thread of its own: a hung tool is abandoned
    at its timeout and never holds up the worker's exit (a pool's threads are joined at exit)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(value)

    def run() -> None:
        try:
            value, error = fn(), None
        except BaseException as exc:  # handed to the caller
            value, error = None, exc
        try:
            loop.call_soon_threadsafe(settle, value, error)
        except RuntimeError:  # the rollout's loop has closed: nobody waits for this answer any more
            pass

    threading.Thread(target=run, daemon=True, name="hybridlab-tool").start()
    return future


async def call_tool(tools: dict[str, Tool], call: dict | str, timeout_s: float) -> ToolResult:
    """Run one parsed call (``parse_tool_calls``); returns its result, never raises.

    A plain function runs in a thread of its own, so a slow one does not hold up other
    trajectories; an ``async def`` tool runs on the event loop. Past ``timeout_s`` (0: no
    limit) the call is abandoned: its answer says so (a thread cannot be killed; it finishes
    in the background and its result is dropped).
    """
    if isinstance(call, str):
        return ToolResult("(malformed)", call, error=True)
    tool = tools.get(call["name"])
    if tool is None:
        return ToolResult(call["name"], f"error: no tool named {call['name']!r}; the tools are: "
                          f"{', '.join(tools) or '(none)'}", error=True)
    start = time.perf_counter()
    if inspect.iscoroutinefunction(tool.fn):
        work = asyncio.ensure_future(tool.fn(**call["arguments"]))
    else:
        work = _in_daemon_thread(lambda: tool.fn(**call["arguments"]))
    done, _ = await asyncio.wait([work], timeout=timeout_s or None)
    seconds = time.perf_counter() - start
    if not done:
        work.cancel()
        return ToolResult(tool.name, f"error: {tool.name} timed out after {timeout_s:g} s", error=True,
                          timed_out=True, seconds=seconds)
    if work.exception() is not None:  # a tool's failure is the model's information, not the run's end
        exc = work.exception()
        return ToolResult(tool.name, f"error: {type(exc).__name__}: {exc}", error=True, seconds=seconds)
    return ToolResult(tool.name, _as_text(work.result()), seconds=seconds)
