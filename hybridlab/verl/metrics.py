"""verl's metric names, for runs read the verl way (``trainer.verl_names``): verl's dashboards
read these. Only quantities hybridlab computes the same way are named after verl's.

Validation (verl's ``val-core``/``val-aux``): per data source, the mean over the validation
prompts of the score (``reward``) and, where the scorer answers with one, of ``acc``; the core
metric is ``acc`` when there is one, else ``reward``. hybridlab's evaluation decodes one greedy
answer per prompt, so the entries are ``mean@1`` (verl's ``best@N``/``maj@N`` need N > 1 samples,
which hybridlab's greedy evaluation does not draw).
"""
from __future__ import annotations

from collections import defaultdict

import torch

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


def validation_metrics(sources: list[str], scores: torch.Tensor, acc: torch.Tensor,
                       reported: torch.Tensor) -> dict[str, float]:
    """Return verl's validation entries from each prompt's data source, score, acc and whether its
    scorer reported the acc: ``val-core/SOURCE/acc/mean@1`` (or ``reward`` without an acc) and
    ``val-aux/SOURCE/reward/mean@1`` beside an acc."""
    rows = defaultdict(list)
    for i, source in enumerate(sources):
        rows[source].append(i)
    out = {}
    for source, index in rows.items():
        index = torch.tensor(index)
        reward = float(scores[index].mean())
        if bool(reported[index].bool().all()):
            out[f"val-core/{source}/acc/mean@1"] = float(acc[index].float().nanmean())
            out[f"val-aux/{source}/reward/mean@1"] = reward
        else:
            out[f"val-core/{source}/reward/mean@1"] = reward
    return out
