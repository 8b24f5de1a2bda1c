"""The stages an RL step is made of, each bound to a role, with declared inputs and outputs.

A stage function takes (ctx, batch) and returns (new fields as a Batch or None, metrics).
A stage with ``replaces_rows`` returns the whole new batch instead (generate repeats each
prompt n times; DAPO's filter drops groups). Outputs starting with ``@`` are markers, not
fields: they order stages that touch no common field (sync after the actor update).
Stages are registered by name, so a dataflow is a list of strings a config or a notebook
can edit; ``register_stage`` adds your own.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable

import torch

from hybridlab.algos.advantages import ADV_INPUTS, OPTIONAL_ADV_INPUTS, compute_advantage
from hybridlab.algos.dapo import informative_groups, overlong_penalty
from hybridlab.algos.functional import masked_mean
from hybridlab.algos.kl import apply_kl_penalty
from hybridlab.algos.objectives import actor_loss, critic_loss
from hybridlab.algos.rollout_correction import compute_rollout_correction_and_rejection_mask, mismatch_metrics
from hybridlab.config.schema import ActorConfig, config_fields
from hybridlab.batching import PROMPT_WIDTH, concat_sequences, on_last_token
from hybridlab.errors import unknown
from hybridlab.faults import fault_point
from hybridlab.dataflow.fields import SEQUENCE_FIELDS, mean_metrics
from hybridlab.protocol import Batch

if TYPE_CHECKING:
    from hybridlab.dataflow.context import StepContext

StageFn = Callable[["StepContext", Batch], tuple[Batch | None, dict]]
REWARD_FIELDS = ("responses", "response_mask", "ground_truth", "data_source")  # what scoring reads


def reward_inputs(batch: Batch) -> list[str]:
    """Return the fields a batch's scoring reads: ``REWARD_FIELDS``, plus the row's ``extra_info``
    and an agent trajectory's ``final_response`` where the batch has them."""
    return [*REWARD_FIELDS, *(k for k in ("extra_info", "final_response") if k in batch)]


@dataclasses.dataclass(frozen=True)
class Stage:
    """One node of the dataflow: ``fn`` runs against ``role``'s workers (None: the controller)."""

    name: str
    role: str | None
    inputs: Callable[[Any], tuple[str, ...]]
    outputs: Callable[[Any], tuple[str, ...]]
    fn: StageFn
    replaces_rows: bool = False
    needs: tuple[str, ...] = ()        # other roles the stage uses (sync_weights: rollout)
    doc: str = ""
    check: Callable[[Any], list[str]] | None = None  # settings under which the stage is wrong: reasons


STAGES: dict[str, Stage] = {}


def register_stage(name: str, role: str | None, inputs, outputs, replaces_rows: bool = False,
                   needs: tuple[str, ...] = (), check: Callable[[Any], list[str]] | None = None):
    """Decorator: register ``fn`` as stage ``name``. ``inputs``/``outputs`` are field tuples or
    functions of the RunConfig returning them; ``check(cfg)`` returns the reasons the stage must
    not run under a config (validation reports them). Returns the function."""
    as_fn = (lambda v: v if callable(v) else (lambda cfg, v=tuple(v): v))
    def decorator(fn: StageFn) -> StageFn:
        STAGES[name] = Stage(name, role, as_fn(inputs), as_fn(outputs), fn, replaces_rows, needs,
                             (fn.__doc__ or "").strip().split("\n")[0], check)
        return fn
    return decorator


def get_stage(name: str) -> Stage:
    """Return the registered stage ``name``; the error lists the stage names."""
    if name not in STAGES:
        raise unknown("dataflow stage", name, STAGES)
    return STAGES[name]


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    values = values.float()
    return {f"{prefix}/mean": float(values.mean()), f"{prefix}/std": float(values.std()) if len(values) > 1 else 0.0,
            f"{prefix}/max": float(values.max()), f"{prefix}/min": float(values.min())}


# ---------------------------------------------------------------- rollout
@register_stage("generate", "rollout", ("prompt_ids", "uid"),
                ("prompts", *SEQUENCE_FIELDS, "rollout_log_probs"), replaces_rows=True)
