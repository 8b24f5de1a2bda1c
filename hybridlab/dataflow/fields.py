"""What the stages share: the fields that describe a batch's sequences, how the metrics of
several optimizer steps average into one step's, and a tensor's summary statistics."""
from __future__ import annotations

import torch

SEQUENCE_FIELDS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")


def mean_metrics(results: list[list[dict]]) -> dict[str, float]:
    """Average the mini-batches' metrics; ``skipped`` becomes the number of skipped updates."""
    flat = [m for per_step in results for m in per_step]
    out = {k: sum(m[k] for m in flat) / len(flat) for k in flat[0]} if flat else {}
    if "skipped" in out:  # DP ranks agree (their gradient norm is all-reduced): count mini-batches
        out["skipped"] = float(sum(max(m.get("skipped", 0.0) for m in per_step) for per_step in results))
    return out


def summary_stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    """Return ``{prefix}/mean``, ``/std`` (0 for one value), ``/max`` and ``/min`` of ``values``."""
    values = values.float()
    return {f"{prefix}/mean": float(values.mean()), f"{prefix}/std": float(values.std()) if len(values) > 1 else 0.0,
            f"{prefix}/max": float(values.max()), f"{prefix}/min": float(values.min())}
