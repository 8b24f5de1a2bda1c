"""What the stages share: the fields that describe a batch's sequences, and how the metrics of
several optimizer steps average into one step's."""
from __future__ import annotations

SEQUENCE_FIELDS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")


def mean_metrics(results: list[list[dict]]) -> dict[str, float]:
    """Average the mini-batches' metrics; ``skipped`` becomes the number of skipped updates."""
    flat = [m for per_step in results for m in per_step]
    out = {k: sum(m[k] for m in flat) / len(flat) for k in flat[0]} if flat else {}
    if "skipped" in out:  # DP ranks agree (their gradient norm is all-reduced): count mini-batches
        out["skipped"] = float(sum(max(m.get("skipped", 0.0) for m in per_step) for per_step in results))
    return out
