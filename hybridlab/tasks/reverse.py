"""String reversal: ``reverse abcd=`` -> ``dcba``."""
from __future__ import annotations

import random
import string

from hybridlab.errors import UserError
from hybridlab.tasks.arith import first_line
from hybridlab.tasks.base import Sample, Task, register_task


LENGTHS = ("uniform", "long_tail")
MAX_LEN = 256


@register_task
class Reverse(Task):
    """Reverse a random lowercase string of ``min_len`` to ``max_len`` letters, its length drawn
    uniformly, or with ``lengths="long_tail"`` from a Pareto tail (shape ``tail``) above
    ``min_len``, cut at ``max_len``: most strings short, a few long, as RL responses are (the
    answer's length follows the string's)."""

    name = "reverse"

    def __init__(self, min_len: int = 3, max_len: int = 6, alphabet: str = string.ascii_lowercase,
                 format_score: float = 0.0, lengths: str = "uniform", tail: float = 1.2):
        super().__init__(format_score)
        if not (isinstance(min_len, int) and isinstance(max_len, int) and 1 <= min_len <= max_len <= MAX_LEN):
            raise UserError(f"reverse options need 1 <= min_len <= max_len <= {MAX_LEN}, got {min_len}, {max_len}")
        if not alphabet or any(c.isspace() or c == "=" for c in alphabet):
            raise UserError("reverse option alphabet must be non-empty, without spaces or '='")
        if lengths not in LENGTHS or not (isinstance(tail, (int, float)) and tail > 0):
            raise UserError(f"reverse option lengths must be one of {', '.join(LENGTHS)} (got {lengths!r}) and tail"
                            f" positive (got {tail!r})")
        self.min_len, self.max_len, self.alphabet = min_len, max_len, alphabet
        self.lengths, self.tail = lengths, tail

    def _length(self, rng: random.Random) -> int:
        if self.lengths == "uniform":
            return rng.randint(self.min_len, self.max_len)
        return min(self.max_len, int(self.min_len * rng.paretovariate(self.tail)))

    def make_sample(self, rng: random.Random) -> Sample:
        n = self._length(rng)
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
