"""The Numina sources (``numina_aops_forum``, ``numina_synthetic_math``, ``numina_amc_aime``,
``numina_synthetic_amc``, ``numina_cn_k12``, ``numina_olympiads``), as verl scores them with
``prime_math``: the answer read after ``answer:``/``answer is``/the last ``\\boxed{}``/the last
``=``, then equal to the ground truth by PRM800K's grader (the MATH string check, a normal form,
sympy's simplification of the difference) or by ``numina_equal.math_equal``. Scores 1.0 or 0.0.
"""
from __future__ import annotations

import math
import re
from typing import Any

from hybridlab.scorers import math_equiv
from hybridlab.scorers.latex import closing_brace
from hybridlab.scorers.limits import bounded
from hybridlab.scorers.numina_equal import math_equal

SYMPY_TIMEOUT_S = 10.0
_BAD_SUBSTRINGS = ("^{", "^(")
_BAD_REGEXES = (r"\^[0-9]+\^", r"\^[0-9][0-9]+")
_TUPLE_CHARS = "()[]"
_UNITS = ("degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week", "month", "year",
          "foot", "feet", "inch", "yard", "liter")
_WORDS = ((" or ", " , "), (" and ", " , "), ("million", "*10^6"), ("billion", "*10^9"), ("trillion", "*10^12"))
_LATEX_SYMBOLS = (("√", "sqrt"), ("π", "pi"), ("∞", "inf"), ("∪", "U"), ("·", "*"), ("×", "*"))


def _latex_to_text(expr: str) -> str:
    from pylatexenc import latex2text  # only here: a LaTeX parser the other sources never need

    expr = expr.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac").replace("\\frac", " \\frac")
    expr = latex2text.LatexNodes2Text().latex_to_text(expr)
    for symbol, text in _LATEX_SYMBOLS:
        expr = expr.replace(symbol, text)
    return expr.strip()


