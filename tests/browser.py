"""Debian's chromium for the browser tests (driven by playwright through ``executable_path``)."""
import os
import shutil

import pytest


def chromium() -> str:
    """Return the path of Debian's chromium. Without it the calling test is skipped, except under
    CI (CI=true), where a missing browser fails it with the command that installs it."""
    path = shutil.which("chromium")
    if path is None:
        message = ("Debian's chromium is not installed: run `apt-get install -y chromium` as root"
                   " (`make install` or `make test` does it when run as root)")
        if os.environ.get("CI", "").lower() in ("true", "1"):
            pytest.fail(f"CI is set and {message}")
        pytest.skip(message)
    return path


from hybridlab.bench.dashboard import LAUNCH_ARGS  # noqa: E402,F401  (one list for tests and bench)
