"""KL between actor and reference as a reward penalty: fixed and adaptive coefficients."""
from __future__ import annotations

import torch

from hybridlab.algos.functional import masked_mean
from hybridlab.algos.losses import kl_penalty


class FixedKLController:
    """A constant KL coefficient ``value``."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """Keep the coefficient (a fixed controller ignores the measured KL)."""


class AdaptiveKLController:
    """The coefficient of Ziegler et al. (2019): moves ``value`` so the KL tracks ``target_kl``."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        self.value, self.target, self.horizon = init_kl_coef, target_kl, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Scale the coefficient by at most 20% x n_steps / horizon towards the target KL."""
        error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + error * n_steps / self.horizon


def get_kl_controller(kl_ctrl) -> FixedKLController | AdaptiveKLController:
    """Return the controller described by ``kl_ctrl`` (type, kl_coef, target_kl, horizon)."""
    if kl_ctrl.type == "fixed":
        return FixedKLController(kl_ctrl.kl_coef)
    if kl_ctrl.type == "adaptive":
        if kl_ctrl.horizon <= 0:
            raise ValueError(f"kl_ctrl.horizon must be positive, got {kl_ctrl.horizon}")
        return AdaptiveKLController(kl_ctrl.kl_coef, kl_ctrl.target_kl, kl_ctrl.horizon)
    raise ValueError(f"unknown kl_ctrl.type {kl_ctrl.type!r}; choose fixed or adaptive")


def apply_kl_penalty(token_level_scores: torch.Tensor, old_log_probs: torch.Tensor, ref_log_prob: torch.Tensor,
                     response_mask: torch.Tensor, kl_ctrl, kl_type: str = "kl") -> tuple[torch.Tensor, dict]:
    """Return (token_level_rewards = scores - beta x KL per token, metrics) and update the controller
    with the batch's mean per-sequence KL."""
    mask = response_mask.to(token_level_scores.dtype)
    kld = kl_penalty(old_log_probs, ref_log_prob, kl_type) * mask
    beta = kl_ctrl.value
    rewards = token_level_scores - beta * kld
    current = float(masked_mean(kld, mask, axis=-1).mean())
    kl_ctrl.update(current_kl=current, n_steps=len(token_level_scores))
    return rewards, {"actor/reward_kl_penalty": current, "actor/reward_kl_penalty_coeff": beta}
