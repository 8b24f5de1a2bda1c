"""Policy losses beyond PPO's, under verl 0.9.1's names and contract.

Each takes ``(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
rollout_is_weights=None)`` and returns ``(loss, metrics)``. Settings come from ``config`` (a dict
or an object): the clip ratios, SAPO's ``tau_pos`` / ``tau_neg``, and the loss's own settings
under ``policy_loss`` (a dict or object with clip_cov_ratio, clip_cov_lb, clip_cov_ub,
kl_cov_ratio, ppo_kl_coef, dro_beta; verl's defaults when missing). ``global_batch_info`` and
hybridlab's ``global_tokens`` / ``global_seqs`` shares work as in ``losses.compute_policy_loss``.
Tested equal to verl 0.9.1 (value, metrics and gradient) in ``tests/test_verl_reference.py``.

    gspo      sequence-level ratio (geometric mean of token ratios), clipped      arXiv 2507.18071
    sapo      a smooth sigmoid gate on the ratio instead of a hard clip            arXiv 2511.20347
    gpg       plain policy gradient: -log_prob x advantage                         arXiv 2504.02546
    geo_mean  GMPO: clipped geometric mean of token ratios per sequence            arXiv 2507.20673
    cispo     clipped importance weight, stopped, times log_prob (MiniMax-M1)      arXiv 2506.13585
    dro       log_prob x advantage with a squared log-ratio penalty               arXiv 2506.17252
    clip_cov  PPO, with the gradient cut for a few high-covariance tokens          arXiv 2505.22617
    kl_cov    PPO, with a |log-ratio| penalty on the highest-covariance tokens     arXiv 2505.22617
    dppo_tv   log_prob x truncated ratio, masked where |p - p_old| leaves a band    arXiv 2602.04879
    dppo_kl   the same with a binary-KL band                                       arXiv 2602.04879
    bypass_mode  old log-probs are the rollout's: PPO-clip or IS-weighted REINFORCE, with rollout
              correction (``rollout_correction``: rollout_is, rollout_rs, thresholds, loss_type)
"""
from __future__ import annotations

from typing import Any

import torch

from hybridlab.algos.functional import masked_mean
from hybridlab.algos.losses import config_value, agg_loss, agg_settings, compute_policy_loss_vanilla, register_policy_loss
from hybridlab.algos.rollout_correction import compute_rollout_correction_and_rejection_mask

POLICY_LOSS_DEFAULTS = {"clip_cov_ratio": 0.0002, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0, "kl_cov_ratio": 0.0002,
                        "ppo_kl_coef": 0.1, "dro_beta": None, "rollout_correction": None}


def loss_setting(config: Any, key: str) -> Any:
    """Return ``config.policy_loss.<key>`` (verl's PolicyLossConfig), or verl's default."""
    section = config_value(config, "policy_loss")
    if isinstance(section, str):  # hybridlab's actor.policy_loss names the loss; settings sit beside it
        section = config
    return config_value(section, key, POLICY_LOSS_DEFAULTS.get(key))


def _clips(config: Any) -> tuple[float, float]:
    clip = config_value(config, "clip_ratio", 0.2)
    return config_value(config, "clip_ratio_low", clip), config_value(config, "clip_ratio_high", clip)


def _aggregate(pg_losses, response_mask, mode, config, rollout_is_weights, share) -> torch.Tensor:
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    return agg_loss(pg_losses, response_mask, mode, **agg_settings(config), **share)


def _float(x) -> float:
    return float(x.detach()) if isinstance(x, torch.Tensor) else float(x)


def _metrics(clipfrac, ppo_kl, clipfrac_lower=0.0) -> dict:
    return {"actor/pg_clipfrac": _float(clipfrac), "actor/ppo_kl": _float(ppo_kl),
            "actor/pg_clipfrac_lower": _float(clipfrac_lower)}


@register_policy_loss("gspo")
def compute_policy_loss_gspo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="seq-mean-token-mean",
                             config=None, rollout_is_weights=None, **share):
    """GSPO: one importance ratio per sequence, exp(mean token log-ratio), clipped as PPO's; each
    token's gradient flows through its own log-prob. Returns (loss, metrics)."""
    low, high = _clips(config)
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = (log_ratio * response_mask).sum(-1) / response_mask.sum(-1).clamp(min=1)
    # value: the sequence's ratio; gradient: d log_prob of each token
    log_seq_ratio = torch.clamp(log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1), max=10.0)
    seq_ratio = torch.exp(log_seq_ratio)
    losses1 = -advantages * seq_ratio
    losses2 = -advantages * torch.clamp(seq_ratio, 1 - low, 1 + high)
    pg_loss = _aggregate(torch.maximum(losses1, losses2), response_mask, loss_agg_mode, config, rollout_is_weights,
                         share)
    return pg_loss, _metrics(masked_mean(torch.gt(losses2, losses1).float(), response_mask),
                             masked_mean(-log_ratio, response_mask))


