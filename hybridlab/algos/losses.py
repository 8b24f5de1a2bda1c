"""Losses under verl's names and signatures: aggregation, PPO policy loss, value loss, KL.

Policy losses return ``(loss, metrics)`` as verl's do. Every loss also takes keyword-only
``global_tokens`` / ``global_seqs``: given them, the
aggregate is this micro-batch's *share* of the mini-batch value (hybridlab's loss contract,
see ``workers/train/engine.py``), so the shares of all micro-batches and data-parallel ranks
add up to exactly what verl's function returns on the whole mini-batch at once.
"""
from __future__ import annotations

from typing import Any

import torch

from hybridlab.algos.functional import masked_mean
from hybridlab.errors import unknown

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# each also with a "+" suffix: the same value, the gradient of k2 (straight-through; ``kl_penalty``)
KL_ESTIMATORS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
KL_PENALTIES = KL_ESTIMATORS + tuple(f"{name}+" for name in KL_ESTIMATORS)
POLICY_LOSSES: dict[str, Any] = {}


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str, dp_size: int = 1,
             batch_num_tokens: torch.Tensor | float | None = None,
             global_batch_size: torch.Tensor | float | None = None, loss_scale_factor: float | None = None, *,
             global_tokens: torch.Tensor | float | None = None,
             global_seqs: torch.Tensor | float | None = None) -> torch.Tensor:
    """Return ``loss_mat`` [batch, len] aggregated to a scalar over ``loss_mask``, as verl 0.9.1.

    token-mean: the token sum over ``batch_num_tokens`` (default: this batch's tokens);
    token-sum: the token sum; seq-mean-token-sum: per-sequence sums over ``global_batch_size``
    sequences (default: this batch's sequences with at least one token; empty ones never count);
    seq-mean-token-mean: per-sequence means, the same way; seq-mean-token-sum-norm (Dr.GRPO):
    seq-mean-token-sum divided by ``loss_scale_factor`` (default: the padded response length).
    Each is multiplied by ``dp_size`` (DDP averages gradients over ranks; with ``dp_size`` > 1 the
    global totals are required). With keyword ``global_tokens`` / ``global_seqs`` (hybridlab's
    engine) the result is this micro-batch's share: the same formula with the mini-batch totals
    and ``dp_size`` 1, so the shares the engine sums add up to verl's value on the mini-batch.
    """
    if global_tokens is not None or global_seqs is not None:
        dp_size, batch_num_tokens, global_batch_size = 1, global_tokens, global_seqs
    mask = loss_mask.to(loss_mat.dtype)
    if loss_agg_mode not in AGG_MODES:
        raise unknown("loss_agg_mode", loss_agg_mode, AGG_MODES)
    if loss_agg_mode in ("token-mean", "token-sum"):
        total = (loss_mat * mask).sum()
        if loss_agg_mode == "token-sum":
            return total * dp_size
        if batch_num_tokens is None:
            _need_global(dp_size, "batch_num_tokens")
            batch_num_tokens = mask.sum().clamp(min=1)  # verl: 0/0 for a batch without tokens
        return total / batch_num_tokens * dp_size
    counts = mask.sum(-1)
    seq_values = (loss_mat * mask).sum(-1)
    if loss_agg_mode == "seq-mean-token-mean":
        seq_values = seq_values / (counts + 1e-8)
    valid = (counts > 0).to(loss_mat.dtype)  # sequences without tokens neither count nor divide
    if global_batch_size is None:
        _need_global(dp_size, "global_batch_size")
        global_batch_size = valid.sum().clamp(min=1)
    loss = (seq_values * valid).sum() / global_batch_size * dp_size
    if loss_agg_mode == "seq-mean-token-sum-norm":
        loss = loss / (mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return loss


def _need_global(dp_size: int, name: str) -> None:
    if dp_size > 1:
        raise ValueError(f"agg_loss: {name} (the global total) is required when dp_size > 1, got dp_size={dp_size}")


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
                        clip_ratio_c: float = 3.0, loss_agg_mode: str = "token-mean",
                        rollout_is_weights: torch.Tensor | None = None, agg: dict | None = None, **share):
    """PPO's clipped objective with separate low/high clip ranges (DAPO's clip-higher) and dual
    clip (the ratio term is bounded by ``clip_ratio_c`` for negative advantages); per-token
    losses times ``rollout_is_weights`` when given; ``agg``: agg_loss's dp_size and totals.

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
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **(agg or {}), **share)
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


def config_value(config: Any, key: str, default: Any = None) -> Any:
    """Return ``config[key]`` (a dict) or ``config.key``, or ``default`` where it is missing or None."""
    if config is None:
        return default
    value = config.get(key, default) if isinstance(config, dict) else getattr(config, key, default)
    return default if value is None else value


def agg_settings(config: Any) -> dict:
    """Return agg_loss's keyword arguments from a config's ``global_batch_info`` (dp_size,
    batch_num_tokens, global_batch_size, loss_scale_factor), which is all verl's policy losses read."""
    return {k: v for k, v in (config_value(config, "global_batch_info", {}) or {}).items() if v is not None}


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                                response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", config=None,
                                rollout_is_weights: torch.Tensor | None = None, **share):
    """PPO's clipped policy loss as verl's: clip settings (clip_ratio, clip_ratio_low,
    clip_ratio_high, clip_ratio_c) and ``global_batch_info`` read from ``config`` (a dict or an
    object).

    Returns (pg_loss, metrics): actor/pg_clipfrac, actor/ppo_kl, actor/pg_clipfrac_lower (floats).
    """
    clip = config_value(config, "clip_ratio", 0.2)
    pg_loss, clipfrac, ppo_kl, clipfrac_lower = compute_policy_loss(
        old_log_prob, log_prob, advantages, response_mask, cliprange=clip,
        cliprange_low=config_value(config, "clip_ratio_low", clip), cliprange_high=config_value(config, "clip_ratio_high", clip),
        clip_ratio_c=config_value(config, "clip_ratio_c", 3.0), loss_agg_mode=loss_agg_mode,
        rollout_is_weights=rollout_is_weights, agg=agg_settings(config), **share)
    return pg_loss, {"actor/pg_clipfrac": float(clipfrac.detach()), "actor/ppo_kl": float(ppo_kl.detach()),
                     "actor/pg_clipfrac_lower": float(clipfrac_lower.detach())}


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
    A "+" suffix ("k3+", "low_var_kl+", ...) keeps the estimator's value but takes the gradient
    through k2 (straight-through, as verl 0.9.1): k1's and k3's expected gradients are not the
    KL's gradient, k2's is.
    """
    if not kl_penalty.endswith("+"):
        return _kl_estimate(logprob, ref_logprob, kl_penalty)
    value = _kl_estimate(logprob, ref_logprob, kl_penalty[:-1])
    k2 = 0.5 * (logprob - ref_logprob).square()
    return k2 - k2.detach() + value.detach()


def _kl_estimate(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
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
