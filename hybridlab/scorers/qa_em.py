"""Search-R1's question answering (the ``searchR1_*`` sources): the text of the last
``<answer>...</answer>`` must equal one of the ground truth's ``target`` answers after SQuAD's
normalisation (lower case, no punctuation, no articles, single spaces).

As verl does, a right answer in a response with more than 10 opening or closing answer tags
scores a quarter (a model must not win by repeating tags), and a wrong answer that was found
scores ``format_score``.
"""
from __future__ import annotations

import re
import string
from typing import Any

MAX_TAGS = 10
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize(text: str) -> str:
    """Return ``text`` lower-cased, without punctuation or articles, with single spaces."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split())


def extract(response: str) -> str | None:
    """Return the stripped text of the last answer tag pair, or None when there is none."""
    found = _ANSWER.findall(response)
    return found[-1].strip() if found else None


def targets(ground_truth: Any) -> list[str]:
    """Return the accepted answers: ``ground_truth["target"]``, a string or a list of them."""
    target = ground_truth["target"]
    return [target] if isinstance(target, str) else list(target)


def score(response: str, ground_truth: Any, format_score: float = 0.0) -> dict:
    """Return ``{"score", "acc"}``: 1 for an exact match (a quarter with more than 10 answer tags),
    ``format_score`` for a wrong answer, 0 with no answer tag; ``acc`` is 1 for a match."""
    answer = extract(response)
    if answer is None:
        return {"score": 0.0, "acc": 0.0}
    if normalize(answer) not in {normalize(t) for t in targets(ground_truth)}:
        return {"score": float(format_score), "acc": 0.0}
    many_tags = max(response.count("<answer>"), response.count("</answer>")) > MAX_TAGS
    return {"score": 0.25 if many_tags else 1.0, "acc": 1.0}
