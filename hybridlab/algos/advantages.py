"""Advantage estimators under verl's names, arguments, defaults and return values.

Each returns ``(advantages, returns)``, both [batch, response_len]. Outcome estimators are zero
outside the response; GAE's entries past the response carry no meaning (losses mask them).
Outcome estimators (GRPO, RLOO, REINFORCE++-baseline) group samples by ``index`` (one id per
prompt; the n samples of a prompt share it); a group of one has mean 0 (and std 1 for GRPO).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Sequence

import torch

from hybridlab.algos.functional import masked_whiten
from hybridlab.errors import unknown

ADV_ESTIMATORS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {}


def register_adv_est(name: str):
    """Decorator: make an advantage estimator selectable by ``name`` in configs; returns it."""
    def decorator(fn):
        ADV_ESTIMATORS[name] = fn
        return fn
    return decorator


def get_adv_estimator_fn(name: str):
    """Return the estimator registered as ``name``; the error lists the registered names."""
    if name not in ADV_ESTIMATORS:
        raise unknown("advantage estimator", name, ADV_ESTIMATORS)
    return ADV_ESTIMATORS[name]


def config_get(config: Any, key: str, default: Any) -> Any:
    """Return ``config[key]`` (a dict) or ``config.key``, or ``default`` where it is missing (or no config)."""
    if config is None:
        return default
    if isinstance(config, dict):
        return config.get(key, default)
    return getattr(config, key, default)


def group_indices(index: Sequence) -> dict[Any, list[int]]:
    """Return {group id: the rows of that group, in order} for a batch's ``index`` (its uids)."""
    groups: dict[Any, list[int]] = defaultdict(list)
    for i, key in enumerate(index):
        groups[key.item() if isinstance(key, torch.Tensor) else key].append(i)
    return groups


@register_adv_est("gae")
def compute_gae_advantage_return(token_level_rewards: torch.Tensor, values: torch.Tensor,
                                 response_mask: torch.Tensor, gamma: float, lam: float):
    """Generalized Advantage Estimation; returns (whitened advantages, returns = advantages + values).

    Padding tokens carry the next value and advantage through unchanged, so a reward placed on
    the last real token propagates backwards correctly.
    """
    with torch.no_grad():
        mask = response_mask.to(values.dtype)
        next_value = torch.zeros_like(values[:, 0])
        last_gae = torch.zeros_like(values[:, 0])
        reversed_adv = []
        for t in reversed(range(token_level_rewards.shape[-1])):
            delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
            gae = delta + gamma * lam * last_gae
            next_value = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_value
            last_gae = gae * mask[:, t] + (1 - mask[:, t]) * last_gae
            reversed_adv.append(last_gae)
        advantages = torch.stack(reversed_adv[::-1], dim=1)
        returns = advantages + values
        advantages = masked_whiten(advantages, mask)
    return advantages, returns


@register_adv_est("grpo")
def compute_grpo_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index,
                                   epsilon: float = 1e-6, norm_adv_by_std_in_grpo: bool = True, config=None):
    """GRPO: each sample's score minus its group's mean, divided by the group's (unbiased) std
    unless ``norm_adv_by_std_in_grpo`` is False (Dr.GRPO); returns (advantages, advantages)."""
    scores = token_level_rewards.sum(dim=-1).clone()
    with torch.no_grad():
        for rows in group_indices(index).values():
            group = scores[rows]
            mean, std = (group.mean(), group.std()) if len(rows) > 1 else (torch.tensor(0.0), torch.tensor(1.0))
            scores[rows] = (group - mean) / (std + epsilon) if norm_adv_by_std_in_grpo else group - mean
        scores = scores.unsqueeze(-1) * response_mask
    return scores, scores


@register_adv_est("rloo")
def compute_rloo_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index,
                                   epsilon: float = 1e-6, config=None, **kwargs):
    """RLOO: each score minus the mean of the *other* samples of its group (a group of one keeps
    its raw score); returns (advantages, advantages)."""
    scores = token_level_rewards.sum(dim=-1).clone()
    with torch.no_grad():
        for rows in group_indices(index).values():
            n = len(rows)
            if n > 1:
                group = scores[rows]
                scores[rows] = group * n / (n - 1) - group.mean() * n / (n - 1)
        scores = scores.unsqueeze(-1) * response_mask
    return scores, scores


