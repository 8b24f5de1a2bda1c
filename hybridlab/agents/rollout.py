"""Agent rollouts on a rollout worker: n trajectories per prompt, many in flight at once,
laid out for the trainer.

Three kinds of agent run over one mechanism (``tool_loop.ChatClient``):
- ``rollout.tools``: the built-in agent (``tool_loop.run_tool_agent``) calls the named tools;
  the reward stage scores its last turn (``final_response``);
- ``rollout.agent``: the user's ``async def run(client, sample)`` gets an OpenAI client bound to
  its trajectory's URL on the loopback endpoint (``endpoint``) and returns the reward;
- ``rollout.env``: a gym-style text environment (``env_loop``) answers each turn and rewards it.

All trajectories run as asyncio tasks on one event loop over the in-process engine
(``engine.AsyncEngine``); at most ``max_in_flight`` run at a time.
"""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import inspect
import math
from typing import Any, Callable

import torch

from hybridlab.agents.engine import AsyncEngine
from hybridlab.agents.env_loop import check_env_class, run_env
from hybridlab.agents.openenv_env import load_openenv
from hybridlab.agents.tool_loop import AgentLimits, ChatClient, drop_trailing_context, run_tool_agent
from hybridlab.agents.tools import Tool, load_tools
from hybridlab.agents.trajectory import MODEL, Trajectory, trajectories_batch
from hybridlab.errors import UserError
from hybridlab.protocol import Batch
from hybridlab.user_code import load_object

STAT_FIELDS = ("agent_turns", "agent_tool_calls", "agent_tool_errors", "agent_tool_timeouts", "agent_model_tokens",
               "agent_tool_tokens", "agent_retokenized")  # per-trajectory tensors the stage reads
SAMPLE_FIELDS = ("prompt", "ground_truth", "data_source", "extra_info")  # the row an agent function is given


@dataclasses.dataclass
class AgentSpec:
    """What drives the trajectories: the built-in agent's tools, a user's agent function, or a
    text environment's class (or an OpenEnv environment's ``OpenEnvConnector``)."""

    tools: dict[str, Tool] = dataclasses.field(default_factory=dict)
    agent: Callable | None = None
    env: Callable | None = None


def check_agent_function(fn: Any, setting: str = "rollout.agent") -> Callable:
    """Return ``fn`` if it can be called as ``await fn(client, sample)``; raises UserError."""
    if not inspect.iscoroutinefunction(fn):
        raise UserError(f"{setting}: {getattr(fn, '__name__', fn)!r} must be an async function:"
                        " async def run(client, sample) -> float | dict")
    try:
        inspect.signature(fn).bind("client", "sample")
    except TypeError:
        raise UserError(f"{setting}: {fn.__name__}{inspect.signature(fn)} cannot be called as"
                        " run(client, sample)") from None
    return fn


def agent_result(value: Any) -> tuple[float, dict]:
    """Return (reward, the other numeric fields) from what an agent function returned; raises
    ValueError for anything but a finite number or a dict with a numeric ``reward``."""
    info = {}
    if isinstance(value, dict):
        if "reward" not in value:
            raise ValueError(f"the agent returned a dict without 'reward' (keys: {', '.join(map(str, value))})")
        info = {k: float(v) for k, v in value.items() if k != "reward" and isinstance(v, (int, float))}
        value = value["reward"]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"the agent returned {value!r}; expected a finite number or a dict with 'reward'")
    return float(value), info


async def _agent_trajectory(spec: AgentSpec, endpoint: Any, i: int, sample: dict, timeout_s: float,
                            http: Any) -> Trajectory:
    import openai

    # one HTTP client shared by the rollout's agents: building one per trajectory costs ~20 ms (its TLS setup)
    client = openai.AsyncOpenAI(base_url=endpoint.base_url(i), api_key="hybridlab", max_retries=0, http_client=http)
    reward, info, error = None, {}, ""
    try:
        reward, info = agent_result(await asyncio.wait_for(spec.agent(client, sample), timeout_s or None))
    except asyncio.TimeoutError:
        error = f"the agent ran past rollout.agent_timeout_s={timeout_s:g} s"
    except Exception as exc:  # the agent's failure scores reward.error_score; the run goes on
        error = f"{type(exc).__name__}: {exc}"
    recorded = endpoint.clients.get(i)
    if recorded is None or recorded.trajectory is None:
        trajectory = Trajectory(list(sample["prompt_ids"]))
        error = error or "the agent made no model call"
    else:
        trajectory = recorded.trajectory
    trajectory.reward, trajectory.info, trajectory.error = reward, info, error
    return trajectory