def generate(ctx: "StepContext", batch: Batch) -> tuple[Batch, dict]:
    """Sample rollout.n responses per prompt on the rollout engines. With trainer.off_policy,
    take the responses generated ahead (at most trainer.max_staleness updates stale) and submit
    this step's prompts ahead (dataflow/ahead.py)."""
    if ctx.cfg.trainer.off_policy and not ctx.rerunning:
        out, staleness = ctx.rl.ahead.take(ctx, batch)
    else:
        out, staleness = ctx.group("rollout").generate(batch, ctx.sampling()), 0
    fault_point("generate", ctx.rl.step_count + 1)
    return out, {**generation_metrics(ctx.cfg, out), "rollout/staleness": staleness}


def generation_metrics(cfg, out: Batch) -> dict:
    """Return response-length statistics of a generated batch: mean, min, p10, p50, p90, max,
    the clipped share, tokens, and ``rollout/straggler_share``: the share of the call's decode
    steps in which only its longest 10% of sequences were still generating, ``(max - p90) /
    max`` (the engine decodes all live sequences together, one token per step)."""
    lengths = out["response_mask"].sum(-1).float()
    p10, p50, p90 = (float(q) for q in torch.quantile(lengths, torch.tensor([0.1, 0.5, 0.9])))
    longest = float(lengths.max())
    return {"response_length/mean": float(lengths.mean()), "response_length/max": longest,
            "response_length/min": float(lengths.min()), "response_length/p10": p10, "response_length/p50": p50,
            "response_length/p90": p90,
            "response_length/clip_ratio": float((lengths >= cfg.rollout.max_new_tokens).float().mean()),
            "rollout/straggler_share": (longest - p90) / longest if longest else 0.0,
            "rollout/tokens": int(lengths.sum())}


@register_stage("reward", "reward", REWARD_FIELDS,
                ("token_level_scores", "token_level_rewards", "acc", "reward_extra_info"))
def reward(ctx: "StepContext", batch: Batch) -> tuple[Batch, dict]:
    """Score each response with the configured rule or function (a raising one scores error_score)."""
    out = ctx.group("reward").compute_reward(batch.select(reward_inputs(batch)))
    return _finish_reward(ctx, batch, out)


@register_stage("reward_model", "reward", ("input_ids", "attention_mask", "position_ids", "response_mask"),
                ("token_level_scores", "token_level_rewards", "acc", "reward_extra_info"))
def reward_model(ctx: "StepContext", batch: Batch) -> tuple[Batch, dict]:
    """Score each sequence with the reward model at reward.model (loaded on first use)."""
    if not ctx.cfg.reward.model:
        raise ValueError("the reward_model stage needs reward.model (a sequence-classification checkpoint)")
    fields = [*SEQUENCE_FIELDS, "ground_truth", "data_source"]
    out = ctx.group("reward").compute_model_reward(batch.select(fields), ctx.cfg.reward.model)
    return _finish_reward(ctx, batch, out)


def _finish_reward(ctx: "StepContext", batch: Batch, out: Batch) -> tuple[Batch, dict]:
    scores = out["token_level_scores"]
    metrics = _stats("reward", scores.sum(-1))
    metrics["accuracy"] = float(torch.nanmean(out["acc"])) if len(out) else 0.0
    if "reward_error" in out:
        errors = out["reward_error"]
        metrics["reward/errors"] = int(errors.sum())
        sources = batch.objects.get("data_source", [""] * len(errors))
        for source in sorted({s for s, e in zip(sources, errors.tolist()) if e}):
            metrics[f"reward/errors/{source}"] = sum(1 for s, e in zip(sources, errors.tolist()) if e and s == source)
            if source not in ctx.rl.reward_error_sources:  # warned once per data source; counted every step
                ctx.rl.reward_error_sources.add(source)
                first = next(m for s, m in zip(sources, out["reward_error_msg"]) if m and s == source)
                ctx.warn(f"reward function failed on {metrics[f'reward/errors/{source}']} of {len(errors)} samples"
                         f" of {source!r} (scored reward.error_score={ctx.cfg.reward.error_score}; counted in"
                         f" reward/errors/{source}, warned once); first: {first}")
    overlong = ctx.cfg.algorithm.overlong_buffer
    if overlong.enable:
        lengths = batch["response_mask"].sum(-1)
        penalty = overlong_penalty(lengths, ctx.cfg.rollout.max_new_tokens, overlong.len, overlong.penalty_factor)
        scores = scores + on_last_token(penalty, batch["response_mask"])
        metrics["reward/overlong_penalty"] = float(penalty.mean())
    components = out.objects.get("reward_extra_info") or [{} for _ in range(len(out))]
    for key in sorted({k for parts in components for k in parts}):
        values = [parts[key] for parts in components if key in parts]
        metrics[f"reward/{key}/mean"] = sum(values) / len(values)
    return Batch({"token_level_scores": scores, "token_level_rewards": scores, "acc": out["acc"]},
                 {"reward_extra_info": components}), metrics


