"""The ``python`` tool for agent rollouts (``rollout.tools=hybridlab.sandbox.tool:python``): the
model sends a program, the sandbox runs it, and the exit status, stdout and stderr come back as
the tool's answer. The run's ``sandbox`` settings apply (the rollout workers call ``configure``)."""
from __future__ import annotations

import threading

from hybridlab.config.schema import SandboxConfig
from hybridlab.sandbox.runner import Sandbox

ANSWER_CHARS = 2000  # of stdout and of stderr each, shown to the model (the rest is cut, and said so)
_lock = threading.Lock()
_config = SandboxConfig()
_sandbox: Sandbox | None = None


def configure(config: SandboxConfig) -> None:
    """Use ``config``'s interpreter and limits for the tool's next runs in this process."""
    global _config, _sandbox
    with _lock:
        if config != _config:
            _config, _sandbox = config, None


def _shared() -> Sandbox:
    global _sandbox
    with _lock:
        if _sandbox is None:
            _sandbox = Sandbox(_config)  # raises SandboxUnavailable, naming what is missing
        return _sandbox


def _cut(text: str) -> str:
    return text if len(text) <= ANSWER_CHARS else text[:ANSWER_CHARS] + f"\n[... {len(text) - ANSWER_CHARS} more characters]"


def python(code: str) -> dict:
    """Run a Python program in a sandbox (no network, no files but its own) and return its exit status and output.

    Args:
        code: The Python program to run; print what you want to see.
    """
    ran = _shared().run_python(code)
    answer = {"exit_code": ran.exit_code, "stdout": _cut(ran.stdout), "stderr": _cut(ran.stderr)}
    if ran.timed_out or ran.output_exceeded:
        answer["ended"] = (f"it ran past the {_config.wall_s:g} s limit" if ran.timed_out
                           else f"it wrote more than {_config.output_kb} KB")
    return answer


python.needs_sandbox = True  # the config check builds the sandbox first, so a missing one is named before the run
