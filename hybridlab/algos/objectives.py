"""The actor and critic objectives handed to the Megatron engine's ``train_step``.

They follow the engine's loss contract (see ``workers/train/engine.py``): each call sees one
micro-batch and returns its share of the mini-batch loss, plus metrics. Settings arrive as a
plain dict so the objective pickles to the workers by reference: every one the schema declares
with ``setting(loss=True)`` (``update_stages.actor_loss_settings``), defaults included there.
"""
from __future__ import annotations

from functools import partial

import torch

from hybridlab.algos.functional import masked_mean
from hybridlab.algos.losses import agg_loss, compute_value_loss, get_policy_loss_fn, kl_penalty


def _scale(micro: dict) -> torch.Tensor:
    # Metrics are averaged over micro-batches and DP ranks; a share times their count averages
    # back to the mini-batch value.
    return micro["num_microbatches"] * micro.get("dp_size", 1)


def actor_objective(cfg: dict, outputs: dict, micro: dict) -> tuple[torch.Tensor, dict]:
    """PPO-style policy loss with optional entropy bonus and KL-to-reference loss; returns
    (this micro-batch's share of the loss, metrics)."""
    share = {"global_tokens": micro["global_tokens"], "global_seqs": micro["global_seqs"]}
    mask, log_prob, mode = micro["response_mask"].float(), outputs["log_probs"], cfg["loss_agg_mode"]
    policy_loss = get_policy_loss_fn(cfg["policy_loss"])
    scale = {"loss_scale_factor": cfg["loss_scale_factor"]} if cfg["loss_scale_factor"] else {}
    policy_cfg = {**cfg, "global_batch_info": scale}  # the totals arrive as this micro-batch's share
    pg_loss, pg_metrics = policy_loss(micro["old_log_probs"], log_prob, micro["advantages"], mask, mode, policy_cfg,
                                      micro.get("rollout_is_weights"), **share)
    loss = pg_loss
    metrics = {"actor/pg_loss": pg_loss.detach() * _scale(micro), **pg_metrics,
               "actor/entropy": masked_mean(outputs["entropy"].detach(), mask)}
    if cfg["entropy_coeff"]:
        loss = loss - cfg["entropy_coeff"] * agg_loss(outputs["entropy"], mask, mode, **scale, **share)
    if cfg["use_kl_loss"]:
        kl = kl_penalty(log_prob, micro["ref_log_prob"], cfg["kl_loss_type"])
        kl_loss = agg_loss(kl, mask, mode, **scale, **share)
        loss = loss + cfg["kl_loss_coef"] * kl_loss
        metrics["actor/kl_loss"] = kl_loss.detach() * _scale(micro)
    return loss, metrics


def critic_objective(cfg: dict, outputs: dict, micro: dict) -> tuple[torch.Tensor, dict]:
    """Clipped value loss; returns (this micro-batch's share, metrics)."""
    share = {"global_tokens": micro["global_tokens"], "global_seqs": micro["global_seqs"]}
    mask = micro["response_mask"].float()
    vf_loss, vf_clipfrac = compute_value_loss(outputs["values"], micro["returns"], micro["values"], mask,
                                              cfg["cliprange_value"], cfg["loss_agg_mode"], **share)
    return vf_loss, {"critic/vf_loss": vf_loss.detach() * _scale(micro), "critic/vf_clipfrac": vf_clipfrac,
                     "critic/vpred_mean": masked_mean(outputs["values"].detach(), mask)}


def actor_loss(cfg: dict):
    """Return the engine loss function for the actor with settings ``cfg``."""
    return partial(actor_objective, dict(cfg))


def critic_loss(cfg: dict):
    """Return the engine loss function for the critic with settings ``cfg``."""
    return partial(critic_objective, dict(cfg))