class TrajectoryRunner:
    """Runs agent trajectories on the running event loop, at most ``max_in_flight`` at once:
    ``async with TrajectoryRunner(...) as runner: await runner.run(i, sample)``. The loopback
    endpoint that agent functions call (and the SDK's HTTP client) lives as long as the runner:
    one batch's rollout, or a streaming engine's whole life (``agents/stream.py``)."""

    def __init__(self, spec: AgentSpec, make_client: Callable[[int], ChatClient], limits: AgentLimits,
                 max_in_flight: int):
        self.spec, self.make_client, self.limits = spec, make_client, limits
        # an environment served with fewer sessions: the others wait here, before their time limit starts
        self.size = min(max_in_flight, getattr(spec.env, "sessions", None) or max_in_flight)
        self.endpoint: Any = None
        self.http: Any = None

    async def __aenter__(self) -> "TrajectoryRunner":
        from hybridlab.agents.endpoint import Endpoint, InProcessTransport  # aiohttp: imported where it serves

        self.slots = asyncio.Semaphore(self.size)
        self.endpoint = await Endpoint(self.make_client).__aenter__()
        if self.spec.agent is not None:
            import openai

            # the SDK's client, its calls to the endpoint answered in this process (InProcessTransport)
            self.http = openai.DefaultAsyncHttpxClient(mounts=InProcessTransport(self.endpoint).mounts())
        return self

    async def __aexit__(self, *exc) -> None:
        if self.http is not None:
            await self.http.aclose()
        await self.endpoint.__aexit__(*exc)

    async def run(self, i: int, sample: dict) -> Trajectory:
        """Return trajectory ``i`` (a number no other trajectory of this runner has) on its own
        copy of ``sample``; a failure is recorded in its ``error``, never raised."""
        spec, limits = self.spec, self.limits
        async with self.slots:
            sample = copy.deepcopy(sample)  # each trajectory may change its own
            try:
                if spec.agent is not None:
                    trajectory = await _agent_trajectory(spec, self.endpoint, i, sample, limits.agent_timeout_s,
                                                         self.http)
                elif spec.env is not None:
                    trajectory = await asyncio.wait_for(run_env(self.make_client(i), spec.env, sample, limits),
                                                        limits.agent_timeout_s or None)
                else:
                    trajectory = await run_tool_agent(self.make_client(i), sample["messages"], spec.tools, limits)
            except asyncio.TimeoutError:
                trajectory = Trajectory(list(sample["prompt_ids"]), error="the environment ran past"
                                        f" rollout.agent_timeout_s={limits.agent_timeout_s:g} s")
            except Exception as exc:  # a first prompt that cannot be rendered
                trajectory = Trajectory(list(sample["prompt_ids"]), error=f"{type(exc).__name__}: {exc}")
            self.endpoint.clients.pop(i, None)  # its record is the trajectory now
            drop_trailing_context(trajectory)
            trajectory.truncate(limits.budget)
            return trajectory


