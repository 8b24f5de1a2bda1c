"""The stage table: every stage an RL step can be made of, bound to a role, with its declared
inputs and outputs, in one place.

A stage function takes (ctx, batch) and returns (new fields as a Batch or None, metrics); ctx is
the StepContext (dataflow/context.py). A stage with ``replaces_rows`` returns the whole new batch
instead (generate repeats each prompt n times; DAPO's filter drops groups). Outputs starting
with ``@`` are markers, not fields: they order stages that touch no common field (sync after the
actor update). A dataflow is a list of these names, so a config or a notebook can edit it;
``register_stage`` adds your own. The functions live in the modules of their phase:

    generation_stages.py  generate, reward, reward_model, filter_groups, remax_baseline
    logprob_stages.py     old_logprob, rollout_as_old_logprob, ref_logprob, values
    update_stages.py      rollout_correction, kl_reward, advantages, update_critic, update_actor, sync_weights
    preference_stages.py  pair_best_worst, update_actor_dpo (online DPO)
    agent_stages.py       generate_agent, agent_reward (agent rollouts)
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable

from hybridlab.dataflow import agent_stages as agent
from hybridlab.dataflow import generation_stages as gen
from hybridlab.dataflow import logprob_stages as logprob
from hybridlab.dataflow import preference_stages as preference
from hybridlab.dataflow import update_stages as update
from hybridlab.dataflow.fields import SEQUENCE_FIELDS
from hybridlab.errors import unknown
from hybridlab.protocol import Batch

if TYPE_CHECKING:
    from hybridlab.dataflow.context import StepContext

StageFn = Callable[["StepContext", Batch], tuple[Batch | None, dict]]
Fields = tuple[str, ...] | Callable[[Any], tuple[str, ...]]  # fixed, or a function of the RunConfig
SCORES = ("token_level_scores", "token_level_rewards", "acc", "reward_extra_info")


@dataclasses.dataclass(frozen=True)
class Stage:
    """One node of the dataflow: ``fn`` runs against ``role``'s workers (None: the controller)."""

    name: str
    role: str | None
    inputs: Callable[[Any], tuple[str, ...]]
    outputs: Callable[[Any], tuple[str, ...]]
    fn: StageFn
    replaces_rows: bool = False
    needs: tuple[str, ...] = ()        # other roles the stage uses (sync_weights: rollout)
    doc: str = ""
    check: Callable[[Any], list[str]] | None = None  # settings under which the stage is wrong: reasons


def stage(name: str, role: str | None, inputs: Fields, outputs: Fields, fn: StageFn, replaces_rows: bool = False,
          needs: tuple[str, ...] = (), check: Callable[[Any], list[str]] | None = None) -> Stage:
    """Return the Stage ``name`` running ``fn`` on ``role``'s workers (None: the controller).
    ``inputs``/``outputs`` are field tuples or functions of the RunConfig returning them;
    ``check(cfg)`` returns the reasons the stage must not run under a config."""
    as_fn = (lambda v: v if callable(v) else (lambda cfg, v=tuple(v): v))
    return Stage(name, role, as_fn(inputs), as_fn(outputs), fn, replaces_rows, needs,
                 (fn.__doc__ or "").strip().split("\n")[0], check)


STAGES: dict[str, Stage] = {s.name: s for s in [
    # name, role, inputs, outputs, function
    stage("generate", "rollout", ("prompt_ids", "uid"), ("prompts", *SEQUENCE_FIELDS, "rollout_log_probs"),
          gen.generate, replaces_rows=True),
    stage("reward", "reward", gen.REWARD_FIELDS, SCORES, gen.reward),
    stage("reward_model", "reward", ("input_ids", "attention_mask", "position_ids", "response_mask"), SCORES,
          gen.reward_model),
    stage("filter_groups", None, ("token_level_scores", "uid"), (), gen.filter_groups, replaces_rows=True,
          needs=("rollout", "reward")),
    stage("remax_baseline", "rollout", ("prompt_ids", "uid"), ("reward_baselines",), gen.remax_baseline,
          needs=("reward",)),
    stage("old_logprob", "actor", SEQUENCE_FIELDS, logprob.old_logprob_outputs, logprob.old_logprob),
    stage("rollout_as_old_logprob", None, ("rollout_log_probs",), ("old_log_probs",), logprob.rollout_as_old_logprob,
          check=logprob.rollout_log_probs_inexact),
    stage("ref_logprob", "ref", SEQUENCE_FIELDS, ("ref_log_prob",), logprob.ref_logprob),
    stage("values", "critic", SEQUENCE_FIELDS, ("values",), logprob.values),
    stage("rollout_correction", None, ("old_log_probs", "rollout_log_probs", "response_mask"),
          update.correction_outputs, update.rollout_correction),
    stage("kl_reward", None, ("token_level_scores", "old_log_probs", "ref_log_prob", "response_mask"),
          ("token_level_rewards",), update.kl_reward),
    stage("advantages", None, update.advantage_inputs, ("advantages", "returns"), update.advantages),
    stage("update_critic", "critic", (*SEQUENCE_FIELDS, "values", "returns"), ("@critic_updated",),
          update.update_critic),
    stage("update_actor", "actor", update.actor_fields, ("@actor_updated",), update.update_actor),
    stage("sync_weights", "actor", ("@actor_updated",), ("@weights_synced",), update.sync_weights,
          needs=("rollout",)),
    stage("pair_best_worst", None, ("token_level_scores", "uid"), ("@pairs",), preference.pair_best_worst,
          replaces_rows=True),
    stage("update_actor_dpo", "actor", (*preference.PAIR_FIELDS, "@pairs"), ("@actor_updated",),
          preference.update_actor_dpo),
    stage("generate_agent", "rollout", ("prompt_ids", "uid"), agent.AGENT_OUTPUTS, agent.generate_agent,
          replaces_rows=True),
    stage("agent_reward", None, ("agent_reward", "agent_error", "response_mask"), SCORES, agent.agent_reward),
]}


def register_stage(name: str, role: str | None, inputs: Fields, outputs: Fields, replaces_rows: bool = False,
                   needs: tuple[str, ...] = (), check: Callable[[Any], list[str]] | None = None):
    """Decorator: add your own ``fn`` to the table as stage ``name`` (arguments as ``stage`` takes
    them); returns the function."""
    def decorator(fn: StageFn) -> StageFn:
        STAGES[name] = stage(name, role, inputs, outputs, fn, replaces_rows, needs, check)
        return fn
    return decorator


def get_stage(name: str) -> Stage:
    """Return the stage ``name`` from the table; the error lists the stage names."""
    if name not in STAGES:
        raise unknown("dataflow stage", name, STAGES)
    return STAGES[name]