@register_policy_loss("sapo")
def compute_policy_loss_sapo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="seq-mean-token-mean",
                             config=None, rollout_is_weights=None, **share):
    """SAPO: the ratio passes through a sigmoid gate, 4/tau x sigmoid(tau (ratio - 1)), with
    tau_pos for positive and tau_neg for other advantages; always seq-mean-token-mean, as verl.
    Returns (loss, metrics)."""
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    tau_pos = torch.as_tensor(config_value(config, "tau_pos", 1.0), dtype=advantages.dtype)
    tau_neg = torch.as_tensor(config_value(config, "tau_neg", 1.05), dtype=advantages.dtype)
    tau = torch.where(advantages > 0, tau_pos, tau_neg)
    gates = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    pg_loss = _aggregate(-gates * advantages, response_mask, "seq-mean-token-mean", config, rollout_is_weights, share)
    return pg_loss, _metrics(0.0, masked_mean(-log_ratio, response_mask))


@register_policy_loss("gpg")
def compute_policy_loss_gpg(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                            config=None, rollout_is_weights=None, **share):
    """GPG: the plain policy gradient, -log_prob x advantage, no ratio; returns (loss, {})."""
    return _aggregate(-log_prob * advantages, response_mask, loss_agg_mode, config, rollout_is_weights, share), {}


@register_policy_loss("geo_mean")
def compute_policy_loss_geo_mean(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                 config=None, rollout_is_weights=None, **share):
    """GMPO: per sequence, the geometric mean of the token ratios with each token's log-ratio
    clipped to [-clip_low, clip_high] on the side its advantage's sign makes pessimistic, times
    the sequence's mean advantage; averaged over sequences (``loss_agg_mode`` is not used, as in
    verl). Returns (loss, metrics)."""
    low, high = _clips(config)
    log_ratio = log_prob - old_log_prob
    sign = torch.sign(advantages)
    clamped = torch.clamp(log_ratio, -low, high)
    pessimistic = sign * torch.min(sign * log_ratio, sign * clamped)
    lengths = response_mask.sum(-1)
    seq_ratio = torch.exp((pessimistic * response_mask).sum(-1) / (lengths + 1e-8))
    seq_advantage = (advantages * response_mask).sum(-1) / (lengths + 1e-8)
    pg_losses = -seq_advantage * seq_ratio
    if rollout_is_weights is not None:  # their geometric mean per sequence
        pg_losses = pg_losses * torch.exp((torch.log(rollout_is_weights + 1e-10) * response_mask).sum(-1)
                                          / (lengths + 1e-8))
    seqs = share.get("global_seqs")
    pg_loss = pg_losses.mean() if seqs is None else pg_losses.sum() / seqs
    clipped = torch.ne(log_ratio, clamped)
    return pg_loss, _metrics(masked_mean((clipped * (advantages > 0)).float(), response_mask),
                             masked_mean(-log_ratio, response_mask),
                             masked_mean((clipped * (advantages < 0)).float(), response_mask))


@register_policy_loss("cispo")
def compute_policy_loss_cispo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                              config=None, rollout_is_weights=None, **share):
    """CISPO: the importance ratio clipped and stopped (no gradient through it) weights
    -advantage x log_prob, so clipped tokens still get a gradient. Returns (loss, metrics)."""
    low, high = _clips(config)
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - low, 1 + high)
    pg_loss = _aggregate(-clipped.detach() * advantages * log_prob, response_mask, loss_agg_mode, config,
                         rollout_is_weights, share)
    return pg_loss, _metrics(masked_mean((ratio != clipped).float(), response_mask),
                             masked_mean(-log_ratio, response_mask))


