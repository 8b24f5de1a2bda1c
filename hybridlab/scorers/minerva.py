"""DAPO's math check (``math_dapo``, ``math``, ``math_dapo_reasoning`` and ``aime*``): the last
``Answer: ...`` line of the response, normalised as Minerva does, equal to the normalised ground
truth; without such a line, the last ``\\boxed{...}`` of the response's last 100 characters,
equal to the ground truth as written.

As verl does, only the last 300 characters are read, the score is +1 or -1 (``acc`` 1 or 0), and
``pred`` is the answer that was read.
"""
from __future__ import annotations

import re
from typing import Any

from hybridlab.scorers.latex import closing_brace

CLIP_CHARS = 300
BOX_CHARS = 100
INVALID = "[INVALID]"
_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")

# Minerva's normal form (Lewkowycz et al., 2022, appendix D), in order: rewrites, then words and
# units that are dropped.
_REWRITES = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
             (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
_DROPPED = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
            "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
            "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
            "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;",
            ",\\!", "{,}", '"', "\\dots")
_UNWRAP = (re.compile(r"(.*?)(\$)(.*?)(\$)(.*)"), r"$\3$"), *(
    (re.compile(pattern), r"\2") for pattern in
    (r"(\\text\{)(.*?)(\})", r"(\\textbf\{)(.*?)(\})", r"(\\overline\{)(.*?)(\})", r"(\\boxed\{)(.*)(\})"))
_SHORT_TEX = ((re.compile(r"(frac)([^{])(.)"), r"frac{\2}{\3}"), (re.compile(r"(sqrt)([^{])"), r"sqrt{\2}"))


def normalize(answer: str) -> str:
    """Return a final answer in Minerva's normal form: the value after the last ``=``, without
    spaces, units, ``$``, ``\\text{}`` and the like, ``\\frac12`` as ``\\frac{1}{2}``, ``1,000`` as
    ``1000``."""
    answer = answer.split("=")[-1]
    for old, new in _REWRITES:
        answer = answer.replace(old, new)
    for word in _DROPPED:
        answer = answer.replace(word, "")
    for pattern, replacement in (*_UNWRAP, *_SHORT_TEX):
        answer = pattern.sub(replacement, answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def last_boxed(text: str) -> str | None:
    """Return the contents of the last ``\\boxed{...}`` of ``text`` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    end = closing_brace(text, start)
    return None if end is None else text[start + len("\\boxed{"):end]


def score(response: str, ground_truth: Any) -> dict:
    """Return ``{"score": 1.0 or -1.0, "acc": 1.0 or 0.0, "pred": the answer read}``."""
    tail = response[-CLIP_CHARS:]
    lines = _ANSWER_LINE.findall(tail)
    pred = normalize(lines[-1] if lines else INVALID)
    right = pred == normalize(ground_truth)
    if pred == INVALID:
        boxed = last_boxed(tail[-BOX_CHARS:])
        if boxed is not None:
            pred, right = boxed, boxed == ground_truth
    return {"score": 1.0 if right else -1.0, "acc": float(right), "pred": pred}
