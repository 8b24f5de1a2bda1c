"""The one piece of LaTeX reading the math scorers share: where a brace group closes."""
from __future__ import annotations


def closing_brace(text: str, start: int) -> int | None:
    """Return the index of the ``}`` that closes the first ``{`` at or after ``start`` (braces
    balanced; a ``}`` before any ``{`` counts down too, as the MATH and DAPO scorers count), or None."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
    return None
