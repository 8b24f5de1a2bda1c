"""Model-written code run in a real sandbox (bubblewrap, a pids cgroup, resource limits): the
runner (``runner.py``) and the code tasks' harness and scorer (``code_tests.py``)."""
from __future__ import annotations

from hybridlab.sandbox.runner import Execution, Sandbox, SandboxUnavailable

__all__ = ["Execution", "Sandbox", "SandboxUnavailable"]
