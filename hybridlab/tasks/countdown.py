"""Countdown: reach a target from given numbers with + - * and parentheses."""
from __future__ import annotations

import ast
import json
import random
from collections import Counter

from hybridlab.errors import UserError
from hybridlab.tasks.arith import first_line
from hybridlab.tasks.base import Sample, Task, register_task

_BINOPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}


def evaluate(expression: str) -> tuple[int, list[int]]:
    """Return (value, numbers used) of an expression of integers, + - * and parentheses.

    Raises ValueError for anything else (names, calls, division, powers...).
    """
    tree = ast.parse(expression, mode="eval")
    used: list[int] = []

    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return _BINOPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return node.value
        raise ValueError(f"not allowed in a countdown expression: {ast.dump(node)[:40]}")

    return walk(tree), used


@register_task
class Countdown(Task):
    """Use each of ``count`` numbers (1..``max_number``) at most once to reach the target."""

    name = "countdown"

    def __init__(self, count: int = 3, max_number: int = 9, format_score: float = 0.0):
        super().__init__(format_score)
        if not (isinstance(count, int) and 2 <= count <= 6):
            raise UserError(f"countdown option count must be an integer from 2 to 6, got {count!r}")
        if not (isinstance(max_number, int) and 2 <= max_number <= 100):
            raise UserError(f"countdown option max_number must be an integer from 2 to 100, got {max_number!r}")
        self.count, self.max_number = count, max_number

    def make_sample(self, rng: random.Random) -> Sample:
        numbers = [rng.randint(1, self.max_number) for _ in range(self.count)]
        # The worked answer: a random left-to-right expression over all numbers in order.
        expr = str(numbers[0])
        for n in numbers[1:]:
            op = rng.choice("+-*")
            expr = f"({expr}){op}{n}" if op == "*" and any(c in expr for c in "+-") else f"{expr}{op}{n}"
        target, _ = evaluate(expr)
        prompt = f"{' '.join(map(str, numbers))} to {target}:"
        return Sample(prompt=prompt, ground_truth={"target": target, "numbers": numbers},
                      data_source="countdown", answer=expr)

    def wrong_answer(self, sample: Sample, rng: random.Random) -> str:
        """The worked expression with one operator changed, so it misses the target."""
        right, target = sample.answer, sample.ground_truth["target"]
        ops = [i for i, c in enumerate(right) if c in "+-*"]
        for _ in range(100):
            i = rng.choice(ops)
            wrong = right[:i] + rng.choice([c for c in "+-*" if c != right[i]]) + right[i + 1:]
            if evaluate(wrong)[0] != target:
                return wrong
        return f"{right}+1"  # every operator swap hit the target; this misses it by one

    def check(self, response: str, ground_truth) -> tuple[bool, bool]:
        text = first_line(response)
        try:
            value, used = evaluate(text)
        except (SyntaxError, ValueError, RecursionError):
            return False, False
        if isinstance(ground_truth, str):  # stored as JSON text in some datasets
            ground_truth = json.loads(ground_truth)
        allowed = Counter(int(n) for n in ground_truth["numbers"])
        if Counter(used) - allowed:  # a number not given, or used more often than given
            return False, False
        return value == int(ground_truth["target"]), True
