"""The stages on the controller's math and the updates: rollout correction, the KL penalty in the
reward, advantages, the critic's and the actor's optimizer steps, and the weight sync to the
rollout. ``stages.py`` lists them in the stage table.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from hybridlab.algos.advantages import ADV_INPUTS, OPTIONAL_ADV_INPUTS, compute_advantage
from hybridlab.algos.kl import apply_kl_penalty
from hybridlab.algos.objectives import actor_loss, critic_loss
from hybridlab.algos.rollout_correction import compute_rollout_correction_and_rejection_mask
from hybridlab.config.schema import config_fields
from hybridlab.config.training import ActorConfig
from hybridlab.dataflow.fields import SEQUENCE_FIELDS, mean_metrics, summary_stats
from hybridlab.faults import fault_point
from hybridlab.protocol import Batch

if TYPE_CHECKING:
    from hybridlab.dataflow.context import StepContext


def correction_outputs(cfg) -> tuple[str, ...]:
    """Return what rollout_correction writes: the response mask, and IS weights where asked for."""
    return ("response_mask", *(("rollout_is_weights",) if cfg.algorithm.rollout_correction.rollout_is else ()))


def rollout_correction(ctx: StepContext, batch: Batch) -> tuple[Batch, dict]:
    """Rollout correction (algorithm.rollout_correction): IS weights of the trainer's old
    log-probs against the rollout's, and rejection of tokens and sequences whose mismatch is
    past the thresholds (they leave the response mask)."""
    c = ctx.cfg.algorithm.rollout_correction
    weights, mask, metrics = compute_rollout_correction_and_rejection_mask(
        batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"], rollout_is=c.rollout_is,
        rollout_is_threshold=c.rollout_is_threshold, rollout_is_batch_normalize=c.rollout_is_batch_normalize,
        rollout_rs=c.rollout_rs, rollout_rs_threshold=c.rollout_rs_threshold)
    out = {"response_mask": mask}
    if weights is not None:
        out["rollout_is_weights"] = weights
    return Batch(out), metrics


def kl_reward(ctx: StepContext, batch: Batch) -> tuple[Batch, dict]:
    """Subtract beta x KL(actor || reference) per token from the scores (fixed or adaptive beta)."""
    rewards, metrics = apply_kl_penalty(batch["token_level_scores"], batch["old_log_probs"], batch["ref_log_prob"],
                                        batch["response_mask"], ctx.state.kl_ctrl, ctx.cfg.algorithm.kl_penalty)
    return Batch({"token_level_rewards": rewards}), metrics


def advantage_inputs(cfg) -> tuple[str, ...]:
    """Return the fields the configured advantage estimator reads (GDPO's reward components too)."""
    algo = cfg.algorithm
    components = ("reward_extra_info", "prompts", "attention_mask") if algo.adv_estimator == "gdpo" and \
        algo.gdpo_reward_keys else ()
    return ("token_level_rewards", "response_mask", *ADV_INPUTS[algo.adv_estimator], *components)


def advantages(ctx: StepContext, batch: Batch) -> tuple[Batch, dict]:
    """Advantages and returns with the configured estimator (algorithm.adv_estimator)."""
    algo = ctx.cfg.algorithm
    wanted = (*advantage_inputs(ctx.cfg), *OPTIONAL_ADV_INPUTS.get(algo.adv_estimator, ()))
    fields = {k: batch[k] for k in wanted if k in batch}
    adv, ret = compute_advantage(algo.adv_estimator, fields, algo)
    mask = batch["response_mask"].bool()
    return Batch({"advantages": adv, "returns": ret}), {**summary_stats("advantages", adv[mask]),
                                                       **summary_stats("returns", ret[mask])}


def mini_batches(batch: Batch, prompts: int, n: int, epochs: int) -> list[Batch]:
    """Return the optimizer steps' mini-batches: ``prompts`` x ``n`` rows each, over ``epochs``
    passes; each pass repeats the first one's objects, so a call sends each mini-batch once."""
    rows = max(1, prompts * n)
    return [batch.take(slice(s, s + rows)) for s in range(0, len(batch), rows)] * epochs


def run_updates(method, batches: list[Batch], loss) -> list[list[dict]]:
    """Run every mini-batch's optimizer step, in order, in one call to each process; returns
    each mini-batch's results, one per data-parallel rank.

    One call a step rather than one a mini-batch: even with the next update already sent, Ray
    took 1.3 to 4 ms between two on this machine (the more the cores are shared, the longer),
    12 ms of a tiny model's 0.4 s step of 4 updates beside a busy engine and 19 ms of a 0.85 s
    step of 16 (``bench async``'s workloads). A failed step stops the ones after it in its
    process, whose error the call raises."""
    per_rank = method(batches, loss)
    return [[answers[i] for answers in per_rank] for i in range(len(batches))]


def update_critic(ctx: StepContext, batch: Batch) -> tuple[None, dict]:
    """Optimizer steps of the clipped value loss over mini-batches and epochs."""
    c = ctx.cfg.critic
    loss = critic_loss({"cliprange_value": c.cliprange_value, "loss_agg_mode": c.loss_agg_mode})
    data = batch.select([*SEQUENCE_FIELDS, "values", "returns"], meta=False)
    results = run_updates(ctx.group("critic").update_critic, mini_batches(data, c.ppo_mini_batch_size,
                                                                          ctx.cfg.rollout.n, c.ppo_epochs), loss)
    metrics = mean_metrics(results)
    return None, {(k if k.startswith("critic/") else f"critic/{k}"): v for k, v in metrics.items()}


def actor_fields(cfg) -> tuple[str, ...]:
    """Return the fields the actor's update reads (the reference's log-probs with a KL loss, the
    rollout-correction weights in decoupled mode)."""
    c = cfg.algorithm.rollout_correction
    weights = c.rollout_is and not c.bypass_mode  # decoupled mode: the stage's weights scale the loss
    return (*SEQUENCE_FIELDS, "old_log_probs", "advantages", *(("ref_log_prob",) if cfg.actor.use_kl_loss else ()),
            *(("rollout_is_weights",) if weights else ()))


# The actor settings its policy loss reads, as the schema declares them (``setting(loss=True)``).
ACTOR_LOSS_SETTINGS = tuple(key.removeprefix("actor.") for key, f in config_fields(ActorConfig, "actor.")
                            if f.metadata.get("loss"))


def actor_loss_settings(cfg) -> dict:
    """Return the settings the actor's loss reads: the actor's, and in bypass mode the loss
    ``bypass_mode`` with the rollout-correction section (as verl's trainer sets them)."""
    settings = {k: getattr(cfg.actor, k) for k in ACTOR_LOSS_SETTINGS}
    c = cfg.algorithm.rollout_correction
    if c.bypass_mode:
        settings.update(policy_loss="bypass_mode", rollout_correction=dataclasses.asdict(c))
    return settings


def update_actor(ctx: StepContext, batch: Batch) -> tuple[None, dict]:
    """Optimizer steps of the policy loss (+ KL loss, entropy bonus) over mini-batches and epochs;
    none in the run's first ``trainer.critic_warmup`` steps (the critic learns first)."""
    if ctx.state.step_count < ctx.cfg.trainer.critic_warmup:
        ctx.actor_unchanged = True  # so the weight sync is skipped too
        return None, {"actor/critic_warmup": 1}
    a = ctx.cfg.actor
    loss = actor_loss(actor_loss_settings(ctx.cfg))
    data = batch.select(actor_fields(ctx.cfg), meta=False)
    results = run_updates(ctx.group("actor").update_actor, mini_batches(data, a.ppo_mini_batch_size,
                                                                        ctx.cfg.rollout.n, a.ppo_epochs), loss)
    metrics = mean_metrics(results)
    ctx.actor_unchanged = not results or metrics.get("skipped", 0.0) == len(results)
    fault_point("update_actor", ctx.state.step_count + 1)
    return None, {(k if k.startswith(("actor/", "rollout_corr/")) else f"actor/{k}"): v for k, v in metrics.items()}


def sync_weights(ctx: StepContext, batch: Batch) -> tuple[None, dict]:
    """Reshard the actor's new weights into the rollout engines, bucket by bucket (not after a
    step whose every update was skipped for a NaN or inf: the engines already hold those weights)."""
    if ctx.actor_unchanged:
        return None, {"sync/bytes": 0, "sync/skipped": 1}
    report = ctx.sync()
    return None, {"sync/bytes": report.bytes_moved, "sync/seconds": report.seconds, "sync/buckets": report.buckets}
