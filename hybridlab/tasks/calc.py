"""Multiplication with a calculator tool: ``3456*789=`` -> a ``calc`` call -> ``2726784``.

A tiny model cannot multiply 3- and 4-digit numbers in its head; with the tool it only has to
copy: the operands into the call, then the tool's answer into its reply. The task's worked
answer is a whole tool-use conversation (``trace``), which the warm start trains on token by
token as the rollout will see it; RL then rewards the final reply. Run it with the
``agent_calc`` preset (``hybridlab train agent_calc``), which sets ``data.chat=true`` and
``rollout.tools=hybridlab.tasks.calc:calc``.
"""
from __future__ import annotations

import ast
import json
import operator
import random
import re

from hybridlab.errors import UserError
from hybridlab.tasks.arith import first_line
from hybridlab.tasks.base import Sample, Task, register_task

TOOL = "hybridlab.tasks.calc:calc"  # the rollout.tools value of this task
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
_NUMBER = re.compile(r"-?\d+")


def calc(expr: str) -> str:
    """Evaluate an integer arithmetic expression with +, - and *.

    Args:
        expr: The expression, e.g. 3456*789.
    """
    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"calc takes integers with + - * only, got {expr!r}")

    if len(expr) > 64:
        raise ValueError("calc takes expressions of at most 64 characters")
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        raise ValueError(f"calc cannot read {expr!r}") from None
    return str(value(tree.body))


def tool_call(name: str, arguments: dict) -> str:
    """Return a model turn calling ``name`` in the Hermes format the tool loop parses."""
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@register_task
class Calc(Task):
    """``a*b`` with ``a`` of ``min_digits`` to ``max_digits`` digits and ``b`` of ``b_digits``."""

    name = "calc"
    tools = (TOOL,)

    def __init__(self, min_digits: int = 3, max_digits: int = 4, b_digits: int = 3, format_score: float = 0.0):
        super().__init__(format_score)
        if not (isinstance(min_digits, int) and isinstance(max_digits, int) and 1 <= min_digits <= max_digits <= 9):
            raise UserError(f"calc options need 1 <= min_digits <= max_digits <= 9, got {min_digits}, {max_digits}")
        if not isinstance(b_digits, int) or not 1 <= b_digits <= 9:
            raise UserError(f"calc option b_digits must be an integer from 1 to 9, got {b_digits!r}")
        self.min_digits, self.max_digits, self.b_digits = min_digits, max_digits, b_digits

    def make_sample(self, rng: random.Random) -> Sample:
        digits = rng.randint(self.min_digits, self.max_digits)
        a = rng.randint(10 ** (digits - 1), 10**digits - 1)
        b = rng.randint(10 ** (self.b_digits - 1), 10**self.b_digits - 1)
        result = str(a * b)
        return Sample(prompt=f"{a}*{b}=", ground_truth=result, data_source="calc", answer=result)

    def trace(self, sample: Sample) -> list[dict]:
        """Return the worked conversation: the question, the call, the tool's answer, the reply."""
        expr = sample.prompt.rstrip("=")
        return [{"role": "user", "content": sample.prompt},
                {"role": "assistant", "content": tool_call("calc", {"expr": expr})},
                {"role": "tool", "name": "calc", "content": calc(expr)},
                {"role": "assistant", "content": sample.answer}]

    def wrong_answer(self, sample: Sample, rng: random.Random) -> str:
        """The product off by a digit slip (1, 10 or 100), either way."""
        return str(int(sample.ground_truth) + rng.choice((1, 10, 100)) * rng.choice((-1, 1)))

    def check(self, response: str, ground_truth) -> tuple[bool, bool]:
        text = first_line(response)
        return text == str(ground_truth), bool(_NUMBER.fullmatch(text))
