"""``reward.math_verifier=math-verify``: the math sources checked by algebra with Hugging Face's
Math-Verify (the alternative verl names in its scorer, with verl's targets: the ground truth as
LaTeX in ``\\boxed{}``, the response as an expression or LaTeX). Scores 1.0 or 0.0.

Math-Verify bounds its work with ``SIGALRM``, which exists only on a process's main thread: off
it Math-Verify raises, and with ``raise_on_error=False`` a timeout returns nothing, which would
score 0 in silence. So its own timeouts are off, and this module bounds the check itself: on the
main thread by an alarm of its own that raises ``TimeoutError`` (the sample is counted in
``reward/errors``, not scored 0); off it (a thread, an async actor) with no bound here, where
``reward.timeout_s`` cuts off a hung batch.
"""
from __future__ import annotations

import signal
import threading
from typing import Any

TIMEOUT_S = 10


class _Alarm(BaseException):
    """Raised by the alarm; a BaseException, so Math-Verify's ``except Exception`` lets it through."""


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
    if threading.current_thread() is not threading.main_thread():
        right = _check(response, str(ground_truth))
        return {"score": right, "acc": right}

    def alarm(signum, frame):
        raise _Alarm

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(timeout_s)
    try:
        right = _check(response, str(ground_truth))
    except _Alarm:
        raise TimeoutError(f"math-verify took longer than {timeout_s} s on this response") from None
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    return {"score": right, "acc": right}
