"""Countdown answered in Python: ``3 5 7 to 22 in python:`` -> ``3*5+7``, a Python expression
that the code sandbox (``hybridlab.sandbox``) evaluates.

The answer's first line must parse as one Python expression of integer literals, the operators
``+ - * // % **`` and the builtins ``abs``, ``max``, ``min`` and ``pow`` (``max(3, 5)*7``). Its
literals must be among the given numbers, each at most as often as it is given: nothing else
(``~``, lists, ``len``) may build a number. The expression runs in the sandbox as
``print(EXPRESSION)`` (``9**9**9`` meets its CPU limit there): it is right when that prints the
target and exits 0 within the sandbox's limits. Nothing the model writes runs outside it; where
the sandbox cannot run, scoring is refused with what is missing (``SandboxUnavailable``).
"""
from __future__ import annotations

import ast
import json
import random
from collections import Counter
from typing import Any

from hybridlab.sandbox.runner import Sandbox
from hybridlab.tasks.arith import first_line
from hybridlab.tasks.base import Sample, register_task
from hybridlab.tasks.countdown import Countdown


# What an answer may be made of: arithmetic on integer literals and a few builtins of numbers.
# Anything else (``~``, lists, ``len``, ``int()``...) could build any number from none given.
OPERATORS = (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Mod, ast.Pow, ast.USub, ast.UAdd)
FUNCTIONS = frozenset({"abs", "max", "min", "pow"})


def literals(expression: str) -> list[int] | None:
    """Return the integer literals of ``expression``; None when it is not one Python expression
    of integer literals, ``OPERATORS`` and calls of ``FUNCTIONS`` alone."""
    try:
        tree = ast.parse(expression, mode="eval")
    except (SyntaxError, ValueError, RecursionError):
        return None
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            found.append(node.value)
        elif isinstance(node, ast.Call):
            if not (isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS) or node.keywords:
                return None
        elif isinstance(node, ast.Name):
            if node.id not in FUNCTIONS:
                return None
        elif not isinstance(node, (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Load, *OPERATORS)):
            return None
    return found


@register_task
class CountdownCode(Countdown):
    """Countdown whose answer is a Python expression, evaluated in the code sandbox."""

    name = "countdown_code"
    needs_sandbox = True

    def __init__(self, count: int = 3, max_number: int = 9, format_score: float = 0.0):
        super().__init__(count, max_number, format_score)
        self.sandbox: Sandbox | None = None

    def use_sandbox(self, sandbox: Sandbox) -> None:
        """Evaluate answers in ``sandbox`` (by default one with the default settings, built on
        first use)."""
        self.sandbox = sandbox

    def make_sample(self, rng: random.Random) -> Sample:
        sample = super().make_sample(rng)
        return Sample(prompt=sample.prompt.replace(":", " in python:"), ground_truth=sample.ground_truth,
                      data_source=self.name, answer=sample.answer)

    def check(self, response: str, ground_truth: Any) -> tuple[bool, bool]:
        """Return (the expression prints the target in the sandbox, it is a well-formed answer:
        one expression whose literals are given numbers)."""
        text = first_line(response)
        found = literals(text)
        if isinstance(ground_truth, str):
            ground_truth = json.loads(ground_truth)
        allowed = Counter(int(n) for n in ground_truth["numbers"])
        if not found or Counter(found) - allowed:
            return False, False
        if self.sandbox is None:
            self.sandbox = Sandbox()
        run = self.sandbox.run_python(f"print({text})\n")
        return run.ok and run.stdout.strip() == str(int(ground_truth["target"])), True