def _scoring_stages(names: list[str], cfg) -> list[str]:
    """Return the stages of a dataflow that make its scored samples (what filter_groups runs again):
    those before filter_groups, or (run by hand) those up to the first that writes scores."""
    if "filter_groups" in names:
        return names[:names.index("filter_groups")]
    return names[:1 + next(i for i, n in enumerate(names) if "token_level_scores" in get_stage(n).outputs(cfg))]


@register_stage("filter_groups", None, ("token_level_scores", "uid"), (), replaces_rows=True,
                needs=("rollout", "reward"))
def filter_groups(ctx: "StepContext", batch: Batch) -> tuple[Batch, dict]:
    """DAPO dynamic sampling: keep groups whose rewards differ, generating more prompts to refill."""
    want = ctx.cfg.data.prompts_per_step
    rollout = _scoring_stages(ctx.rl.dataflow.names, ctx.cfg)
    kept, rounds, seen = None, 0, 0
    current = batch
    while True:
        rounds += 1
        good = set(informative_groups(current["uid"], current["token_level_scores"].sum(-1)))
        seen += len(set(current["uid"]))
        part = current.take([i for i, u in enumerate(current["uid"]) if u in good])
        kept = part if kept is None else concat_sequences([kept, part])  # rounds may pad prompts differently
        if len(set(kept["uid"])) >= want or rounds >= ctx.cfg.algorithm.filter_groups.max_num_gen_batches:
            break
        current = ctx.rerun_rollout(rollout)
    uids = list(dict.fromkeys(kept["uid"]))[:want]
    if not uids:  # nothing informative: train on the last batch rather than on nothing
        ctx.warn("filter_groups: every group had equal rewards; keeping the unfiltered batch")
        return batch, {"filter_groups/kept_prompts": 0, "filter_groups/generation_rounds": rounds}
    keep = set(uids)
    kept = kept.take([i for i, u in enumerate(kept["uid"]) if u in keep])
    return kept, {"filter_groups/kept_prompts": len(uids), "filter_groups/generation_rounds": rounds,
                  "filter_groups/kept_fraction": len(uids) / max(1, seen)}


@register_stage("remax_baseline", "rollout", ("prompt_ids", "uid"), ("reward_baselines",), needs=("reward",))
def remax_baseline(ctx: "StepContext", batch: Batch) -> tuple[Batch, dict]:
    """ReMax: reward of each prompt's greedy response, the per-prompt baseline."""
    firsts = list({u: i for i, u in reversed(list(enumerate(batch["uid"])))}.values())
    prompts = batch.select(["prompt_ids", "uid", "ground_truth", "data_source"]).take(sorted(firsts))
    prompts.meta[PROMPT_WIDTH] = max(len(p) for p in prompts["prompt_ids"])  # rollout DP ranks pad alike
    greedy = ctx.group("rollout").generate(prompts, ctx.sampling(n=1, temperature=0.0))
    scored = ctx.group("reward").compute_reward(greedy.select(reward_inputs(greedy)))
    by_uid = dict(zip(greedy["uid"], scored["token_level_scores"].sum(-1).tolist()))
    baselines = torch.tensor([by_uid[u] for u in batch["uid"]], dtype=torch.float32)
    return Batch({"reward_baselines": baselines}), {"reward/greedy_baseline_mean": float(baselines.mean())}


