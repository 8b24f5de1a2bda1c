"""GSM8K (``openai/gsm8k``): the number after the last ``#### `` (strict, verl's default) or the
last number in the response (flexible), compared as a string with the ground truth.

As verl does, only the last 300 characters are searched (the answer comes at the end, and a
regular expression over a long response is slow), strict drops ``,`` and ``$`` from the number,
flexible keeps them, and the comparison is exact: ``72.0`` is not ``72``.
"""
from __future__ import annotations

import re
from typing import Any

CLIP_CHARS = 300
METHODS = ("strict", "flexible")
_STRICT = re.compile(r"#### (-?[0-9.,]+)")
_NUMBER = re.compile(r"-?[0-9.,]+")


def extract(response: str, method: str = "strict") -> str | None:
    """Return the answer ``method`` reads from ``response``, or None when there is none."""
    tail = response[-CLIP_CHARS:]
    if method == "strict":
        found = _STRICT.findall(tail)
        return found[-1].replace(",", "").replace("$", "") if found else None
    found = _NUMBER.findall(tail)
    numbers = [n for n in found if n != "."]
    if numbers:
        return numbers[-1]
    return found[0] if found else None  # only lone dots: verl compares the first, which never matches


def score(response: str, ground_truth: Any, method: str = "strict", format_score: float = 0.0) -> dict:
    """Return ``{"score", "acc"}``: 1 for the right answer, ``format_score`` for a wrong one that
    was found, 0 when none was found; ``acc`` is 1 only for the right answer."""
    answer = extract(response, method)
    if answer is None:
        return {"score": 0.0, "acc": 0.0}
    right = answer == ground_truth
    return {"score": 1.0 if right else float(format_score), "acc": float(right)}
