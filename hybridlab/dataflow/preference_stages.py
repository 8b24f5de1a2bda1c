"""Online DPO's stages: pairs from the policy's own samples, and the DPO update.

    generate -> reward -> pair_best_worst -> ref_logprob -> update_actor_dpo -> sync_weights

``pair_best_worst`` pairs each prompt's best-scored sample (chosen) with its worst (rejected) and
drops the prompts whose samples all score the same; ``update_actor_dpo`` takes optimizer steps
of the ``dpo`` settings' loss (``hybridlab.algos.preference``) on those pairs against the
reference. ``stages.py`` lists them in the stage table.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from hybridlab.algos.preference import CHOSEN_TOKENS, dpo_loss_fn
from hybridlab.batching import as_pairs
from hybridlab.dataflow.fields import SEQUENCE_FIELDS, mean_metrics
from hybridlab.dataflow.update_stages import run_updates
from hybridlab.faults import fault_point
from hybridlab.protocol import Batch

if TYPE_CHECKING:
    from hybridlab.dataflow.context import StepContext

PAIR_FIELDS = (*SEQUENCE_FIELDS, "ref_log_prob")


def pair_best_worst(ctx: "StepContext", batch: Batch) -> tuple[Batch, dict]:
    """Online DPO's pairs: each prompt's best-scored sample against its worst (ties dropped)."""
    scores = batch["token_level_scores"].sum(-1)
    groups: dict = {}
    for row, uid in enumerate(batch["uid"]):
        groups.setdefault(uid, []).append(row)
    rows = []
    for members in groups.values():
        group_scores = scores[members]
        if group_scores.max() > group_scores.min():  # first of the best, first of the worst
            rows += [members[int(group_scores.argmax())], members[int(group_scores.argmin())]]
    dp = ctx.workers.mapping.roles["actor"].dp
    pairs = len(rows) // 2 // dp * dp  # every data-parallel rank gets whole pairs, as many as the others
    pairs_batch = as_pairs(batch.take(rows[:2 * pairs]))
    if not pairs:
        why = "every prompt's samples scored the same" if not rows else \
            f"{len(rows) // 2} pair(s) do not split over the actor's {dp} data-parallel ranks"
        ctx.warn(f"pair_best_worst: {why}; no update this step")
    return pairs_batch, {"dpo/pairs": pairs, "dpo/dropped_prompts": len(groups) - len(rows) // 2,
                         "dpo/pairs_left_for_dp": len(rows) // 2 - pairs}


def update_actor_dpo(ctx: "StepContext", batch: Batch) -> tuple[None, dict]:
    """Optimizer steps of the DPO loss (``dpo`` settings) on the pairs, ``ppo_epochs`` times."""
    d, a = ctx.cfg.dpo, ctx.cfg.actor
    if len(batch) == 0:
        ctx.actor_unchanged = True
        return None, {}
    data = batch.select((*PAIR_FIELDS, CHOSEN_TOKENS))
    loss = dpo_loss_fn(d.loss_types, d.loss_weights, d.beta, d.label_smoothing)
    results = run_updates(ctx.group("actor").update_actor, [data] * a.ppo_epochs, loss)
    metrics = mean_metrics(results)
    ctx.actor_unchanged = metrics.get("skipped", 0.0) == len(results)
    fault_point("update_actor", ctx.state.step_count + 1)
    return None, {(k if "/" in k else f"actor/{k}"): v for k, v in metrics.items()}
