"""User-facing errors: raised for bad input, printed by the CLI without a traceback."""


class UserError(Exception):
    """A mistake in what the user asked for (unknown name, bad value, missing file).

    The message must say what is wrong and what is allowed; the CLI prints it as
    ``error: <message>`` and exits with status 2.
    """


def unknown(kind: str, name: object, allowed) -> UserError:
    """Return a UserError for an unknown ``kind`` called ``name``, listing the allowed names."""
    allowed = sorted(str(a) for a in allowed)
    return UserError(f"unknown {kind} {name!r}; choose one of: {', '.join(allowed)}")
