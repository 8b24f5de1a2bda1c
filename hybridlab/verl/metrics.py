"""verl's metric names, for runs read the verl way (``trainer.verl_names``): verl's dashboards
read these. Only quantities hybridlab computes the same way are named after verl's.

Validation (verl's ``val-core``/``val-aux``, ``RayPPOTrainer._val_metrics_update``): per data
source and per variable (``reward``, the score; and each entry of a dict-valued reward: ``score``,
``acc``...), the mean over the test prompts of each prompt's ``mean@N`` over its N answers and,
with N > 1, its ``std@N`` and bootstrap estimates (1,000 draws, seed 42, as verl's
``process_validation_metrics``) of ``best@n``, ``worst@n`` and, where the reward answers with a
``pred``, ``maj@n`` (the first answer's value among the most common ``pred``), for n = 2, 4, ...
and N. The core entries are the variable ``acc`` where there is one, else ``reward``, at n = N.
"""
from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np

# hybridlab's step metric -> verl's name for the same quantity
STEP_NAMES = {
    **{f"reward/{s}": f"critic/score/{s}" for s in ("mean", "max", "min")},
    **{f"advantages/{s}": f"critic/advantages/{s}" for s in ("mean", "max", "min")},
    **{f"returns/{s}": f"critic/returns/{s}" for s in ("mean", "max", "min")},
    "timing/step_s": "timing_s/step",
}


def step_metrics(metrics: dict) -> dict:
    """Return the entries of a step's ``metrics`` that verl computes too, under verl's names."""
    return {verl: metrics[ours] for ours, verl in STEP_NAMES.items() if ours in metrics}


def validation_metrics(sources: list[str], prompts: list[int], rewards: list[float],
                       answers: list[dict]) -> dict[str, float]:
    """Return verl's validation entries (``val-core/SOURCE/acc/mean@N``...) from each answer's data
    source, prompt, reward and dict answer (``{}`` where the scorer answers with a number)."""
    per_prompt: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))  # source -> prompt -> variable
    for source, prompt, reward, answer in zip(sources, prompts, rewards, answers, strict=True):
        for name, value in {"reward": reward, **answer}.items():
            per_prompt[source][prompt][name].append(value)
    out = {}
    for source, prompts_of in per_prompt.items():
        by_metric: dict = defaultdict(lambda: defaultdict(list))  # variable -> metric -> one value per prompt
        for variables in prompts_of.values():
            for name, metrics in prompt_stats(variables).items():
                for metric, value in metrics.items():
                    by_metric[name][metric].append(value)
        core = "acc" if "acc" in by_metric else "reward"
        for name, metrics in by_metric.items():
            n_max = max(int(m.split("@")[1].split("/")[0]) for m in metrics)
            for metric, values in metrics.items():
                is_core = name == core and metric.startswith(("mean", "maj", "best")) and f"@{n_max}" in metric
                out[f"{'val-core' if is_core else 'val-aux'}/{source}/{name}/{metric}"] = float(np.mean(values))
    return out


def prompt_stats(variables: dict[str, list], draws: int = 1000, seed: int = 42) -> dict[str, dict[str, float]]:
    """Return, for each numeric variable of one prompt's N answers (one that some answers lack,
    where their scoring failed, is left out), ``mean@N`` and with N > 1
    ``std@N`` and the bootstrap means and deviations of ``best@n``, ``worst@n`` and (where the
    answers carry a ``pred``) ``maj@n``, each over ``draws`` subsets of n answers drawn with
    replacement, for n = 2, 4, ... and N."""
    answers = len(variables["reward"])
    # an answer whose scoring failed has no dict entries: a variable counts where every answer has it
    variables = {name: values for name, values in variables.items() if len(values) == answers}
    votes = variables.get("pred")
    out = {}
    for name, values in variables.items():
        if isinstance(values[0], str):
            continue
        n_answers, data = len(values), np.array(values, dtype=np.float64)
        stats = out[name] = {f"mean@{n_answers}": float(np.mean(data))}
        if n_answers < 2:
            continue
        stats[f"std@{n_answers}"] = float(np.std(data))
        for n in [*(2 ** k for k in range(1, n_answers.bit_length()) if 2 ** k < n_answers), n_answers]:
            # verl reseeds numpy's global generator for each estimate: every estimate draws the same subsets
            subsets = np.random.RandomState(seed).choice(n_answers, size=(draws, n), replace=True)
            drawn = {"best": data[subsets].max(axis=1), "worst": data[subsets].min(axis=1)}
            if votes is not None:
                drawn["maj"] = data[majority_answers(votes, subsets)]
            for kind, value in drawn.items():
                stats[f"{kind}@{n}/mean"], stats[f"{kind}@{n}/std"] = float(np.mean(value)), float(np.std(value))
    return out


def majority_answers(votes: list[str], subsets: np.ndarray) -> np.ndarray:
    """Return, for each row of answer indices, the first answer whose vote is the most common in
    the row (the earliest such vote on a tie), as verl's ``calc_maj_val`` picks the value."""
    codes = np.unique(np.array(votes, dtype=object), return_inverse=True)[1].reshape(-1)[subsets]
    counts = (codes[:, :, None] == codes[:, None, :]).sum(axis=2)  # each position: how often its vote occurs
    first_top = (counts == counts.max(axis=1, keepdims=True)).argmax(axis=1)
    return subsets[np.arange(len(subsets)), first_top]
