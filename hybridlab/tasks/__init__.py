"""Tasks with verifiable rewards (arith, reverse, countdown, calc with a tool, reasoning-gym's
generators) and verl-format datasets."""
from hybridlab.tasks.base import TASKS, Sample, Task, get_task, parse_task_options, register_task
from hybridlab.tasks import arith, calc, countdown, reasoning_gym, reverse  # noqa: F401  (register built-ins)

__all__ = ["TASKS", "Sample", "Task", "get_task", "parse_task_options", "register_task"]