async def run_all(runner: TrajectoryRunner, samples: list[dict], n: int) -> list[Trajectory]:
    """Return ``n`` trajectories per sample (interleaved: a a b b), all run by ``runner``."""
    async with runner:
        return list(await asyncio.gather(*(runner.run(i, samples[i // n]) for i in range(len(samples) * n))))


def run_agents(llm: Any, samples: list[dict], n: int, make_runner: Callable[[AsyncEngine], TrajectoryRunner],
               lora_request: Any = None) -> list[Trajectory]:
    """Return ``n`` trajectories per sample (interleaved: a a b b) on the in-process engine
    ``llm``, run by ``make_runner(engine)``. A sample is a dict with ``messages`` (the first
    prompt), ``prompt_ids`` and the dataset row's ``SAMPLE_FIELDS``."""
    from hybridlab.workers.rollout.vllm_engine import empty_prefix_cache

    empty_prefix_cache(llm)  # earlier weights' KV must not be reused; within the rollout, turns share it
    return asyncio.run(run_all(make_runner(AsyncEngine(llm, lora_request)), samples, n))


def agent_batch(trajectories: list[Trajectory], pad_id: int, budget: int, prompt_len: int | None = None) -> Batch:
    """Return the trajectories in the trainer's layout (``trajectories_batch``) with their
    statistics (``STAT_FIELDS``), ``agent_reward`` and ``agent_error`` (an agent function's
    answer; NaN and 0 for the built-in agent), and the object fields ``final_response`` (what
    a rule reward scores), ``prompt_ids`` (as rendered with the tools), ``agent_tools`` (per
    tool: calls, errors, seconds), ``agent_error_msg`` and ``agent_info``."""
    out = trajectories_batch(trajectories, pad_id, budget, prompt_len)
    stats = {field: [] for field in STAT_FIELDS}
    for t in trajectories:
        by_source = t.tokens_by_source()
        model = by_source.get(MODEL, 0)
        for field, value in zip(STAT_FIELDS, (t.turns, t.tool_calls, t.tool_errors, t.tool_timeouts, model,
                                              sum(by_source.values()) - model, t.retokenized)):
            stats[field].append(float(value))
    out.tensors.update({k: torch.tensor(v) for k, v in stats.items()})
    out.tensors["agent_reward"] = torch.tensor([math.nan if t.reward is None else t.reward for t in trajectories])
    out.tensors["agent_error"] = torch.tensor([float(bool(t.error)) for t in trajectories])
    out.objects.update(final_response=[t.final_text for t in trajectories],
                       prompt_ids=[t.prompt_ids for t in trajectories],
                       agent_tools=[dict(t.tools_used) for t in trajectories],
                       agent_error_msg=[t.error for t in trajectories], agent_info=[t.info for t in trajectories])
    return out


@dataclasses.dataclass
class AgentSettings:
    """The ``rollout`` settings of an agent rollout, as the stage sends them to the workers
    (``agent_stages.agent_settings``; the defaults are the config's)."""

    tools: str | None
    agent: str | None
    env: str | None
    env_adapter: str | None
    max_turns: int
    max_trajectory_tokens: int
    tool_timeout_s: float
    agent_timeout_s: float
    max_in_flight: int
    version: int                         # the policy version (updates applied) generating this rollout
    chat_template: str | None            # data.chat_template: the conversation is rendered with it


def load_spec(settings: AgentSettings, serve: bool = True) -> AgentSpec:
    """Return the tools, agent function or environment that ``rollout.tools``, ``rollout.agent``
    or ``rollout.env`` names (an OpenEnv class is served in this process when ``serve``);
    raises UserError."""
    tools, agent, env = settings.tools, settings.agent, settings.env
    if agent:
        return AgentSpec(agent=check_agent_function(load_object(agent, "rollout.agent")))
    if env:
        connector = load_openenv(env, settings.env_adapter, settings.max_in_flight, settings.agent_timeout_s, serve)
        return AgentSpec(env=connector or check_env_class(load_object(env, "rollout.env", "class")))

    return AgentSpec(tools=load_tools(tools))


def agent_samples(batch: Batch) -> list[dict]:
    """Return each prompt of ``batch`` as an agent's sample (``agent_sample``)."""
    n = len(batch)
    rows = {k: batch.objects.get(k, [None] * n) for k in (*SAMPLE_FIELDS, "prompt_ids")}
    return [agent_sample({k: v[i] for k, v in rows.items()}) for i in range(n)]


def agent_sample(row: dict) -> dict:
    """Return a prompt's row as an agent's sample: the dataset row's fields, its ``messages``
    (a text prompt as one user message) and ``prompt_ids``."""
    sample = {k: row.get(k) for k in (*SAMPLE_FIELDS, "prompt_ids")}
    extra = sample["extra_info"] or {}
    sample["messages"] = list(extra.get("messages") or [{"role": "user", "content": sample["prompt"]}])
    return sample
