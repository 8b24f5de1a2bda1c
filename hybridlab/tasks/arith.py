"""Arithmetic: ``12+34=`` -> ``46``, with configurable digit count and operators."""
from __future__ import annotations

import random
import re

from hybridlab.errors import UserError
from hybridlab.tasks.base import Sample, Task, register_task

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_NUMBER = re.compile(r"-?\d+")


def first_line(response: str) -> str:
    """Return the response's first line, stripped: what a scorer reads as the answer."""
    return response.strip().split("\n", 1)[0].strip()


@register_task
class Arith(Task):
    """Binary arithmetic on non-negative integers of up to ``digits`` digits."""

    name = "arith"

    def __init__(self, digits: int = 2, ops: str = "+", format_score: float = 0.0):
        super().__init__(format_score)
        if not isinstance(digits, int) or not 1 <= digits <= 9:
            raise UserError(f"arith option digits must be an integer from 1 to 9, got {digits!r}")
        bad = [op for op in str(ops) if op not in _OPS]
        if not ops or bad:
            raise UserError(f"arith option ops must be made of {''.join(_OPS)}, got {ops!r}")
        self.digits, self.ops = digits, str(ops)

    def make_sample(self, rng: random.Random) -> Sample:
        hi = 10**self.digits - 1
        a, b, op = rng.randint(0, hi), rng.randint(0, hi), rng.choice(self.ops)
        result = str(_OPS[op](a, b))
        return Sample(prompt=f"{a}{op}{b}=", ground_truth=result, data_source="arith", answer=result)

    def wrong_answer(self, sample: Sample, rng: random.Random) -> str:
        """An answer off by a slip a model makes: a unit or a carry (1, 2, 10 or 11), either way."""
        right = int(sample.ground_truth)
        while True:
            wrong = right + rng.choice((1, 2, 10, 11)) * rng.choice((-1, 1))
            if wrong >= 0 or right < 0:  # a negative answer only where the right one is
                return str(wrong)

    def check(self, response: str, ground_truth) -> tuple[bool, bool]:
        text = first_line(response)
        return text == str(ground_truth), bool(_NUMBER.fullmatch(text))
