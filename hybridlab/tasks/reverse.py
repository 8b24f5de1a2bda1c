"""String reversal: ``reverse abcd=`` -> ``dcba``."""
from __future__ import annotations

import random
import string

from hybridlab.errors import UserError
from hybridlab.tasks.arith import first_line
from hybridlab.tasks.base import Sample, Task, register_task


@register_task
class Reverse(Task):
    """Reverse a random lowercase string of ``min_len`` to ``max_len`` letters."""

    name = "reverse"

    def __init__(self, min_len: int = 3, max_len: int = 6, alphabet: str = string.ascii_lowercase,
                 format_score: float = 0.0):
        super().__init__(format_score)
        if not (isinstance(min_len, int) and isinstance(max_len, int) and 1 <= min_len <= max_len <= 64):
            raise UserError(f"reverse options need 1 <= min_len <= max_len <= 64, got {min_len}, {max_len}")
        if not alphabet or any(c.isspace() or c == "=" for c in alphabet):
            raise UserError("reverse option alphabet must be non-empty, without spaces or '='")
        self.min_len, self.max_len, self.alphabet = min_len, max_len, alphabet

    def make_sample(self, rng: random.Random) -> Sample:
        n = rng.randint(self.min_len, self.max_len)
        text = "".join(rng.choice(self.alphabet) for _ in range(n))
        return Sample(prompt=f"reverse {text}=", ground_truth=text[::-1], data_source="reverse",
                      answer=text[::-1])

    def wrong_answer(self, sample: Sample, rng: random.Random) -> str:
        """The reversal with two neighbouring letters swapped, or one letter changed."""
        right = str(sample.ground_truth)
        while True:
            chars = list(right)
            i = rng.randrange(len(chars))
            if len(chars) > 1 and rng.random() < 0.5:
                j = min(i + 1, len(chars) - 1) if i < len(chars) - 1 else i - 1
                chars[i], chars[j] = chars[j], chars[i]
            else:
                chars[i] = rng.choice(self.alphabet)
            if "".join(chars) != right:
                return "".join(chars)

    def check(self, response: str, ground_truth) -> tuple[bool, bool]:
        text = first_line(response)
        return text == ground_truth, bool(text) and all(c in self.alphabet for c in text)
