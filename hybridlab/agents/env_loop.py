"""Gym-style text environments (as SkyRL's): the model acts in text, the environment answers
with an observation, a reward and whether the episode is over.

``rollout.env=module:Class`` names a class built with no arguments, once per trajectory::

    class Guess:
        def reset(self, sample: dict) -> str:           # the first observation (the prompt)
        def step(self, text: str) -> tuple[str, float, bool]:   # observation, reward, done

Either method may be ``async``; a ``close()`` method, if any, is called when the episode ends.
Observations after the first come to the model as user messages (tokens tagged ``env``, context
only); the trajectory's reward is the sum of the step rewards. An environment that raises ends
its trajectory, which scores ``reward.error_score``. ``rollout.env`` may also name an OpenEnv
environment (``openenv_env``), driven by the same loop.
"""
from __future__ import annotations

import inspect
from typing import Any

from hybridlab.agents.tool_loop import AgentLimits, ChatClient
from hybridlab.agents.trajectory import ENV, Trajectory
from hybridlab.errors import UserError


def check_env_class(cls: Any, setting: str = "rollout.env") -> type:
    """Return ``cls`` if it is a class with ``reset`` and ``step``; raises UserError."""
    if not inspect.isclass(cls):
        raise UserError(f"{setting}: {getattr(cls, '__name__', cls)!r} must be a class with reset(sample) and"
                        " step(text)")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise UserError(f"{setting}: {cls.__name__} has no {' or '.join(missing)} method (a text environment has"
                        " reset(sample) -> str and step(text) -> (observation, reward, done))")
    return cls


async def _call(fn: Any, *args: Any) -> Any:
    result = fn(*args)
    return await result if inspect.isawaitable(result) else result


async def run_env(client: ChatClient, env_class: type, sample: dict, limits: AgentLimits) -> Trajectory:
    """Run one episode of ``env_class`` on ``sample``; returns its trajectory with the summed
    reward (``error`` set when the environment raised or answered out of shape)."""
    total, env = 0.0, None
    try:
        env = env_class()
        messages = [{"role": "user", "content": str(await _call(env.reset, sample))}]
        for _ in range(limits.max_turns):
            text = await client.complete(messages, source=ENV)
            if text is None:
                break
            client.trajectory.final_text = text
            answer = await _call(env.step, text)
            if not (isinstance(answer, tuple) and len(answer) == 3):
                raise TypeError(f"{env_class.__name__}.step returned {answer!r}; expected (observation, reward, done)")
            observation, reward, done = answer
            total += float(reward)
            if done:
                break
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": str(observation)}]
        trajectory = client.trajectory
        trajectory.reward = total
    except Exception as exc:  # the environment's failure scores reward.error_score; the run goes on
        trajectory = client.trajectory or Trajectory(list(sample["prompt_ids"]))
        trajectory.error = f"{type(exc).__name__}: {exc}"
    finally:
        if callable(getattr(env, "close", None)):  # an OpenEnv session's connection, a user's resources
            try:
                await _call(env.close)
            except Exception:  # closing is best effort: the episode's result stands
                pass
    return trajectory
