"""The stages that make a step's samples and their scores: ``generate`` (and ``remax_baseline``'s
greedy samples), ``reward`` or ``reward_model``, and DAPO's ``filter_groups``, which generates
more to replace groups whose rewards are all equal. ``stages.py`` lists them in the stage table.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hybridlab.algos.dapo import informative_groups, overlong_penalty
from hybridlab.batching import PROMPT_WIDTH, concat_sequences, on_last_token
from hybridlab.dataflow.fields import SEQUENCE_FIELDS, summary_stats
from hybridlab.faults import fault_point
from hybridlab.protocol import Batch

if TYPE_CHECKING:
    from hybridlab.dataflow.context import StepContext


REWARD_FIELDS = ("responses", "response_mask", "ground_truth", "data_source")  # what scoring reads


def reward_inputs(batch: Batch) -> list[str]:
    """Return the fields a batch's scoring reads: ``REWARD_FIELDS``, plus the row's ``extra_info``
    and an agent trajectory's ``final_response`` where the batch has them."""
    return [*REWARD_FIELDS, *(k for k in ("extra_info", "final_response") if k in batch)]


def generate(ctx: StepContext, batch: Batch) -> tuple[Batch, dict]:
    """Sample rollout.n responses per prompt on the rollout engines. With trainer.off_policy,
    take the responses generated ahead (at most trainer.max_staleness updates stale) and submit
    this step's prompts ahead (dataflow/ahead.py)."""
    if ctx.cfg.trainer.streaming and not ctx.rerunning:  # the first groups to finish (dataflow/stream.py)
        out, metrics = ctx.state.stream.take(ctx, batch)
    elif ctx.cfg.trainer.off_policy and not ctx.rerunning:
        out, staleness = ctx.state.ahead.take(ctx, batch)
        metrics = ahead_metrics(ctx, staleness)
    else:
        out, metrics = ctx.group("rollout").generate(batch, ctx.sampling()), ahead_metrics(ctx, 0)
    fault_point("generate", ctx.state.step_count + 1)
    return out, {**generation_metrics(ctx.cfg, out), **metrics}


def ahead_metrics(ctx: StepContext, staleness: int) -> dict:
    """Return ``rollout/staleness`` and, off-policy, ``rollout/regenerated_prompts``: the prompts
    whose rollouts ahead were thrown away (settings or workers changed) and generated again, in all."""
    regenerated = {"rollout/regenerated_prompts": ctx.state.ahead.regenerated} if ctx.cfg.trainer.off_policy else {}
    return {"rollout/staleness": staleness, **regenerated}


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


def reward(ctx: StepContext, batch: Batch) -> tuple[Batch, dict]:
    """Score each response with the configured rule or function (a raising one scores error_score)."""
    out = ctx.group("reward").compute_reward(batch.select(reward_inputs(batch)))
    return finish_reward(ctx, batch, out)


def reward_model(ctx: StepContext, batch: Batch) -> tuple[Batch, dict]:
    """Score each sequence with the reward model at reward.model (loaded on first use)."""
    if not ctx.cfg.reward.model:
        raise ValueError("the reward_model stage needs reward.model (a sequence-classification checkpoint)")
    fields = [*SEQUENCE_FIELDS, "ground_truth", "data_source"]
    out = ctx.group("reward").compute_model_reward(batch.select(fields), ctx.cfg.reward.model)
    return finish_reward(ctx, batch, out)


def finish_reward(ctx: StepContext, batch: Batch, out: Batch) -> tuple[Batch, dict]:
    """Return a reward stage's fields and metrics from the scorer's ``out``: the scores (with
    DAPO's overlong penalty where set), accuracy, the reward's components, and the failures per
    data source (warned once per source, counted every step)."""
    scores = out["token_level_scores"]
    metrics = summary_stats("reward", scores.sum(-1))
    metrics["accuracy"] = float(torch.nanmean(out["acc"])) if len(out) else 0.0
    if "reward_error" in out:
        errors = out["reward_error"]
        metrics["reward/errors"] = int(errors.sum())
        sources = batch.objects.get("data_source", [""] * len(errors))
        for source in sorted({s for s, e in zip(sources, errors.tolist()) if e}):
            metrics[f"reward/errors/{source}"] = sum(1 for s, e in zip(sources, errors.tolist()) if e and s == source)
            if source not in ctx.state.reward_error_sources:  # warned once per data source; counted every step
                ctx.state.reward_error_sources.add(source)
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


def filter_groups(ctx: StepContext, batch: Batch) -> tuple[Batch, dict]:
    """DAPO dynamic sampling: keep groups whose rewards differ, generating more prompts to refill."""
    want = ctx.cfg.data.prompts_per_step
    rollout = ctx.scoring_stages()
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


def remax_baseline(ctx: StepContext, batch: Batch) -> tuple[Batch, dict]:
    """ReMax: reward of each prompt's greedy response, the per-prompt baseline."""
    firsts = list({u: i for i, u in reversed(list(enumerate(batch["uid"])))}.values())
    prompts = batch.select(["prompt_ids", "uid", "ground_truth", "data_source"]).take(sorted(firsts))
    prompts.meta[PROMPT_WIDTH] = max(len(p) for p in prompts["prompt_ids"])  # rollout DP ranks pad alike
    greedy = ctx.group("rollout").generate(prompts, ctx.sampling(n=1, temperature=0.0))
    scored = ctx.group("reward").compute_reward(greedy.select(reward_inputs(greedy)))
    by_uid = dict(zip(greedy["uid"], scored["token_level_scores"].sum(-1).tolist()))
    baselines = torch.tensor([by_uid[u] for u in batch["uid"]], dtype=torch.float32)
    return Batch({"reward_baselines": baselines}), {"reward/greedy_baseline_mean": float(baselines.mean())}