# ------------------------------------------------------------ model passes
def wants_sum_pi_squared(cfg) -> bool:
    """True when the advantage estimator reads the actor's sum of p^2 (the optimal token baselines)."""
    return "sum_pi_squared" in ADV_INPUTS.get(cfg.algorithm.adv_estimator, ())


@register_stage("old_logprob", "actor", SEQUENCE_FIELDS,
                lambda cfg: ("old_log_probs", "entropy", *(("sum_pi_squared",) if wants_sum_pi_squared(cfg) else ())))
def old_logprob(ctx: "StepContext", batch: Batch) -> tuple[Batch, dict]:
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
    if cfg.trainer.off_policy:
        out.append("trainer.off_policy: off-policy samples come from older weights, so their rollout log-probs are"
                   " not the current policy's" + fix)
    r = cfg.rollout
    if (r.dtype, cfg.actor.precision) != ("float32", "fp32"):
        out.append(f"rollout.dtype={r.dtype}, actor.precision={cfg.actor.precision}: the rollout's log-probs are"
                   f" not computed as the actor's (only float32 on both sides agrees to 1e-5)" + fix)
    if r.top_p < 1 or r.top_k:  # vLLM's processed log-probs are then of the truncated distribution
        out.append(f"rollout.top_p={r.top_p}, rollout.top_k={r.top_k}: the rollout's log-probs are of the truncated"
                   f" distribution, not the actor's" + fix)
    return out


@register_stage("rollout_as_old_logprob", None, ("rollout_log_probs",), ("old_log_probs",),
                check=rollout_log_probs_inexact)
def rollout_as_old_logprob(ctx: "StepContext", batch: Batch) -> tuple[Batch, dict]:
    """Use the rollout engine's log-probs as the old policy's (saves a forward pass; exact when
    the rollout holds the actor's current weights, which each step's weight sync ensures)."""
    return Batch({"old_log_probs": batch["rollout_log_probs"]}), {}


@register_stage("ref_logprob", "ref", SEQUENCE_FIELDS, ("ref_log_prob",))
def ref_logprob(ctx: "StepContext", batch: Batch) -> tuple[Batch, dict]:
    """Log-probs of the sampled tokens under the frozen reference model."""
    if len(batch) == 0:  # nothing left to score (online DPO's step without a pair)
        return Batch({"ref_log_prob": torch.zeros(batch["responses"].shape)}), {}
    return ctx.group("ref").compute_ref_log_prob(batch.select(SEQUENCE_FIELDS, meta=False)), {}


@register_stage("values", "critic", SEQUENCE_FIELDS, ("values",))
def values(ctx: "StepContext", batch: Batch) -> tuple[Batch, dict]:
    """The critic's value of each response position."""
    out = ctx.group("critic").compute_values(batch.select(SEQUENCE_FIELDS, meta=False))
    return out, {"critic/values_mean": float(masked_mean(out["values"], batch["response_mask"].float()))}


# --------------------------------------------------------- controller math
def _correction_outputs(cfg) -> tuple[str, ...]:
    return ("response_mask", *(("rollout_is_weights",) if cfg.algorithm.rollout_correction.rollout_is else ()))


@register_stage("rollout_correction", None, ("old_log_probs", "rollout_log_probs", "response_mask"),
                _correction_outputs)
def rollout_correction(ctx: "StepContext", batch: Batch) -> tuple[Batch, dict]:
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


@register_stage("kl_reward", None, ("token_level_scores", "old_log_probs", "ref_log_prob", "response_mask"),
                ("token_level_rewards",))
def kl_reward(ctx: "StepContext", batch: Batch) -> tuple[Batch, dict]:
    """Subtract beta x KL(actor || reference) per token from the scores (fixed or adaptive beta)."""
    rewards, metrics = apply_kl_penalty(batch["token_level_scores"], batch["old_log_probs"], batch["ref_log_prob"],
                                        batch["response_mask"], ctx.kl_ctrl, ctx.cfg.algorithm.kl_penalty)
    return Batch({"token_level_rewards": rewards}), metrics


def _advantage_inputs(cfg) -> tuple[str, ...]:
    algo = cfg.algorithm
    components = ("reward_extra_info", "prompts", "attention_mask") if algo.adv_estimator == "gdpo" and \
        algo.gdpo_reward_keys else ()
    return ("token_level_rewards", "response_mask", *ADV_INPUTS[algo.adv_estimator], *components)