@register_policy_loss("dro")
def compute_policy_loss_dro(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                            config=None, rollout_is_weights=None, **share):
    """DRO: -(log_prob x advantage - beta/2 x log-ratio^2), beta = ``policy_loss.dro_beta``
    (required, positive). Returns (loss, metrics)."""
    beta = loss_setting(config, "dro_beta")
    if beta is None or beta <= 0:
        raise ValueError(f"policy_loss.dro_beta must be a positive number for the dro loss, got {beta}")
    log_ratio = log_prob - old_log_prob
    pg_losses = -(log_prob * advantages - 0.5 * beta * log_ratio.square())
    pg_loss = _aggregate(pg_losses, response_mask, loss_agg_mode, config, rollout_is_weights, share)
    return pg_loss, {"actor/ppo_kl": _float(masked_mean(-log_ratio, response_mask))}


def _centred_covariance(advantages, log_prob, response_mask) -> torch.Tensor:
    return (advantages - masked_mean(advantages, response_mask)) * \
        (log_prob - masked_mean(log_prob.detach(), response_mask))


@register_policy_loss("clip_cov")
def compute_policy_loss_clip_cov(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                 config=None, rollout_is_weights=None, **share):
    """Clip-Cov: PPO's clipped loss, with the gradient cut (loss x 0) for a random
    ``clip_cov_ratio`` share of the unclipped tokens whose advantage-log-prob covariance lies in
    (clip_cov_lb, clip_cov_ub). Draws from torch's global RNG, as verl. Returns (loss, metrics)."""
    ratio_share = loss_setting(config, "clip_cov_ratio")
    if not ratio_share > 0:
        raise ValueError(f"policy_loss.clip_cov_ratio must be positive, got {ratio_share}")
    low, high = _clips(config)
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    losses1 = -advantages * ratio
    losses2 = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    cov = _centred_covariance(advantages, log_prob, response_mask)
    valid = response_mask > 0
    clipped_already = (losses2 > losses1) & valid
    in_band = (cov < loss_setting(config, "clip_cov_ub")) & (cov > loss_setting(config, "clip_cov_lb")) & valid & \
        ~clipped_already
    candidates = torch.nonzero(in_band)
    keep = torch.ones_like(advantages)
    if len(candidates) > 0:
        count = max(int(ratio_share * response_mask.sum().item()), 1)
        chosen = candidates[torch.randperm(len(candidates))[:min(count, len(candidates))]]
        keep[chosen[:, 0], chosen[:, 1]] = 0
    pg_loss = _aggregate(torch.maximum(losses1, losses2) * keep, response_mask, loss_agg_mode, config,
                         rollout_is_weights, share)
    return pg_loss, {"actor/pg_clipfrac": _float(masked_mean((keep == 0).float(), response_mask)),
                     "actor/ppo_kl": _float(masked_mean(-log_ratio, response_mask))}


@register_policy_loss("kl_cov")
def compute_policy_loss_kl_cov(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                               config=None, rollout_is_weights=None, **share):
    """KL-Cov: the unclipped ratio loss, plus ``ppo_kl_coef`` x |log-ratio| on the
    ``kl_cov_ratio`` share of tokens with the largest advantage-log-prob covariance (at least
    one). Returns (loss, metrics)."""
    ratio_share = loss_setting(config, "kl_cov_ratio")
    if not ratio_share > 0:
        raise ValueError(f"policy_loss.kl_cov_ratio must be positive, got {ratio_share}")
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    pg_losses = -advantages * ratio
    valid = response_mask > 0
    flat_valid = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
    adv, logp = advantages[valid].detach().reshape(-1), log_prob[valid].detach().reshape(-1)
    if len(adv):
        cov = (adv - adv.mean()) * (logp - logp.mean())
        top = flat_valid[torch.topk(cov, max(1, int(len(cov) * ratio_share)), largest=True).indices]
        rows, cols = top // advantages.shape[1], top % advantages.shape[1]
        penalized = pg_losses.clone()
        penalized[rows, cols] = pg_losses[rows, cols] + loss_setting(config, "ppo_kl_coef") * log_ratio.abs()[rows, cols]
        pg_losses = penalized
    pg_loss = _aggregate(pg_losses, response_mask, loss_agg_mode, config, rollout_is_weights, share)
    return pg_loss, {"actor/ppo_kl": _float(masked_mean(log_ratio.abs(), response_mask))}


