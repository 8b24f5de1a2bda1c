"""Evaluation on the test prompts: each prompt answered as the ``evaluation`` section says (one
greedy answer by default, or ``n`` sampled ones), generated as the run's steps generate (a plain
response, or an agent trajectory) and scored as they are.
"""
from __future__ import annotations

import torch

from hybridlab.dataflow.agent_stages import agent_settings, agentic, own_reward, own_scores
from hybridlab.dataflow.context import StepContext
from hybridlab.dataflow.generation_stages import reward_inputs
from hybridlab.protocol import Batch


def eval_scores(ctx: StepContext, prompts: Batch) -> Batch:
    """Return ``token_level_scores`` and ``acc`` (and, from the reward worker, ``reward_answer``)
    of ``evaluation.n`` answers per prompt, a prompt's answers together. Greedy answers are
    generated once and repeated: they are identical, and vLLM refuses n > 1 without sampling."""
    e = ctx.cfg.evaluation
    greedy = e.temperature == 0
    sampling = ctx.sampling(n=1 if greedy else e.n, temperature=e.temperature, top_p=e.top_p, top_k=e.top_k)
    rollout, reward = ctx.group("rollout"), ctx.group("reward")
    if not agentic(ctx.cfg):
        generated = rollout.generate(prompts, sampling)
        scored = reward.compute_reward(generated.select(reward_inputs(generated)))
    else:
        out = rollout.generate_agent(prompts, sampling, agent_settings(ctx.cfg, ctx.state.rollout_version))
        if not own_reward(ctx.cfg):
            scored = reward.compute_reward(out.select(reward_inputs(out)))
        else:
            scores, acc = own_scores(out, ctx.cfg.reward.error_score)
            scored = Batch({"token_level_scores": scores.unsqueeze(-1), "acc": acc})
    return scored.repeat(e.n) if greedy and e.n > 1 else scored


def accuracy_report(scored: Batch, prompts: int) -> dict:
    """Return ``{"accuracy", "n", "reward_mean"}``: the mean accuracy and score over every answer,
    and the number of prompts."""
    scores = scored["token_level_scores"].sum(-1)
    return {"accuracy": float(torch.nanmean(scored["acc"].float())), "n": prompts, "reward_mean": float(scores.mean())}
