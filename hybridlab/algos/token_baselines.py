"""Optimal token baselines (OTB): a baseline per response position, under verl 0.9.1's names.

For each prompt group and position t the baseline is B_t = sum(G_t W_t) / sum(W_t) over the
group's samples, where G_t is the reward-to-go and W_t = sum_{j<=t} (1 - 2 pi_j + sum pi^2) the
cumulative path-variance proxy; pi_j = exp(old_log_probs) and sum pi^2 (``sum_pi_squared``)
comes from the actor's forward pass (the ``old_logprob`` stage computes it for these
estimators). Rollout IS weights, when given, scale W by their square. Returns
(advantages = G - B on the response, returns = G). Tested equal to verl 0.9.1.

    optimal_token_baseline       positions aligned by column
    tir_optimal_token_baseline   positions aligned by response token, skipping masked spans
                                 (tool output inside a multi-turn response)
"""
from __future__ import annotations

import torch

from hybridlab.algos.advantages import group_indices, register_adv_est


def _returns_and_weights(token_level_rewards, response_mask, old_log_probs, sum_pi_squared, rollout_is_weights):
    returns = (token_level_rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    per_token = 1 - 2 * torch.exp(old_log_probs) + sum_pi_squared
    if rollout_is_weights is not None:
        per_token = per_token * rollout_is_weights ** 2
    return returns, (per_token * response_mask).cumsum(dim=-1)


def _zero_unique_tail(baselines: torch.Tensor, rows: list[int], lengths: torch.Tensor) -> None:
    """Past the second-longest response of a group, the longest one alone has no baseline."""
    ordered = torch.sort(lengths).values
    longest, second = int(ordered[-1]), int(ordered[-2])
    at_longest = (lengths == longest).nonzero(as_tuple=True)[0]
    if at_longest.numel() == 1 and longest > second:
        baselines[rows[int(at_longest[0])], second:] = 0.0


@register_adv_est("optimal_token_baseline")
def compute_optimal_token_baseline_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index,
                                             old_log_probs: torch.Tensor, sum_pi_squared: torch.Tensor,
                                             rollout_is_weights: torch.Tensor | None = None,
                                             handle_zero_tail: bool = True, epsilon: float = 1e-8, **kwargs):
    """OTB with positions aligned by column; returns (advantages, returns)."""
    with torch.no_grad():
        returns, w = _returns_and_weights(token_level_rewards, response_mask, old_log_probs, sum_pi_squared,
                                          rollout_is_weights)
        baselines = torch.zeros_like(returns)
        for rows in group_indices(index).values():
            if len(rows) == 1:
                continue
            mask = response_mask[rows]
            baselines[rows] = ((returns[rows] * w[rows] * mask).sum(0) / ((w[rows] * mask).sum(0) + epsilon)) \
                .unsqueeze(0).expand(len(rows), -1)
            if handle_zero_tail:
                _zero_unique_tail(baselines, rows, mask.sum(-1))
        advantages = (returns - baselines) * response_mask
    return advantages, returns


@register_adv_est("tir_optimal_token_baseline")
def compute_multi_turn_optimal_token_baseline_advantage(token_level_rewards: torch.Tensor,
                                                        response_mask: torch.Tensor, index,
                                                        old_log_probs: torch.Tensor, sum_pi_squared: torch.Tensor,
                                                        rollout_is_weights: torch.Tensor | None = None,
                                                        handle_zero_tail: bool = True, epsilon: float = 1e-8,
                                                        **kwargs):
    """OTB with each response's own tokens packed to the left first, so the k-th generated
    token of every sample shares a baseline however tool output interleaves; returns
    (advantages, returns)."""
    with torch.no_grad():
        returns, w = _returns_and_weights(token_level_rewards, response_mask, old_log_probs, sum_pi_squared,
                                          rollout_is_weights)
        lengths = response_mask.sum(dim=-1).long()
        width = int(lengths.max()) if lengths.numel() else 0
        packed_w, packed_g = w.new_zeros(len(lengths), width), w.new_zeros(len(lengths), width)
        own = response_mask.bool()
        for i, n in enumerate(lengths.tolist()):
            packed_w[i, :n], packed_g[i, :n] = w[i, own[i]], returns[i, own[i]]
        baselines = torch.zeros_like(packed_g)
        live = [i for i in range(len(lengths)) if lengths[i] > 0]
        for rows in group_indices([index[i] for i in live]).values():
            rows = [live[r] for r in rows]
            if len(rows) == 1:
                continue
            baselines[rows] = ((packed_g[rows] * packed_w[rows]).sum(0) / (packed_w[rows].sum(0) + epsilon)) \
                .to(baselines.dtype)
            if handle_zero_tail:
                _zero_unique_tail(baselines, rows, lengths[rows])
        advantages = torch.zeros_like(returns)
        for i, n in enumerate(lengths.tolist()):
            advantages[i, own[i]] = (packed_g[i] - baselines[i])[:n]
        advantages = advantages * response_mask
    return advantages, returns
