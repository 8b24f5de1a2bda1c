"""Reward functions behind one interface: ``fn(data_source, solution_str, ground_truth, extra_info)``.

That is verl's ``compute_score`` signature, so a verl reward function is used unchanged. It
returns a float, or a dict with ``score`` (and optionally ``acc``). Built in: the tasks'
rule scorers; a user's function is named by an import path ``package.module:function`` or a
file ``path/to/file.py:function``.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
from pathlib import Path
from typing import Any, Callable

from hybridlab.errors import UserError

ScoreFn = Callable[..., Any]


def load_function(spec: str) -> ScoreFn:
    """Return the function named by ``module:function`` or ``file.py:function``."""
    if ":" not in spec:
        raise UserError(f"reward.function {spec!r} must look like package.module:function or path/file.py:function")
    where, name = spec.rsplit(":", 1)
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise UserError(f"reward.function: no file {where!r}")
        module_spec = importlib.util.spec_from_file_location(f"hybridlab_user_reward_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            raise UserError(f"reward.function: cannot import {where!r}: {exc}") from None
    fn = getattr(module, name, None)
    if fn is None:
        raise UserError(f"reward.function: {where!r} has no function {name!r}")
    if not callable(fn):
        raise UserError(f"reward.function: {where}:{name} is a {type(fn).__name__}, not a function")
    try:
        inspect.signature(fn).bind("data_source", "solution_str", "ground_truth", None)
    except TypeError:
        raise UserError(f"reward.function: {where}:{name}{inspect.signature(fn)} cannot be called as"
                        " fn(data_source, solution_str, ground_truth, extra_info) (verl's compute_score)") from None
    except ValueError:  # no signature to read (a builtin): it is called as it is
        pass
    return fn


class RuleScorer:
    """The built-in task scorers, chosen per sample by ``data_source``."""

    def __init__(self, format_score: float = 0.0):
        self.format_score = format_score
        self._tasks: dict[str, Any] = {}

    def task(self, data_source: str):
        """Return the task that scores ``data_source`` (cached)."""
        if data_source not in self._tasks:
            from hybridlab.tasks.base import task_for_source

            task = task_for_source(data_source)
            task.format_score = self.format_score
            self._tasks[data_source] = task
        return self._tasks[data_source]

    def __call__(self, data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> dict:
        task = self.task(data_source)
        return {"score": task.score(solution_str, ground_truth), "acc": float(task.check(solution_str, ground_truth)[0])}


def score_one(fn: ScoreFn, data_source: str, text: str, ground_truth: Any, extra_info: Any) -> tuple[float, float | None]:
    """Return (score, acc or None) from a reward function's number or dict answer; raises
    ValueError for anything else (None, a string, NaN, inf), which scores ``error_score``."""
    out = fn(data_source, text, ground_truth, extra_info)
    acc = None
    if isinstance(out, dict):
        if "score" not in out:
            raise ValueError(f"reward function returned a dict without 'score': {sorted(out)}")
        out, acc = out["score"], out.get("acc")
    if isinstance(out, bool) or not isinstance(out, (int, float)) and not _is_number(out):
        raise ValueError(f"reward function returned {type(out).__name__} {out!r:.40}, not a number")
    if not math.isfinite(float(out)):
        raise ValueError(f"reward function returned {float(out)}, not a finite number")
    return float(out), None if acc is None else float(acc)


def _is_number(value: Any) -> bool:
    """True for number-like values that are not str/bytes (numpy and torch scalars)."""
    return hasattr(value, "__float__") and not isinstance(value, (str, bytes))
