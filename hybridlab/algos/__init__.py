"""RL algorithms under verl's names and signatures, so verl recipes port unchanged.

Registries select them by string in configs: ``ADV_ESTIMATORS`` (gae, grpo, grpo_vectorized,
grpo_passk, reinforce_plus_plus, reinforce_plus_plus_baseline, rloo, rloo_vectorized, opo, remax,
gpg, optimal_token_baseline, tir_optimal_token_baseline, gdpo), ``POLICY_LOSSES`` (vanilla,
dppo_tv, dppo_kl, gspo, sapo, gpg, clip_cov, kl_cov, geo_mean, dro, cispo, bypass_mode),
``AGG_MODES`` and ``KL_PENALTIES``; rollout correction is in ``rollout_correction``; preference
losses under TRL's ``loss_type`` names in ``PREFERENCE_LOSSES`` (``preference``).
"""
from hybridlab.algos.advantages import (ADV_ESTIMATORS, compute_gae_advantage_return, compute_grpo_outcome_advantage,
                                        compute_reinforce_plus_plus_baseline_outcome_advantage,
                                        compute_reinforce_plus_plus_outcome_advantage, compute_remax_outcome_advantage,
                                        compute_rloo_outcome_advantage, get_adv_estimator_fn, register_adv_est)
from hybridlab.algos.group_advantages import (compute_gdpo_outcome_advantage, compute_gpg_outcome_advantage,
                                              compute_grpo_passk_outcome_advantage,
                                              compute_grpo_vectorized_outcome_advantage, compute_opo_outcome_advantage,
                                              compute_rloo_vectorized_outcome_advantage)
from hybridlab.algos.token_baselines import (compute_multi_turn_optimal_token_baseline_advantage,
                                             compute_optimal_token_baseline_advantage)
from hybridlab.algos.rollout_correction import compute_rollout_correction_and_rejection_mask
from hybridlab.algos.preference import (PREFERENCE_LOSSES, PreferencePairs, PreferenceSettings, preference_loss,
                                        register_preference_loss)
from hybridlab.algos.dapo import informative_groups, overlong_penalty
from hybridlab.algos.functional import (entropy_from_logits, logprobs_from_logits, masked_mean, masked_var,
                                        masked_whiten)
from hybridlab.algos.kl import AdaptiveKLController, FixedKLController, apply_kl_penalty, get_kl_controller
from hybridlab.algos.losses import (AGG_MODES, KL_PENALTIES, POLICY_LOSSES, agg_loss, compute_policy_loss,
                                    compute_policy_loss_vanilla, compute_value_loss, get_policy_loss_fn, kl_penalty,
                                    register_policy_loss)
from hybridlab.algos.policy_losses import (compute_policy_loss_bypass_mode, compute_policy_loss_cispo,
                                           compute_policy_loss_clip_cov, compute_policy_loss_dppo_kl,
                                           compute_policy_loss_dppo_tv, compute_policy_loss_dro,
                                           compute_policy_loss_geo_mean, compute_policy_loss_reinforce,
                                           compute_policy_loss_gpg, compute_policy_loss_gspo,
                                           compute_policy_loss_kl_cov, compute_policy_loss_sapo)

__all__ = [
    "ADV_ESTIMATORS", "AGG_MODES", "KL_PENALTIES", "POLICY_LOSSES", "PREFERENCE_LOSSES", "PreferencePairs",
    "PreferenceSettings", "preference_loss", "register_preference_loss", "AdaptiveKLController", "FixedKLController",
    "agg_loss", "apply_kl_penalty", "compute_gdpo_outcome_advantage", "compute_gpg_outcome_advantage",
    "compute_grpo_passk_outcome_advantage", "compute_grpo_vectorized_outcome_advantage",
    "compute_multi_turn_optimal_token_baseline_advantage", "compute_opo_outcome_advantage",
    "compute_optimal_token_baseline_advantage", "compute_policy_loss_bypass_mode", "compute_policy_loss_dppo_kl",
    "compute_policy_loss_dppo_tv", "compute_policy_loss_reinforce", "compute_rloo_vectorized_outcome_advantage",
    "compute_rollout_correction_and_rejection_mask", "compute_gae_advantage_return", "compute_grpo_outcome_advantage",
    "compute_policy_loss", "compute_policy_loss_cispo", "compute_policy_loss_clip_cov", "compute_policy_loss_dro",
    "compute_policy_loss_geo_mean", "compute_policy_loss_gpg", "compute_policy_loss_gspo", "compute_policy_loss_kl_cov",
    "compute_policy_loss_sapo", "compute_policy_loss_vanilla", "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage", "compute_remax_outcome_advantage",
    "compute_rloo_outcome_advantage", "compute_value_loss", "entropy_from_logits", "get_adv_estimator_fn",
    "get_kl_controller", "get_policy_loss_fn", "informative_groups", "kl_penalty", "logprobs_from_logits",
    "masked_mean", "masked_var", "masked_whiten", "overlong_penalty", "register_adv_est", "register_policy_loss",
]