def _dppo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights, share,
          inside_band) -> tuple[torch.Tensor, dict]:
    """DPPO's shared body: -advantage x ratio (truncated at clip_ratio_c, default 20, and
    stopped) x log_prob on the tokens ``inside_band(log_prob, old_log_prob, low, high)`` keeps
    (two masks: for positive and for other advantages)."""
    low, high = _clips(config)
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    cap = config_value(config, "clip_ratio_c", 20.0)
    keep_pos, keep_neg = inside_band(log_prob, old_log_prob, low, high)
    valid = torch.where(advantages > 0, keep_pos, keep_neg).detach().float()
    pg_losses = -advantages * torch.clamp(ratio, max=cap).detach() * log_prob * valid
    pg_loss = _aggregate(pg_losses, response_mask, loss_agg_mode, config, rollout_is_weights, share)
    return pg_loss, _metrics(masked_mean(1.0 - valid, response_mask), masked_mean(-log_ratio, response_mask),
                             masked_mean((ratio > cap).float() * valid, response_mask))


@register_policy_loss("dppo_tv")
def compute_policy_loss_dppo_tv(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                config=None, rollout_is_weights=None, **share):
    """DPPO-Binary-TV: the clip ratios bound the change of each token's probability, p - p_old,
    from above (positive advantage) or below (negative); tokens outside get no gradient.
    Returns (loss, metrics)."""
    def band(logp, logq, low, high):
        change = logp.exp() - logq.exp()
        return change <= high, change >= -low
    return _dppo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights, share,
                 band)


@register_policy_loss("dppo_kl")
def compute_policy_loss_dppo_kl(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                config=None, rollout_is_weights=None, **share):
    """DPPO-Binary-KL: as dppo_tv, with the band on the binary KL between Bernoulli(p_old) and
    Bernoulli(p) for moves in the advantage's direction. Returns (loss, metrics)."""
    def band(logp, logq, low, high):
        p, q = logp.exp(), logq.exp()
        binary_kl = q * (logq - logp) + (1 - q) * torch.log((1.0 - q + 1e-8) / (1.0 - p + 1e-8))
        return (binary_kl <= high) | (p <= q), (binary_kl <= low) | (p >= q)
    return _dppo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights, share,
                 band)


def compute_policy_loss_reinforce(rollout_log_prob, log_prob, advantages, response_mask,
                                  loss_agg_mode="seq-mean-token-sum", config=None, rollout_is_weights=None, **share):
    """REINFORCE: -advantage x log_prob, times the (stopped) IS weights when given; returns
    (loss, {"actor/ppo_kl": trainer-vs-rollout KL})."""
    pg_losses = -advantages * log_prob
    pg_loss = _aggregate(pg_losses, response_mask, loss_agg_mode, config, rollout_is_weights, share)
    return pg_loss, {"actor/ppo_kl": _float(masked_mean(rollout_log_prob - log_prob, response_mask))}


@register_policy_loss("bypass_mode")
def compute_policy_loss_bypass_mode(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                    config=None, rollout_is_weights=None, **share):
    """Bypass mode: ``old_log_prob`` is the rollout's (the ``rollout_as_old_logprob`` stage).
    IS weights and rejection come from the current policy against the rollout (settings under
    ``rollout_correction``); ``loss_type`` "ppo_clip" (default) runs PPO's loss on the kept tokens
    without the weights (its ratio already is one), "reinforce" the IS-weighted policy gradient.
    Passed-in ``rollout_is_weights`` are ignored. Returns (loss, metrics incl. rollout_corr/*)."""
    settings = loss_setting(config, "rollout_correction")
    if settings is None:
        raise ValueError("the bypass_mode policy loss needs rollout_correction settings (loss_type, rollout_is, "
                         "rollout_is_threshold, rollout_rs, rollout_rs_threshold)")
    loss_type = config_value(settings, "loss_type", "ppo_clip")
    if loss_type not in ("ppo_clip", "reinforce"):
        raise ValueError(f"rollout_correction.loss_type must be 'ppo_clip' or 'reinforce', got {loss_type!r}")
    with torch.no_grad():
        weights, mask, corr_metrics = compute_rollout_correction_and_rejection_mask(
            log_prob, old_log_prob, response_mask, rollout_is=config_value(settings, "rollout_is"),
            rollout_is_threshold=config_value(settings, "rollout_is_threshold", 2.0),
            rollout_is_batch_normalize=config_value(settings, "rollout_is_batch_normalize", False),
            rollout_rs=config_value(settings, "rollout_rs"), rollout_rs_threshold=config_value(settings, "rollout_rs_threshold"))
    if loss_type == "reinforce":
        pg_loss, metrics = compute_policy_loss_reinforce(old_log_prob, log_prob, advantages, mask, loss_agg_mode,
                                                         config, weights, **share)
    else:
        pg_loss, metrics = compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, mask, loss_agg_mode,
                                                       config, None, **share)
    return pg_loss, {**metrics, **corr_metrics}
