"""The stages that run the models over a step's sequences: the actor's log-probs before its
update (``old_logprob``, or the rollout's own with ``rollout_as_old_logprob``), the reference's
(``ref_logprob``) and the critic's values. ``stages.py`` lists them in the stage table.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hybridlab.algos.advantages import ADV_INPUTS
from hybridlab.algos.functional import masked_mean
from hybridlab.algos.rollout_correction import mismatch_metrics
from hybridlab.dataflow.fields import SEQUENCE_FIELDS
from hybridlab.protocol import Batch

if TYPE_CHECKING:
    from hybridlab.dataflow.context import StepContext


def wants_sum_pi_squared(cfg) -> bool:
    """True when the advantage estimator reads the actor's sum of p^2 (the optimal token baselines)."""
    return "sum_pi_squared" in ADV_INPUTS.get(cfg.algorithm.adv_estimator, ())


def old_logprob_outputs(cfg) -> tuple[str, ...]:
    """Return what ``old_logprob`` writes: the log-probs, the entropy, and the sum of p^2 where the
    advantage estimator reads it."""
    return ("old_log_probs", "entropy", *(("sum_pi_squared",) if wants_sum_pi_squared(cfg) else ()))


def old_logprob(ctx: StepContext, batch: Batch) -> tuple[Batch, dict]:
    """Log-probs (and entropy) of the sampled tokens under the actor before its update; with the
    rollout's log-probs at hand, the rollout-vs-trainer mismatch metrics (``rollout_corr/``)."""
    out = ctx.group("actor").compute_log_prob(batch.select(SEQUENCE_FIELDS, meta=False),
                                              sum_pi_squared=wants_sum_pi_squared(ctx.cfg))
    mask = batch["response_mask"].float()
    metrics = {"actor/entropy_before": float(masked_mean(out["entropy"], mask))}
    if "rollout_log_probs" in batch and mask.any():
        metrics.update({f"rollout_corr/{k}": v for k, v in
                        mismatch_metrics(out["old_log_probs"], batch["rollout_log_probs"], mask).items()})
    return out, metrics


def rollout_log_probs_inexact(cfg) -> list[str]:
    """Return why the rollout's log-probs are not the current policy's under ``cfg`` (empty:
    they are, so they may stand in for the old log-probs)."""
    fix = ("; use the old_logprob stage instead of rollout_as_old_logprob (or leave `dataflow` unset: the"
           " stages then follow the settings)")
    out = []
    if cfg.algorithm.rollout_correction.bypass_mode:  # the mismatch is accepted and corrected in the loss
        return out
    if cfg.trainer.off_policy or cfg.trainer.streaming:
        key = "trainer.off_policy" if cfg.trainer.off_policy else "trainer.streaming"
        out.append(f"{key}: off-policy samples come from older weights, so their rollout log-probs are"
                   " not the current policy's" + fix)
    r = cfg.rollout
    if (r.dtype, cfg.actor.precision) != ("float32", "fp32"):
        out.append(f"rollout.dtype={r.dtype}, actor.precision={cfg.actor.precision}: the rollout's log-probs are"
                   f" not computed as the actor's (only float32 on both sides agrees to 1e-5)" + fix)
    if r.top_p < 1 or r.top_k:  # vLLM's processed log-probs are then of the truncated distribution
        out.append(f"rollout.top_p={r.top_p}, rollout.top_k={r.top_k}: the rollout's log-probs are of the truncated"
                   f" distribution, not the actor's" + fix)
    return out


def rollout_as_old_logprob(ctx: StepContext, batch: Batch) -> tuple[Batch, dict]:
    """Use the rollout engine's log-probs as the old policy's (saves a forward pass; exact when
    the rollout holds the actor's current weights, which each step's weight sync ensures)."""
    return Batch({"old_log_probs": batch["rollout_log_probs"]}), {}


def ref_logprob(ctx: StepContext, batch: Batch) -> tuple[Batch, dict]:
    """Log-probs of the sampled tokens under the frozen reference model."""
    if len(batch) == 0:  # nothing left to score (online DPO's step without a pair)
        return Batch({"ref_log_prob": torch.zeros(batch["responses"].shape)}), {}
    return ctx.group("ref").compute_ref_log_prob(batch.select(SEQUENCE_FIELDS, meta=False)), {}


def values(ctx: StepContext, batch: Batch) -> tuple[Batch, dict]:
    """The critic's value of each response position."""
    out = ctx.group("critic").compute_values(batch.select(SEQUENCE_FIELDS, meta=False))
    return out, {"critic/values_mean": float(masked_mean(out["values"], batch["response_mask"].float()))}
