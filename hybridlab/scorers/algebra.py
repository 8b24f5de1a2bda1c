"""``reward.math_verifier=math-verify``: the math sources checked by algebra with Hugging Face's
Math-Verify (the alternative verl names in its scorer, with verl's targets: the ground truth as
LaTeX in ``\\boxed{}``, the response as an expression or LaTeX). Scores 1.0 or 0.0.

Math-Verify bounds its work with ``SIGALRM``, which exists only on a process's main thread: off
it Math-Verify raises, and with ``raise_on_error=False`` a timeout returns nothing, which would
score 0 in silence. So its own timeouts are off, and ``limits.bounded`` bounds the check: a
timeout raises ``TimeoutError`` (the sample is counted in ``reward/errors``, not scored 0).
"""
from __future__ import annotations

from typing import Any

from hybridlab.scorers.limits import bounded

TIMEOUT_S = 10


def _check(response: str, ground_truth: str) -> float:
    # imported here: it pulls in sympy and an ANTLR parser (a second), which only this verifier needs
    import math_verify.grader
    import math_verify.parser
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    # its warning that timeouts are off asks the caller to bound the work, which score() does
    math_verify.parser.TIMEOUT_WARNING_SHOWN = math_verify.grader.TIMEOUT_WARNING_SHOWN = True

    gold = parse("\\boxed{" + ground_truth + "}", (LatexExtractionConfig(),), parsing_timeout=None)
    preds = parse(response, (ExprExtractionConfig(), LatexExtractionConfig()), parsing_timeout=None)
    return float(any(verify(g, p, timeout_seconds=None) for g in gold for p in preds))


def score(response: str, ground_truth: Any, timeout_s: int = TIMEOUT_S) -> dict:
    """Return ``{"score", "acc"}``, both 1.0 when Math-Verify finds the response's answer equal to
    the ground truth, else 0.0; raises TimeoutError past ``timeout_s`` on the main thread."""
    right = bounded(lambda: _check(response, str(ground_truth)), timeout_s, "math-verify on this response")
    return {"score": right, "acc": right}
