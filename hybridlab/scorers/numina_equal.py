"""The Numina sources' second check (verl's ``prime_math.grader.math_equal``): numbers equal
within a relative 1e-4 (or as a percentage), intervals, tuples and matrices element by element.

Where this differs from verl 0.9.1, on purpose:

- verl evaluates the answer text with Python's ``eval`` (an answer with ``\\pi``, and a list
  answer against a ``pmatrix``): here only arithmetic on numbers (``+ - * / **``, parentheses,
  lists) is evaluated, never a name or a call. On arithmetic the results are the same.
- verl parses a ``Matrix(...)`` answer with sympy's ``parse_expr``, which evaluates it too: here
  such an answer is not equal (verl's answer only differs on that rare form).
- verl's last, symbolic step (``symbolic_equal``) never decides anything in verl 0.9.1: it enters
  ``timeout_limit``, a decorator, as a context manager, which raises, and the ``except`` around it
  returns False. Here it is not run, so the results are the same.
"""
from __future__ import annotations

import ast
import math
import operator
import re
from math import isclose
from typing import Any

def _power(base: Any, exponent: Any) -> Any:
    if abs(exponent) > 1000:  # 9**9**9 would take the process's memory and time
        raise ValueError(f"exponent {exponent} too large to evaluate")
    return operator.pow(base, exponent)


_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.Pow: _power, ast.USub: operator.neg, ast.UAdd: operator.pos}
_INTERVALS = (("Interval(", r"^Interval\((.*)\)$", "[{}]"), ("Interval.Ropen(", r"^Interval\.Ropen\((.*)\)$", "[{})"),
              ("Interval.Lopen(", r"^Interval\.Lopen\((.*)\)$", "({}]"),
              ("Interval.open(", r"^Interval\.open\((.*)\)$", "({})"))


def arithmetic(text: str) -> Any:
    """Return the value of ``text`` when it is arithmetic on numbers (or a list of such); raises
    ValueError for anything else (names, calls, attributes)."""
    def value(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, complex)) \
                and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        if isinstance(node, (ast.List, ast.Tuple)):
            items = [value(item) for item in node.elts]
            return items if isinstance(node, ast.List) else tuple(items)
        raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")

    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not arithmetic: {text[:60]!r}") from exc
    return value(tree.body)


def is_digit(s: Any) -> tuple[bool, float | None]:
    """Return (True, the number) when ``s`` reads as a float (with ``,`` or ``{,}`` separators)."""
    try:
        text = str(s)
        return True, float(text.replace("{,}", "") if "{,}" in text else text.replace(",", ""))
    except ValueError:
        return False, None


def _with_pi(text: str, pi: float) -> Any:
    """``\\pi`` as ``pi`` (``2\\pi`` -> ``2*pi``), then the value when it is arithmetic."""
    idx = text.find("\\pi")
    while idx != -1:
        text = text[:idx] + (f"*{pi}" if idx > 0 and text[idx - 1].isdigit() else f"1*{pi}") + text[idx + 3:]
        idx = text.find("\\pi", idx + 1)
    try:
        return arithmetic(text)
    except (ValueError, ArithmeticError, TypeError):
        return text


def normalize(answer: Any, pi: float) -> Any:
    """Return the answer with a leading ``$`` or a trailing ``%`` dropped, a base subscript
    (``101_2``) read as its digits (raises ValueError where they are not a number), and
    ``\\pi`` evaluated."""
    if isinstance(answer, str) and re.match(r"\$\d+(\.\d+)?", answer):
        return answer[1:]
    if isinstance(answer, str) and (re.match(r"^\d+(\.\d+)?%$", answer) or re.match(r"^\d+(\.\d+)?\\%$", answer)):
        return answer.replace("\\%", "").replace("%", "")
    if isinstance(answer, str) and "_" in answer:
        return int(float(answer.split("_")[0]))
    if isinstance(answer, str) and "\\pi" in answer:
        return _with_pi(answer, pi)
    return answer


def format_intervals(prediction: str) -> str:
    """Return sympy's ``Interval(a, b)`` (and its open forms) in bracket notation."""
    for _, pattern, form in _INTERVALS:
        match = re.match(pattern, prediction)
        if match:
            return form.format(match.group(1))
    return prediction