@register_adv_est("reinforce_plus_plus")
def compute_reinforce_plus_plus_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                                                  config=None, **kwargs):
    """REINFORCE++: discounted returns (``config.gamma``, default 1) whitened over the batch;
    returns (advantages, returns). Tokens outside the mask (padding, or tool output inside a
    multi-turn response) get no return and add no reward; the running return passes through
    them unchanged, so a reward after such a span still reaches the tokens before it (verl 0.9.1)."""
    gamma = config_get(config, "gamma", kwargs.get("gamma", 1.0))
    with torch.no_grad():
        returns = torch.zeros_like(token_level_rewards)
        running = torch.zeros_like(token_level_rewards[:, 0])
        for t in reversed(range(token_level_rewards.shape[1])):
            mask = response_mask[:, t].to(running.dtype)
            step = token_level_rewards[:, t] + gamma * running
            returns[:, t] = step * mask
            running = step * mask + running * (1 - mask)
        advantages = masked_whiten(returns, response_mask) * response_mask
    return advantages, returns


@register_adv_est("reinforce_plus_plus_baseline")
def compute_reinforce_plus_plus_baseline_outcome_advantage(token_level_rewards: torch.Tensor,
                                                           response_mask: torch.Tensor, index,
                                                           epsilon: float = 1e-6, config=None, **kwargs):
    """REINFORCE++ with a group-mean baseline, whitened over the batch; returns (advantages, advantages)."""
    length = token_level_rewards.shape[-1]
    scores = token_level_rewards.sum(dim=-1).clone()
    with torch.no_grad():
        for rows in group_indices(index).values():
            if len(rows) > 1:
                scores[rows] = scores[rows] - scores[rows].mean()
        scores = scores.unsqueeze(-1).tile([1, length]) * response_mask
        scores = masked_whiten(scores, response_mask) * response_mask
    return scores, scores


@register_adv_est("remax")
def compute_remax_outcome_advantage(token_level_rewards: torch.Tensor, reward_baselines: torch.Tensor,
                                    response_mask: torch.Tensor, config=None, **kwargs):
    """ReMax: reward-to-go minus the greedy response's reward (``reward_baselines``, [batch]);
    returns (advantages, returns)."""
    with torch.no_grad():
        returns = (token_level_rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
        advantages = returns - reward_baselines.unsqueeze(-1) * response_mask
    return advantages, returns


def compute_advantage(name: str, batch_fields: dict, config=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Call estimator ``name`` with the fields it needs from ``batch_fields`` (``uid`` as the
    group index) and settings from ``config`` (gamma, lam, norm_adv_by_std_in_grpo), as verl's
    trainer does; returns (advantages, returns)."""
    fn = get_adv_estimator_fn(name)
    rewards, mask = batch_fields["token_level_rewards"], batch_fields["response_mask"].to(torch.float32)
    if name == "gae":
        return fn(rewards, batch_fields["values"], mask, config_get(config, "gamma", 1.0), config_get(config, "lam", 1.0))
    kwargs: dict[str, Any] = {"token_level_rewards": rewards, "response_mask": mask, "config": config}
    if "uid" in ADV_INPUTS[name]:
        kwargs["index"] = batch_fields["uid"]
    if name in ("grpo", "grpo_vectorized"):
        kwargs["norm_adv_by_std_in_grpo"] = config_get(config, "norm_adv_by_std_in_grpo", True)
    for key in ("reward_baselines", "old_log_probs", "sum_pi_squared", "rollout_is_weights"):
        if key in ADV_INPUTS[name] or key in OPTIONAL_ADV_INPUTS.get(name, ()) and key in batch_fields:
            kwargs[key] = batch_fields[key]
    if name == "gdpo" and config_get(config, "gdpo_reward_keys", None):  # each reward component, as verl passes them
        infos = batch_fields["reward_extra_info"]
        present = {k for parts in infos for k in parts}
        kwargs["non_tensor_batch"] = {k: [parts.get(k, float("nan")) for parts in infos] for k in present}
        kwargs["batch"] = {"prompts": batch_fields["prompts"], "attention_mask": batch_fields["attention_mask"]}
    return fn(**kwargs)


# Batch fields each estimator reads beyond token_level_rewards and response_mask.
_GROUPED = ("grpo", "grpo_vectorized", "grpo_passk", "rloo", "rloo_vectorized", "reinforce_plus_plus_baseline", "opo",
            "gpg", "gdpo")
ADV_INPUTS: dict[str, tuple[str, ...]] = {
    "gae": ("values",), "reinforce_plus_plus": (), "remax": ("reward_baselines",),
    **{name: ("uid",) for name in _GROUPED},
    **{name: ("uid", "old_log_probs", "sum_pi_squared") for name in ("optimal_token_baseline",
                                                                    "tir_optimal_token_baseline")},
}
# ... and read when the batch has them (rollout correction's weights).
OPTIONAL_ADV_INPUTS = {"optimal_token_baseline": ("rollout_is_weights",),
                       "tir_optimal_token_baseline": ("rollout_is_weights",)}
