"""Outcome advantage estimators beyond the classic ones, under verl 0.9.1's names and contract.

Each takes ``(token_level_rewards, response_mask, index, ...)`` (``index``: one group id per
sample, the prompt's uid) and returns ``(advantages, returns)``, both [batch, response_len] and
zero outside the response. Tested equal to verl 0.9.1 in ``tests/test_verl_reference.py``.

    grpo_vectorized   GRPO computed with scatter sums instead of a loop over groups
    rloo_vectorized   RLOO the same way
    grpo_passk        Pass@k: only each group's best sample gets (best - second best)   arXiv 2503.19595
    opo               the group baseline is the length-weighted mean score             arXiv 2505.23585
    gpg               group-mean baseline scaled by batch / non-zero-score samples     arXiv 2504.02546
    gdpo              GRPO per reward component, weighted sum, whitened over the batch arXiv 2601.05242
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from hybridlab.algos.advantages import config_get, group_indices, compute_grpo_outcome_advantage, register_adv_est
from hybridlab.algos.functional import masked_whiten


def group_ids(index: Sequence) -> torch.Tensor:
    """Return ``index`` as group numbers 0..G-1 (in sorted order of the ids), a long tensor [batch]."""
    if isinstance(index, torch.Tensor):
        index = index.tolist()
    return torch.from_numpy(np.unique(np.array([str(i) for i in index], dtype=object),
                                      return_inverse=True)[1].reshape(-1).astype(np.int64))


def _scatter_sum(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.zeros(int(ids.max()) + 1, dtype=values.dtype).index_add_(0, ids, values)


@register_adv_est("grpo_vectorized")
def compute_grpo_vectorized_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index,
                                              epsilon: float = 1e-6, norm_adv_by_std_in_grpo: bool = True,
                                              config=None) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO over all groups at once (group of one: mean 0, std 1); returns (advantages, advantages)."""
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1).float()
        ids = group_ids(index)
        count = _scatter_sum(torch.ones_like(scores), ids)
        mean = _scatter_sum(scores, ids) / count.clamp(min=1)
        var = _scatter_sum((scores - mean[ids]).square(), ids) / (count - 1).clamp(min=1)
        std = var.clamp(min=0.0).sqrt()
        single = count <= 1
        mean, std = mean.masked_fill(single, 0.0), std.masked_fill(single, 1.0)
        scalars = scores - mean[ids]
        if norm_adv_by_std_in_grpo:
            scalars = scalars / (std[ids] + epsilon)
        advantages = scalars.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est("rloo_vectorized")
def compute_rloo_vectorized_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index,
                                              epsilon: float = 1e-6, config=None, **kwargs):
    """RLOO over all groups at once (a group of one gets 0); returns (advantages, advantages)."""
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        ids = group_ids(index)
        count = torch.bincount(ids)[ids].to(scores.dtype)
        others = (count * scores - torch.bincount(ids, weights=scores)[ids]) / (count - 1).clamp_min(1)
        advantages = (others * (count > 1)).unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est("grpo_passk")
def compute_grpo_passk_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index,
                                         epsilon: float = 1e-6, norm_adv_by_std_in_grpo: bool = True, config=None,
                                         **kwargs):
    """Pass@k: in each group only the best sample learns, with advantage (best - second best),
    divided by the group's std unless ``config.norm_adv_by_std_in_grpo`` is False. Every group
    needs at least 2 samples. Returns (advantages, advantages)."""
    norm = config_get(config, "norm_adv_by_std_in_grpo", True)
    scores = token_level_rewards.sum(dim=-1)
    advantages = torch.zeros_like(scores)
    with torch.no_grad():
        for key, rows in group_indices(index).items():
            if len(rows) < 2:
                raise ValueError(f"grpo_passk needs at least 2 samples per group (rollout.n >= 2); group {key!r} "
                                 f"has {len(rows)}")
            group = scores[rows]
            top, where = torch.topk(group, 2)
            advantage = top[0] - top[1]
            advantages[rows[int(where[0])]] = advantage / (group.std() + epsilon) if norm else advantage
    advantages = advantages.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est("opo")