@register_stage("advantages", None, _advantage_inputs, ("advantages", "returns"))
def advantages(ctx: "StepContext", batch: Batch) -> tuple[Batch, dict]:
    """Advantages and returns with the configured estimator (algorithm.adv_estimator)."""
    algo = ctx.cfg.algorithm
    wanted = (*_advantage_inputs(ctx.cfg), *OPTIONAL_ADV_INPUTS.get(algo.adv_estimator, ()))
    fields = {k: batch[k] for k in wanted if k in batch}
    adv, ret = compute_advantage(algo.adv_estimator, fields, algo)
    mask = batch["response_mask"].bool()
    return Batch({"advantages": adv, "returns": ret}), {**_stats("advantages", adv[mask]),
                                                       **_stats("returns", ret[mask])}


# ----------------------------------------------------------------- updates
def _mini_batches(batch: Batch, prompts: int, n: int, epochs: int) -> list[Batch]:
    rows = max(1, prompts * n)
    return [batch.take(slice(s, s + rows)) for _ in range(epochs) for s in range(0, len(batch), rows)]


@register_stage("update_critic", "critic", (*SEQUENCE_FIELDS, "values", "returns"), ("@critic_updated",))
def update_critic(ctx: "StepContext", batch: Batch) -> tuple[None, dict]:
    """Optimizer steps of the clipped value loss over mini-batches and epochs."""
    c = ctx.cfg.critic
    loss = critic_loss({"cliprange_value": c.cliprange_value, "loss_agg_mode": c.loss_agg_mode})
    data = batch.select([*SEQUENCE_FIELDS, "values", "returns"], meta=False)
    group = ctx.group("critic")
    results = [group.update_critic(mb, loss) for mb in _mini_batches(data, c.ppo_mini_batch_size,
                                                                       ctx.cfg.rollout.n, c.ppo_epochs)]
    metrics = mean_metrics(results)
    return None, {(k if k.startswith("critic/") else f"critic/{k}"): v for k, v in metrics.items()}


def _actor_fields(cfg) -> tuple[str, ...]:
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


@register_stage("update_actor", "actor", _actor_fields, ("@actor_updated",))
def update_actor(ctx: "StepContext", batch: Batch) -> tuple[None, dict]:
    """Optimizer steps of the policy loss (+ KL loss, entropy bonus) over mini-batches and epochs."""
    a = ctx.cfg.actor
    loss = actor_loss(actor_loss_settings(ctx.cfg))
    data = batch.select(_actor_fields(ctx.cfg), meta=False)
    group = ctx.group("actor")
    results = [group.update_actor(mb, loss) for mb in _mini_batches(data, a.ppo_mini_batch_size,
                                                                      ctx.cfg.rollout.n, a.ppo_epochs)]
    metrics = mean_metrics(results)
    ctx.actor_unchanged = not results or metrics.get("skipped", 0.0) == len(results)
    fault_point("update_actor", ctx.rl.step_count + 1)
    return None, {(k if k.startswith(("actor/", "rollout_corr/")) else f"actor/{k}"): v for k, v in metrics.items()}


@register_stage("sync_weights", "actor", ("@actor_updated",), ("@weights_synced",), needs=("rollout",))
def sync_weights(ctx: "StepContext", batch: Batch) -> tuple[None, dict]:
    """Reshard the actor's new weights into the rollout engines, bucket by bucket (not after a
    step whose every update was skipped for a NaN or inf: the engines already hold those weights)."""
    if ctx.actor_unchanged:
        return None, {"sync/bytes": 0, "sync/skipped": 1}
    report = ctx.sync()
    return None, {"sync/bytes": report.bytes_moved, "sync/seconds": report.seconds, "sync/buckets": report.buckets}


from hybridlab.dataflow.preference_stages import PAIR_FIELDS, pair_best_worst, update_actor_dpo  # noqa: E402  online DPO

register_stage("pair_best_worst", None, ("token_level_scores", "uid"), ("@pairs",), replaces_rows=True)(pair_best_worst)
register_stage("update_actor_dpo", "actor", (*PAIR_FIELDS, "@pairs"), ("@actor_updated",))(update_actor_dpo)
