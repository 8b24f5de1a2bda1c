"""The standard step of a config: the stages its algorithm, reward and settings call for, the
roles they run on, and the hybrid-engine device mapping that holds them all (what a run uses
when its config names no ``dataflow`` or ``mapping``)."""
from __future__ import annotations

from hybridlab.config import RunConfig
from hybridlab.controller.mapping import ROLES
from hybridlab.dataflow.agent_stages import rollout_stages
from hybridlab.dataflow.logprob_stages import rollout_log_probs_inexact, wants_sum_pi_squared
from hybridlab.dataflow.stages import get_stage


def default_dataflow(cfg: RunConfig) -> list[str]:
    """Return the stage names of the standard step for the config's algorithm and reward."""
    algo, est = cfg.algorithm, cfg.algorithm.adv_estimator
    if cfg.data.preferences:  # offline DPO: the pairs come from the data
        return ["ref_logprob", "update_actor_dpo", "sync_weights"]
    stages = rollout_stages(cfg)
    if cfg.dpo.online:  # pairs from the policy's own samples, the DPO loss against the reference
        return stages + ["pair_best_worst", "ref_logprob", "update_actor_dpo", "sync_weights"]
    if algo.filter_groups.enable:
        stages.append("filter_groups")
    if est == "remax":
        stages.append("remax_baseline")
    correction = algo.rollout_correction
    exact = cfg.actor.use_rollout_log_probs and not rollout_log_probs_inexact(cfg)
    recompute = (correction.enabled and not correction.bypass_mode) or wants_sum_pi_squared(cfg)
    stages.append("rollout_as_old_logprob" if correction.bypass_mode or (exact and not recompute) else "old_logprob")
    if cfg.actor.use_kl_loss or algo.use_kl_in_reward:
        stages.append("ref_logprob")
    if est == "gae":
        stages.append("values")
    if algo.use_kl_in_reward:
        stages.append("kl_reward")
    if correction.enabled and not correction.bypass_mode:  # verl's place: after the KL penalty, before advantages
        stages.append("rollout_correction")
    stages.append("advantages")
    if est == "gae":
        stages.append("update_critic")
    return stages + ["update_actor", "sync_weights"]


def dataflow_names(cfg: RunConfig) -> list[str]:
    """Return the configured dataflow, or the default one for the algorithm."""
    return list(cfg.dataflow) if cfg.dataflow else default_dataflow(cfg)


def roles_needed(names: list[str]) -> list[str]:
    """Return the roles the stages run on, in the canonical role order."""
    used = {r for n in names for s in [get_stage(n)] for r in (s.role, *s.needs) if r}
    return [r for r in ROLES if r in used]


# The evaluation (greedy accuracy on the test prompts) generates on the rollout and scores on the reward.
EVAL_ROLES = ("rollout", "reward")


def default_mapping(cfg: RunConfig, names: list[str], keep: tuple[str, ...] = ()) -> dict:
    """Return the hybrid-engine mapping: every role the stages and the evaluation need (and the
    roles in ``keep``, which a running session already has) in one set of processes on
    ``trainer.devices`` devices, data parallel over them."""
    devices = cfg.trainer.devices
    needed = [*roles_needed(names), *EVAL_ROLES]
    roles = [r for r in ROLES if r in needed or r in keep]
    return {"pools": {"main": {"devices": devices}},
            "roles": {r: {"pool": "main", "dp": devices, "colocate": "engine"} for r in roles}}
