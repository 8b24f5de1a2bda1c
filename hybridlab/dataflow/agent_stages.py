"""The stages of an agentic step: multi-turn trajectories with tools or a user's agent
(``hybridlab.agents``), and the agent's own reward.

``generate_agent`` replaces ``generate`` in the default dataflow when ``rollout.tools`` or
``rollout.agent`` or ``rollout.env`` is set; with tools the ``reward`` stage scores each
trajectory's last model turn, with an agent function or an environment ``agent_reward`` takes
the reward the trajectory earned.
"""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import torch

from hybridlab.agents.rollout import AgentSettings, STAT_FIELDS, load_spec
from hybridlab.batching import on_last_token
from hybridlab.dataflow.fields import SEQUENCE_FIELDS
from hybridlab.dataflow.generation_stages import ahead_metrics, finish_reward, generation_metrics
from hybridlab.errors import UserError
from hybridlab.protocol import Batch
from hybridlab.sandbox import Sandbox, SandboxUnavailable
from hybridlab.tasks import TASKS

if TYPE_CHECKING:
    from hybridlab.dataflow.context import StepContext

AGENT_OUTPUTS = ("prompts", *SEQUENCE_FIELDS, "rollout_log_probs", "rollout_versions", "token_sources",
                 "final_response", "agent_reward", "agent_error", *STAT_FIELDS)


def agentic(cfg) -> bool:
    """True when the run's rollouts are agent trajectories (``rollout.tools``, ``rollout.agent``
    or ``rollout.env``)."""
    return bool(cfg.rollout.tools or cfg.rollout.agent or cfg.rollout.env)


def own_reward(cfg) -> bool:
    """True when the trajectories carry their reward (an agent function's or an environment's)."""
    return bool(cfg.rollout.agent or cfg.rollout.env)


def rollout_stages(cfg) -> list[str]:
    """Return the stages that make a step's scored samples: generate (or an agent rollout), then reward."""
    if agentic(cfg):
        return ["generate_agent", "agent_reward" if own_reward(cfg) else "reward"]
    return ["generate", "reward_model" if cfg.reward.kind == "model" else "reward"]


def agent_settings(cfg, version: int) -> dict:
    """Return the settings ``RolloutWorker.generate_agent`` takes, for policy ``version``."""
    r = cfg.rollout
    return dataclasses.asdict(AgentSettings(r.tools, r.agent, r.env, r.env_adapter, r.max_turns, r.max_trajectory_tokens,
                                            r.tool_timeout_s, r.agent_timeout_s, r.max_in_flight, version,
                                            cfg.data.chat_template))


def agent_metrics(out: Batch) -> dict:
    """Return the ``agent/*`` metrics of a rollout of trajectories: means and totals per step,
    the share of trajectories that called a tool, and calls, errors and latency per tool."""
    total = {f: float(out[f].sum()) for f in STAT_FIELDS}
    n = max(1, len(out))
    metrics = {"agent/turns_mean": total["agent_turns"] / n, "agent/turns_max": float(out["agent_turns"].max()),
               "agent/tool_calls": total["agent_tool_calls"],
               "agent/tool_errors": total["agent_tool_errors"], "agent/tool_timeouts": total["agent_tool_timeouts"],
               "agent/model_tokens": total["agent_model_tokens"], "agent/tool_tokens": total["agent_tool_tokens"],
               "agent/retokenized_share": total["agent_retokenized"] / max(1.0, total["agent_turns"]),
               "agent/tool_call_share": float((out["agent_tool_calls"] > 0).float().mean()),
               "agent/errors": float(out["agent_error"].sum())}
    per_tool: dict[str, list[float]] = {}
    for used in out["agent_tools"]:
        for name, (calls, errors, seconds) in used.items():
            acc = per_tool.setdefault(name, [0.0, 0.0, 0.0])
            acc[0], acc[1], acc[2] = acc[0] + calls, acc[1] + errors, acc[2] + seconds
    for name, (calls, errors, seconds) in sorted(per_tool.items()):
        metrics.update({f"agent/tool/{name}/calls": calls, f"agent/tool/{name}/errors": errors,
                        f"agent/tool/{name}/latency_s": seconds / max(1.0, calls)})
    return metrics


def generate_agent(ctx: "StepContext", batch: Batch) -> tuple[Batch, dict]:
    """Run rollout.n agent trajectories per prompt (tools, an agent function or an environment),
    many at once; the model's tokens are trained, tool and template tokens are context."""
    rollout = ctx.group("rollout")
    # Every model turn records the policy version the engines hold when the rollout starts: the
    # rollout worker runs it, ahead or not, before any later sync reaches it.
    # Streaming, each token records the version that sampled it (the engine labels its steps).
    settings = agent_settings(ctx.cfg, ctx.state.rollout_version)
    if ctx.cfg.trainer.streaming and not ctx.rerunning:  # the first groups to finish (dataflow/stream.py)
        out, pipeline = ctx.state.stream.take(ctx, batch)
    elif ctx.cfg.trainer.off_policy and not ctx.rerunning:
        out, staleness = ctx.state.ahead.take(
            ctx, batch, lambda prompts, sampling: rollout.generate_agent.submit(prompts, sampling, settings))
        pipeline = ahead_metrics(ctx, staleness)
    else:
        out, pipeline = rollout.generate_agent(batch, ctx.sampling(), settings), ahead_metrics(ctx, 0)
    metrics = generation_metrics(ctx.cfg, out)  # response_length/*: the model's tokens per trajectory
    lengths = out["attention_mask"][:, -out["response_mask"].shape[1]:].sum(-1)
    metrics["response_length/clip_ratio"] = float((lengths >= ctx.cfg.rollout.max_trajectory_tokens).float().mean())
    return out, {**metrics, **agent_metrics(out), **pipeline}