def _parts_equal(pred_parts: list, ref_parts: list, include_percentage: bool, tolerance: float) -> bool:
    if len(pred_parts) != len(ref_parts):
        return False
    # every part compared (no short cut), so a part that raises raises as in verl
    return all([math_equal(p, r, include_percentage, tolerance) for p, r in zip(pred_parts, ref_parts)])


def _numbers_equal(prediction: Any, reference: Any, include_percentage: bool, tolerance: float) -> bool | None:
    """True or False when both read as numbers (the reference also as a percentage), else None."""
    if not (is_digit(prediction)[0] and is_digit(reference)[0]):
        return None
    prediction, reference = is_digit(prediction)[1], is_digit(reference)[1]
    candidates = [reference / 100, reference, reference * 100] if include_percentage else [reference]
    return any(isclose(c, prediction, rel_tol=tolerance) for c in candidates)


def math_equal(prediction: Any, reference: Any, include_percentage: bool = True, tolerance: float = 1e-4,
               pi: float = math.pi) -> bool:
    """True when the prediction equals the reference as verl's ``math_equal`` decides it (this
    module's docstring says where it differs); may raise where verl's raises (its caller scores
    that as wrong)."""
    prediction, reference = normalize(prediction, pi), normalize(reference, pi)
    if isinstance(prediction, str) and len(prediction) > 1000:
        prediction = prediction[:1000]
    if isinstance(prediction, str) and isinstance(reference, str):
        if prediction.strip().lower() == reference.strip().lower() \
                or prediction.replace(" ", "") == reference.replace(" ", ""):
            return True
    numbers = _numbers_equal(prediction, reference, include_percentage, tolerance)
    if numbers is not None:
        return numbers
    if not prediction and prediction not in [0, False]:
        return False
    reference, prediction = str(reference).strip(), format_intervals(str(prediction).strip())
    pred_str, ref_str = prediction, reference
    if (prediction.startswith("[") and prediction.endswith("]") and not reference.startswith("(")) or (
            prediction.startswith("(") and prediction.endswith(")") and not reference.startswith("[")):
        pred_str, ref_str = pred_str.strip("[]()"), ref_str.strip("[]()")
    for brace in "{}()":
        pred_str, ref_str = pred_str.replace(brace, ""), ref_str.replace(brace, "")
    if pred_str == ref_str:
        return True
    if prediction and reference and prediction[0] in "([" and prediction[-1] in ")]" \
            and prediction[0] == reference[0] and prediction[-1] == reference[-1] \
            and _parts_equal(prediction[1:-1].split(","), reference[1:-1].split(","), include_percentage, tolerance):
        return True
    if "," in prediction and "," in reference:
        pred_parts, ref_parts = [p.strip() for p in prediction.split(",")], [r.strip() for r in reference.split(",")]
        if len(pred_parts) == len(ref_parts):
            return _parts_equal(pred_parts, ref_parts, include_percentage, tolerance)
    if prediction.startswith("Point") and reference[0] == "(" and reference[-1] == ")" and _parts_equal(
            prediction[prediction.find("(") + 1:-1].split(","), reference[1:-1].split(","), include_percentage,
            tolerance):
        return True
    if r"\begin{pmatrix}" in reference and prediction.startswith("[") and prediction.endswith("]"):
        return _matrix_equal(prediction, reference, include_percentage, tolerance)
    return False


def _matrix_equal(prediction: str, reference: str, include_percentage: bool, tolerance: float) -> bool:
    """A list answer against a ``pmatrix`` reference, row by row; raises ValueError where the answer
    is not a list of arithmetic (verl's ``eval`` raises there too)."""
    matrix = arithmetic(prediction)
    if not isinstance(matrix, list):
        return False
    rows = (reference.removeprefix(r"\\begin{pmatrix}").removeprefix(r"\begin{pmatrix}")
            .removesuffix(r"\\end{pmatrix}").removesuffix(r"\end{pmatrix}")).split("\\")
    rows = [row.split("&") if "&" in row else row for row in rows]
    try:
        return len(matrix) == len(rows) and all(
            [math_equal(pred, ref, include_percentage, tolerance) for ref, pred in zip(rows, matrix)])
    except Exception:
        return False
