"""The MATH family (``lighteval/MATH``, ``DigitalLearningGmbH/MATH-lighteval``,
``HuggingFaceH4/MATH-500``): the last ``\\boxed{...}`` (or ``\\boxed x$``, or ``\\fbox``) of the
response, equal to the ground truth after the MATH benchmark's string normalisation.

This is the check of Hendrycks et al.'s MATH code, as verl scores it: string rewriting, no
algebra, so ``0.5`` equals ``\\frac{1}{2}`` but ``2/4`` does not. Where the normalisation cannot
read an answer (a ``\\sqrt`` or ``\\frac`` with nothing after it, two ``\\text{ `` units), the two
strings are compared as written. ``reward.math_verifier=math-verify`` checks by algebra instead.
"""
from __future__ import annotations

import re
from typing import Any

from hybridlab.scorers.latex import closing_brace


class Unreadable(Exception):
    """The normalisation cannot read the string (compared unnormalised instead)."""


def last_boxed(response: str) -> str | None:
    """Return the last ``\\boxed{...}`` (braces balanced), ``\\boxed ...`` (up to a ``$``) or
    ``\\fbox{...}`` of ``response``, or None."""
    if "\\boxed " in response:
        return "\\boxed " + response.split("\\boxed ")[-1].split("$")[0]
    start = response.rfind("\\boxed")
    if start < 0:
        start = response.rfind("\\fbox")
        if start < 0:
            return None
    end = closing_brace(response, start)
    return None if end is None else response[start:end + 1]


def unbox(boxed: str) -> str | None:
    """Return the contents of ``\\boxed{x}`` or ``\\boxed x``; None for anything else (``\\fbox``)."""
    if boxed.startswith("\\boxed "):
        return boxed[len("\\boxed "):]
    if boxed.startswith("\\boxed{") and boxed.endswith("}"):
        return boxed[len("\\boxed{"):-1]
    return None


def _drop_units(s: str) -> str:
    if "\\text{ " not in s:
        return s
    parts = s.split("\\text{ ")
    if len(parts) != 2:
        raise Unreadable(s)
    return parts[0]


def _brace_sqrt(s: str) -> str:
    """``\\sqrt3`` -> ``\\sqrt{3}``."""
    head, *rest = s.split("\\sqrt")
    for part in rest:
        if not part:
            raise Unreadable(s)
        head += "\\sqrt" + (part if part[0] == "{" else "{" + part[0] + "}" + part[1:])
    return head


def _brace_fracs(s: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{7}`` -> ``\\frac{1}{7}``; returns ``s`` unchanged
    when a ``\\frac`` is followed by one character only."""
    head, *rest = s.split("\\frac")
    for part in rest:
        if not part:
            raise Unreadable(s)
        head += "\\frac"
        if part[0] == "{":
            head += part
        elif len(part) < 2:
            return s
        elif part[1] != "{":
            head += "{" + part[0] + "}{" + part[1] + "}" + part[2:]
        else:
            head += "{" + part[0] + "}" + part[1:]
    return head


def _slash_to_frac(s: str) -> str:
    """``3/4`` -> ``\\frac{3}{4}`` when both sides are plain integers."""
    parts = s.split("/")
    if len(parts) != 2:
        return s
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return s
    return f"\\frac{{{a}}}{{{b}}}" if s == f"{a}/{b}" else s


def normalize(s: str) -> str:
    """Return ``s`` in the MATH benchmark's normal form; raises Unreadable where it cannot."""
    for old, new in (("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"),
                     ("\\left", ""), ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", "")):
        s = s.replace(old, new)
    s = _drop_units(s)
    s = s.replace("\\\\%", "").replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "x = 5", "k=5": the value
        s = sides[1]
    s = _brace_fracs(_brace_sqrt(s).replace(" ", ""))
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _slash_to_frac(s)


def normalize_answer(answer: str) -> str:
    """Return ``answer`` stripped, a whole ``\text{...}`` unwrapped, in the MATH normal form (as
    PRM800K's grader uses it: as written where it cannot be normalised)."""
    answer = answer.strip()
    match = re.search(r"^\\text\{(?P<text>.+?)\}$", answer)
    if match is not None:
        answer = match.group("text").strip()
    try:
        return normalize(answer)
    except Unreadable:
        return answer


def equivalent(answer: Any, ground_truth: Any) -> bool:
    """True when the two normalise to the same string (compared as written where one cannot be
    normalised, or is not a string)."""
    try:
        return normalize(answer) == normalize(ground_truth)
    except (Unreadable, AttributeError, TypeError):
        return answer == ground_truth


def score(response: str, ground_truth: Any) -> dict:
    """Return ``{"score", "acc"}``, both 1.0 when the last boxed answer is equivalent to the
    ground truth, else 0.0."""
    boxed = last_boxed(response)
    answer = unbox(boxed) if boxed is not None else None
    right = answer is not None and equivalent(answer, ground_truth)
    return {"score": float(right), "acc": float(right)}