def own_scores(batch: Batch, error_score: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (score, accuracy) per trajectory of an agent function or environment: its reward
    (``error_score`` where it failed) and the ``acc`` it returned (NaN where it returned none)."""
    errors = batch["agent_error"].bool()
    scores = torch.where(errors, torch.full_like(batch["agent_reward"], error_score), batch["agent_reward"])
    infos = batch.objects.get("agent_info") or [{} for _ in range(len(batch))]
    return scores, torch.tensor([info.get("acc", math.nan) for info in infos], dtype=torch.float32)


def agent_reward(ctx: "StepContext", batch: Batch) -> tuple[Batch, dict]:
    """Take the reward each agent function or environment returned (one that raised scores
    reward.error_score)."""
    errors = batch["agent_error"].bool()
    scores, acc = own_scores(batch, ctx.cfg.reward.error_score)
    infos = batch.objects.get("agent_info") or [{} for _ in range(len(batch))]
    if errors.any() and not ctx.state.reward_error_sources & {"agent"}:  # warned once per run; counted every step
        ctx.state.reward_error_sources.add("agent")
        first = next(m for m, e in zip(batch["agent_error_msg"], errors.tolist()) if e)
        ctx.warn(f"the agent {'environment' if ctx.cfg.rollout.env else 'function'} failed on"
                 f" {int(errors.sum())} of {len(batch)} trajectories (scored"
                 f" reward.error_score={ctx.cfg.reward.error_score}; counted in agent/errors, warned once);"
                 f" first: {first}")
    out = Batch({"token_level_scores": on_last_token(scores, batch["response_mask"]), "acc": acc},
                {"reward_extra_info": [{k: v for k, v in info.items() if k != "acc"} for info in infos]})
    return finish_reward(ctx, batch, out)


def agent_problems(cfg, rollout_tp: int) -> list[str]:
    """Return what stops the config's agent rollouts from running, each naming its key: a
    tool-use task without its tools, more than one of tools, agent and env, a tool, agent or
    environment that cannot be loaded, impossible limits, a rollout that is not vLLM at tp 1."""
    r, p = cfg.rollout, []

    task_tools = getattr(TASKS.get(cfg.data.task), "tools", ()) if not cfg.data.train_files else ()
    if task_tools and not agentic(cfg):
        p.append(f"data.task: {cfg.data.task!r} is a tool-use task; set rollout.tools={','.join(task_tools)} and"
                 f" data.chat=true (the agent_calc preset does)")
    if task_tools and not cfg.data.chat:
        p.append(f"data.chat: {cfg.data.task!r} is a tool-use conversation; set data.chat=true")
    if r.env_adapter and not r.env:
        p.append("rollout.env_adapter: adapts an OpenEnv environment; set rollout.env to one (or unset the adapter)")
    if not agentic(cfg):
        return p
    if sum(map(bool, (r.tools, r.agent, r.env))) > 1:
        p.append("rollout.tools, rollout.agent and rollout.env: set one (the built-in agent with tools, your own"
                 " agent, or a text environment)")
    else:
        try:
            spec = load_spec(AgentSettings(**agent_settings(cfg, 0)), serve=False)
            if any(getattr(tool.fn, "needs_sandbox", False) for tool in (spec.tools or {}).values()):
                Sandbox(cfg.sandbox)  # the python tool: named here where code cannot be isolated
        except UserError as exc:
            p.append(f"rollout.tools: {exc}" if isinstance(exc, SandboxUnavailable) else str(exc))
    for key, low in (("max_turns", 1), ("max_in_flight", 1), ("max_trajectory_tokens", r.max_new_tokens)):
        if getattr(r, key) < low:
            p.append(f"rollout.{key}: must be at least {low}, got {getattr(r, key)}"
                     + (" (rollout.max_new_tokens: one model turn must fit)" if key == "max_trajectory_tokens" else ""))
    for key in ("tool_timeout_s", "agent_timeout_s"):
        if getattr(r, key) < 0:
            p.append(f"rollout.{key}: must be >= 0 (0: no limit), got {getattr(r, key)}")
    if r.backend != "vllm" or rollout_tp > 1:
        p.append(f"rollout.backend / mapping.roles.rollout.tp: agent rollouts run on the vllm backend at tp 1 (got"
                 f" {r.backend!r}, tp {rollout_tp}); use dp for more engines")
    return p
