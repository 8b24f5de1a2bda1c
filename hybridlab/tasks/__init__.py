"""Tasks with verifiable rewards (arith, reverse, countdown, countdown in Python run in the code
sandbox, calc with a tool, reasoning-gym's generators) and verl-format datasets."""
from hybridlab.tasks.base import TASKS, Sample, Task, get_task, parse_task_options, register_task
from hybridlab.tasks import arith, calc, countdown, countdown_code, reasoning_gym, reverse  # noqa: F401  (built-ins)

__all__ = ["TASKS", "Sample", "Task", "get_task", "parse_task_options", "register_task"]