def compute_opo_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index,
                                  epsilon: float = 1e-6, config=None, **kwargs):
    """OPO: score minus the group's mean score weighted by response length (the optimal baseline
    for sequence-level rewards); a group of one keeps its score. Returns (advantages, advantages)."""
    lengths = response_mask.sum(dim=-1)
    scores = token_level_rewards.sum(dim=-1).clone()
    with torch.no_grad():
        for rows in group_indices(index).values():
            if len(rows) > 1:
                scores[rows] = scores[rows] - (lengths[rows] * scores[rows]).sum() / lengths[rows].sum()
        scores = scores.unsqueeze(-1) * response_mask
    return scores, scores


@register_adv_est("gpg")
def compute_gpg_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index,
                                  epsilon: float = 1e-6, f_norm: float = 1.0, alpha: float = 1.0, config=None,
                                  **kwargs):
    """GPG: (score - group mean) x batch size / number of samples with a non-zero score, over
    ``f_norm`` (``alpha`` is recomputed so, as verl does). Returns (advantages, advantages)."""
    scores = token_level_rewards.sum(dim=-1).clone()
    with torch.no_grad():
        alpha = scores.shape[0] / torch.count_nonzero(scores).clamp(min=1)
        for rows in group_indices(index).values():
            mean = scores[rows].mean() if len(rows) > 1 else torch.tensor(0.0)
            scores[rows] = alpha * (scores[rows] - mean) / f_norm
        scores = scores.unsqueeze(-1) * response_mask
    return scores, scores


@register_adv_est("gdpo")
def compute_gdpo_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index,
                                   epsilon: float = 1e-6, norm_adv_by_std_in_grpo: bool = True, config=None,
                                   non_tensor_batch: dict | None = None, batch: dict | None = None, **kwargs):
    """GDPO: GRPO advantages of each reward component (``config.gdpo_reward_keys``, read from
    ``non_tensor_batch``, each placed on the response's last token), summed with weights
    ``config.gdpo_reward_weights`` (default 1 each), then whitened over the batch. Without
    components it is GRPO of the total reward, whitened. Returns (advantages, advantages)."""
    components, weights = [token_level_rewards], None
    if config is not None and non_tensor_batch is not None and batch is not None:
        keys = config_get(config, "gdpo_reward_keys", None)
        if not keys:
            raise ValueError("gdpo needs algorithm.gdpo_reward_keys: the reward components your reward function "
                             "returns in its dict (for example [format_reward, accuracy_reward])")
        last = _last_token(batch, response_mask)
        components = []
        for key in keys:
            if key not in non_tensor_batch:
                raise ValueError(f"gdpo reward key {key!r} is not among the reward's outputs "
                                 f"{sorted(non_tensor_batch)}; return it from the reward function's dict")
            placed = torch.zeros_like(response_mask, dtype=torch.float32)
            placed[torch.arange(len(placed)), last] = torch.as_tensor(np.asarray(non_tensor_batch[key],
                                                                                 dtype=np.float32))
            components.append(placed)
        weights = config_get(config, "gdpo_reward_weights", None)
    weights = torch.ones(len(components)) if weights is None else torch.tensor(list(weights), dtype=torch.float32)
    total = sum(w * compute_grpo_outcome_advantage(c, response_mask, index, epsilon, norm_adv_by_std_in_grpo)[0]
                for w, c in zip(weights, components))
    advantages = masked_whiten(total, response_mask) * response_mask
    return advantages, advantages


def _last_token(batch: Any, response_mask: torch.Tensor) -> torch.Tensor:
    """verl places a component on column (valid response tokens - 1), read from the batch's
    attention mask past the prompt."""
    prompt_width = batch["prompts"].size(1)
    return batch["attention_mask"][:, prompt_width:].sum(dim=1).long() - 1
