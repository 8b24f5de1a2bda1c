"""Countdown answered in Python: ``3 5 7 to 22 in python:`` -> ``3*5+7``, a Python expression
that the code sandbox (``hybridlab.sandbox``) evaluates.

The answer's first line must parse as one Python expression. Its integer literals must be
among the given numbers (each at most as often as it is given) and it may hold no other
literal; anything else Python allows (``max(3, 5)*7``, ``abs(3-5)``...) is the model's to use.
The expression runs in the sandbox as ``print(EXPRESSION)``: it is right when that prints the
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


def literals(expression: str) -> list[Any] | None:
    """Return the literals of ``expression`` (None when it is not one Python expression)."""
    try:
        tree = ast.parse(expression, mode="eval")
    except (SyntaxError, ValueError, RecursionError):
        return None
    return [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)]


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
        if not found or any(type(v) is not int for v in found) or Counter(found) - allowed:
            return False, False
        if self.sandbox is None:
            self.sandbox = Sandbox()
        run = self.sandbox.run_python(f"print({text})\n")
        return run.ok and run.stdout.strip() == str(int(ground_truth["target"])), True
