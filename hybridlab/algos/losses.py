"""Losses under verl's names and signatures: aggregation, PPO policy loss, value loss, KL.

Every loss also takes keyword-only ``global_tokens`` / ``global_seqs``: given them, the
aggregate is this micro-batch's *share* of the mini-batch value (hybridlab's loss contract,
see ``workers/train/engine.py``), so the shares of all micro-batches and data-parallel ranks
add up to exactly what verl's function returns on the whole mini-batch at once.
"""
from __future__ import annotations

from typing import Any

import torch

from hybridlab.algos.functional import masked_mean
from hybridlab.errors import unknown

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_PENALTIES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
POLICY_LOSSES: dict[str, Any] = {}


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str, *,
             global_tokens: torch.Tensor | float | None = None,
             global_seqs: torch.Tensor | float | None = None) -> torch.Tensor:
    """Return ``loss_mat`` [batch, len] aggregated to a scalar over ``loss_mask``.

    token-mean: mean over all response tokens; seq-mean-token-sum: per-sequence sums, averaged;
    seq-mean-token-mean: per-sequence means, averaged; seq-mean-token-sum-norm (Dr.GRPO): the
    sum of per-sequence sums divided by the response length (a constant).
    """
    mask = loss_mask.to(loss_mat.dtype)
    if loss_agg_mode == "token-mean":
        if global_tokens is None:
            return masked_mean(loss_mat, mask)
        return (loss_mat * mask).sum() / global_tokens
    seq_sums = (loss_mat * mask).sum(-1)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        return seq_sums.sum() / mask.shape[-1]
    if loss_agg_mode == "seq-mean-token-mean":
        # An empty sequence (micro-batch padding) contributes 0 instead of 0/0.
        seq_values = seq_sums / mask.sum(-1).clamp(min=1)
    elif loss_agg_mode == "seq-mean-token-sum":
        seq_values = seq_sums
    else:
        raise unknown("loss_agg_mode", loss_agg_mode, AGG_MODES)
    return seq_values.mean() if global_seqs is None else seq_values.sum() / global_seqs


def register_policy_loss(name: str):
    """Decorator: make a policy loss selectable by ``name``; returns the function."""
    def decorator(fn):
        POLICY_LOSSES[name] = fn
        return fn
    return decorator


def get_policy_loss_fn(name: str):
    """Return the policy loss registered as ``name``; the error lists the registered names."""
    if name not in POLICY_LOSSES:
        raise unknown("policy loss", name, POLICY_LOSSES)
    return POLICY_LOSSES[name]


def compute_policy_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                        response_mask: torch.Tensor, cliprange: float | None = None,
                        cliprange_low: float | None = None, cliprange_high: float | None = None,
                        clip_ratio_c: float = 3.0, loss_agg_mode: str = "token-mean", **share):
    """PPO's clipped objective with separate low/high clip ranges (DAPO's clip-higher) and dual
    clip (the ratio term is bounded by ``clip_ratio_c`` for negative advantages).

    Returns (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower).
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c (the dual-clip bound) must be greater than 1.0, got {clip_ratio_c}")
    cliprange_low = cliprange if cliprange_low is None else cliprange_low
    cliprange_high = cliprange if cliprange_high is None else cliprange_high
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)
    losses1 = -advantages * ratio
    losses2 = -advantages * torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
    clipped1 = torch.maximum(losses1, losses2)
    pg_clipfrac = masked_mean(torch.gt(losses2, losses1).float(), response_mask)
    losses3 = -advantages * clip_ratio_c
    clipped2 = torch.min(losses3, clipped1)
    pg_clipfrac_lower = masked_mean(torch.gt(clipped1, losses3) * (advantages < 0).float(), response_mask)
    pg_losses = torch.where(advantages < 0, clipped2, clipped1)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **share)
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


def _get(config: Any, key: str, default: Any = None) -> Any:
    if config is None:
        return default
    value = config.get(key, default) if isinstance(config, dict) else getattr(config, key, default)
    return default if value is None else value


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                                response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", config=None,
                                **share):
    """``compute_policy_loss`` with the clip settings read from ``config`` (a dict or an object
    with clip_ratio, clip_ratio_low, clip_ratio_high, clip_ratio_c), as in verl.

    Returns (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower).
    """
    clip = _get(config, "clip_ratio", 0.2)
    return compute_policy_loss(old_log_prob, log_prob, advantages, response_mask, cliprange=clip,
                               cliprange_low=_get(config, "clip_ratio_low", clip),
                               cliprange_high=_get(config, "clip_ratio_high", clip),
                               clip_ratio_c=_get(config, "clip_ratio_c", 3.0), loss_agg_mode=loss_agg_mode, **share)


def compute_value_loss(vpreds: torch.Tensor, returns: torch.Tensor, values: torch.Tensor,
                       response_mask: torch.Tensor, cliprange_value: float, loss_agg_mode: str = "token-mean",
                       **share):
    """Clipped value loss: 0.5 x the larger of the squared errors of the new prediction and of the
    prediction clipped to ``values`` +- ``cliprange_value``; returns (vf_loss, vf_clipfrac)."""
    clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    losses1, losses2 = (vpreds - returns) ** 2, (clipped - returns) ** 2
    vf_loss = 0.5 * agg_loss(torch.max(losses1, losses2), response_mask, loss_agg_mode, **share)
    return vf_loss, masked_mean(torch.gt(losses2, losses1).float(), response_mask)


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Return the per-token KL estimate between the policy and the reference.

    "kl"/"k1": log-ratio; "abs": its absolute value; "mse"/"k2": half its square;
    "low_var_kl"/"k3": Schulman's unbiased low-variance estimator, clamped to [-10, 10].
    """
    if kl_penalty in ("kl", "k1"):
        return logprob - ref_logprob
    if kl_penalty == "abs":
        return (logprob - ref_logprob).abs()
    if kl_penalty in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if kl_penalty in ("low_var_kl", "k3"):
        kl = torch.clamp(ref_logprob - logprob, min=-20, max=20)
        return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)
    raise unknown("kl_penalty", kl_penalty, KL_PENALTIES)
