"""The checks of the algorithm's settings against this package's registries: the estimator, the
KL penalty and controller, GDPO and the overlong buffer (``algorithm_problems``), the policy and
value losses (``loss_problems``) and rollout correction (``correction_problems``). Each returns
its problems, naming the key; ``hybridlab.run_config.validate_config`` runs them with the rest.
"""
from __future__ import annotations

from hybridlab.algos.advantages import ADV_ESTIMATORS, ADV_INPUTS
from hybridlab.algos.losses import AGG_MODES, KL_PENALTIES, POLICY_LOSSES
from hybridlab.algos.rollout_correction import IS_LEVELS, parse_is_threshold, parse_rs
from hybridlab.config import RunConfig
from hybridlab.config.bounds import one_of


def algorithm_problems(cfg: RunConfig) -> list[str]:
    """Return the problems of ``algorithm.*`` (and the group size its estimator needs)."""
    algo, r = cfg.algorithm, cfg.rollout
    p = one_of("algorithm.adv_estimator", algo.adv_estimator, sorted(ADV_ESTIMATORS))
    if "uid" in ADV_INPUTS.get(algo.adv_estimator, ()) and r.n < 2:  # it compares samples within a group
        p.append(f"rollout.n: {algo.adv_estimator} compares samples within a group, so the group size must be at"
                 f" least 2, got {r.n}")
    p += one_of("algorithm.kl_penalty", algo.kl_penalty, KL_PENALTIES)
    p += one_of("algorithm.kl_ctrl.type", algo.kl_ctrl.type, ("fixed", "adaptive"))
    keys, weights = algo.gdpo_reward_keys, algo.gdpo_reward_weights
    if keys is not None and (not keys or not all(isinstance(k, str) for k in keys)):
        p.append(f"algorithm.gdpo_reward_keys: a list of reward component names, got {keys!r}")
    if weights is not None and (keys is None or len(weights) != len(keys)):
        p.append(f"algorithm.gdpo_reward_weights: one weight per algorithm.gdpo_reward_keys entry ({keys!r}),"
                 f" got {weights!r}")
    if algo.overlong_buffer.enable and not 0 < algo.overlong_buffer.len <= r.max_new_tokens:
        p.append(f"algorithm.overlong_buffer.len: must be in 1..rollout.max_new_tokens ({r.max_new_tokens}),"
                 f" got {algo.overlong_buffer.len}")
    return p


def loss_problems(cfg: RunConfig) -> list[str]:
    """Return the problems of the actor's and critic's loss settings."""
    a = cfg.actor
    p = [*one_of("actor.kl_loss_type", a.kl_loss_type, KL_PENALTIES),
         *one_of("actor.loss_agg_mode", a.loss_agg_mode, AGG_MODES),
         *one_of("critic.loss_agg_mode", cfg.critic.loss_agg_mode, AGG_MODES)]
    if a.policy_loss == "dro" and not (a.dro_beta or 0) > 0:
        p.append(f"actor.dro_beta: the dro policy loss needs a positive dro_beta, got {a.dro_beta}")
    if a.loss_scale_factor is not None and not a.loss_scale_factor > 0:
        p.append(f"actor.loss_scale_factor: must be a positive number (or null: the padded response length),"
                 f" got {a.loss_scale_factor}")
    p += one_of("actor.policy_loss", a.policy_loss, sorted(POLICY_LOSSES))
    if a.clip_ratio_c <= 1:
        p.append(f"actor.clip_ratio_c: the dual-clip bound must be greater than 1, got {a.clip_ratio_c}")
    return p


def correction_problems(cfg: RunConfig) -> list[str]:
    """Return the problems of ``algorithm.rollout_correction`` and its bypass mode."""
    c, out, where = cfg.algorithm.rollout_correction, [], "algorithm.rollout_correction"
    if c.rollout_is is not None and c.rollout_is not in IS_LEVELS:
        out.append(f"{where}.rollout_is: {c.rollout_is!r} is not one of {', '.join(IS_LEVELS)} (or null: off)")
    checks = []
    if c.rollout_is is not None:
        checks.append(("rollout_is_threshold", lambda: parse_is_threshold(c.rollout_is_threshold)))
    if c.rollout_rs is not None:
        checks.append(("rollout_rs", lambda: parse_rs(c.rollout_rs, c.rollout_rs_threshold)))
    for key, check in checks:
        try:
            check()
        except (TypeError, ValueError) as exc:
            out.append(f"{where}.{key}: {exc}")
    if c.loss_type not in ("ppo_clip", "reinforce"):
        out.append(f"{where}.loss_type: {c.loss_type!r} is not one of ppo_clip, reinforce")
    if c.bypass_mode and cfg.actor.policy_loss not in ("vanilla", "bypass_mode"):
        out.append(f"{where}.bypass_mode: bypass mode runs its own loss (ppo_clip or reinforce, by loss_type), so"
                   f" actor.policy_loss must be vanilla or bypass_mode, got {cfg.actor.policy_loss!r}")
    if cfg.actor.policy_loss == "bypass_mode" and not c.bypass_mode:
        out.append(f"actor.policy_loss: bypass_mode needs {where}.bypass_mode=true (the rollout's log-probs stand in"
                   f" for the old ones)")
    return out