def _is_float(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _is_int(value: float) -> bool:
    try:
        return abs(value - int(round(value))) <= 1e-7
    except (ValueError, OverflowError):  # nan, inf
        return False


def _strip_thousands(expr: str) -> str:
    """``1,000,000`` -> ``1000000`` (only commas before three digits)."""
    while True:
        stripped = re.sub(r"(\d)(,)(\d\d\d)($|\D)", r"\1\3\4", expr)
        if stripped == expr:
            return stripped
        expr = stripped


def _str_is_int(text: str) -> bool:
    try:
        return _is_int(float(_strip_thousands(text)))
    except ValueError:
        return False


def normalize(expr: str) -> str:
    """Return PRM800K's normal form of an answer: no ``\\text{}``, ``$``, ``%`` or units, ``and``/``or``
    as commas, LaTeX read as text, lower case, whole numbers as integers."""
    match = re.search(r"^\\text\{(?P<text>.+?)\}$", expr)
    if match is not None:
        expr = match.group("text")
    expr = expr.replace("\\%", "%").replace("\\$", "$").replace("$", "").replace("%", "")
    for old, new in _WORDS:
        expr = expr.replace(old, new)
    for unit in _UNITS:
        expr = re.sub(f"{unit}(es)?(s)? *(\\^[0-9]+)?", "", expr)
    expr = re.sub(r"\^ *\\circ", "", expr)
    if len(expr) > 0 and expr[0] == "{" and expr[-1] == "}":
        expr = expr[1:-1]
    expr = re.sub(",\\\\! *", "", expr)
    if _is_float(expr) and _is_int(float(expr)):
        expr = str(int(round(float(expr))))
    if "\\" in expr:
        try:
            expr = _latex_to_text(expr)
        except Exception:  # text the LaTeX reader cannot read stays as it is
            pass
    expr = re.sub(r"([0-9]) +([0-9])", r"\1+\2", re.sub("- *", "-", expr)).lower()  # 7 3/4 -> 7+3/4
    if _str_is_int(expr):
        expr = str(int(float(expr.replace(",", ""))))
    return expr


def _sympy_equal(truth: str, given: str) -> bool:
    """True when sympy simplifies their difference to 0 (not tried on expressions with more than
    two distinct letters or towering powers, as PRM800K's grader does)."""
    import sympy  # only here: sympy's import costs a second that the other sources never pay
    from sympy.parsing import sympy_parser

    expr = f"({truth})-({given})"
    letters = {c for c in expr.replace("sqrt", "").replace("frac", "") if c.isalpha()}
    if len(letters) > 2 or any(bad in expr for bad in _BAD_SUBSTRINGS) \
            or any(re.search(bad, expr) for bad in _BAD_REGEXES):
        return False
    try:
        transformations = sympy_parser.standard_transformations + (sympy_parser.implicit_multiplication_application,)
        return sympy.simplify(sympy_parser.parse_expr(expr.replace("^", "**"), transformations=transformations)) == 0
    except Exception:
        return False


def split_tuple(expr: str) -> list[str]:
    """Return the elements of a tuple or interval (``(1,2]``), else ``[expr]`` ([] for "")."""
    expr = _strip_thousands(expr)
    if not expr:
        return []
    if len(expr) > 2 and expr[0] in _TUPLE_CHARS and expr[-1] in _TUPLE_CHARS \
            and all(ch not in expr[1:-1] for ch in _TUPLE_CHARS):
        return [elem.strip() for elem in expr[1:-1].split(",")]
    return [expr]


def grade_answer(given: str, truth: str) -> bool:
    """True when PRM800K's grader finds ``given`` equal to ``truth``: the MATH benchmark's normal
    forms equal, PRM800K's normal forms equal, or element by element (fractions as written,
    integers against integers, the rest by sympy within SYMPY_TIMEOUT_S each)."""
    if math_equiv.normalize_answer(truth) == math_equiv.normalize_answer(given):
        return True
    truth_normal, given_normal = normalize(truth), normalize(given)
    if truth_normal == given_normal:
        return True
    if not given_normal:
        return False
    truth_elems, given_elems = split_tuple(truth_normal), split_tuple(given_normal)
    if not truth_elems:
        raise ValueError(f"the ground truth {truth!r} normalizes to nothing")  # verl fails here too
    if len(truth_elems) > 1 and (truth_normal[0] != given_normal[0] or truth_normal[-1] != given_normal[-1]) \
            or len(truth_elems) != len(given_elems):
        return False
    for truth_elem, given_elem in zip(truth_elems, given_elems):
        if _is_frac(truth_elem) and _is_frac(given_elem):
            right = truth_elem == given_elem
        elif _str_is_int(truth_elem) != _str_is_int(given_elem):
            right = False
        else:
            try:
                right = bounded(lambda: _sympy_equal(truth_elem, given_elem), SYMPY_TIMEOUT_S, "sympy")
            except TimeoutError:
                right = False
        if not right:
            return False
    return True


def _is_frac(expr: str) -> bool:
    return bool(re.search(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$", expr))


def last_boxed(text: str) -> str | None:
    """Return the stripped contents of the last ``\\boxed{}`` (or ``\\fbox{}``), or None."""
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    left = text.find("{", start)
    end = closing_brace(text, start)
    return None if left < 0 or end is None else text[left + 1:end].strip()


def match_answer(response: str) -> str:
    """Return the answer read from ``response``: after the last ``answer:``/``answer is``/``answers
    are``, before ``is the answer``, the last ``\\boxed{}``, before a last sentence's ``. ``, and
    after the last ``is``/``=``/``:`` and the like."""
    for marker in ("answer:", "answer is", "answers are"):
        at = response.lower().rfind(marker)
        if at != -1:
            response = response[at + len(marker):].strip()
    for marker in ("is answer", "is the answer", "are answers", "are the answers"):
        at = response.lower().rfind(marker)
        if at != -1:
            response = response[:at].strip()
    boxed = last_boxed(response)
    if boxed:
        response = boxed
    if ". " in response:
        response = response[:response.lower().rfind(". ")].strip()
    for marker in ("be ", "is ", "are ", "=", ": ", "get ", "be\n", "is\n", "are\n", ":\n", "get\n"):
        at = response.lower().rfind(marker)
        if at != -1:
            response = response[at + len(marker):].strip()
    return response


def score(response: Any, ground_truth: Any) -> dict:
    """Return ``{"score", "acc"}``, both 1.0 when the answer read from the response equals the
    ground truth (``grade_answer``, else ``math_equal``, with pi as 3.14 too where ``\\pi`` appears)."""
    answer, truth = match_answer(str(response)), str(ground_truth)
    right = grade_answer(answer, truth)
    if not right:
        try:
            pis = (math.pi, 3.14) if "\\pi" in answer or "\\pi" in truth else (math.pi,)
            right = any([math_equal(answer, truth, pi=pi) for pi in pis])
        except Exception:  # verl scores an answer its grader cannot read as wrong
            right = False
    return {"score": float(right), "acc": float(right)}
