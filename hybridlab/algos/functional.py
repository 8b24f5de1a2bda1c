"""Masked tensor helpers shared by the RL algorithms (verl's ``torch_functional`` equivalents)."""
from __future__ import annotations

import torch


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Return the sum of ``values`` where ``mask`` is 1 (over ``axis``, or everything); a NaN
    outside the mask does not spread."""
    kept = torch.where(mask.bool(), values, 0.0) * mask
    return kept.sum() if axis is None else kept.sum(axis)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Return the mean of ``values`` where ``mask`` is 1 (0 for an all-zero mask)."""
    return masked_sum(values, mask, axis) / ((mask.sum() if axis is None else mask.sum(axis)) + 1e-8)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Return the variance of the masked values (Bessel-corrected when more than one value)."""
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    count = mask.sum()
    if unbiased and count > 1:
        variance = variance * count / (count - 1)
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Return values normalised to zero mean (unless ``shift_mean`` is False) and unit variance
    over the masked entries."""
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Return the entropy of the categorical distribution given by ``logits`` over the last dim."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, inplace_backward: bool = True) -> torch.Tensor:
    """Return log p(label) under ``logits`` (shape of ``labels``). ``inplace_backward`` is accepted
    for verl compatibility; there is no fused kernel on this path."""
    del inplace_backward
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
