"""Reward functions behind one interface: ``fn(data_source, solution_str, ground_truth, extra_info)``.

That is verl's ``compute_score`` signature, so a verl reward function is used unchanged. It
returns a float, or a dict with ``score`` (and optionally ``acc``); the dict's other numeric
entries are the sample's reward components (verl's ``reward_extra_info``: GDPO reads them). Built in: the tasks'
rule scorers; a user's function is named by an import path ``package.module:function`` or a
file ``path/to/file.py:function``.
"""
from __future__ import annotations

import inspect
import math
from typing import Any, Callable

from hybridlab.config.schema import RewardConfig
from hybridlab.errors import UserError
from hybridlab.tasks.base import task_for_source
from hybridlab.user_code import load_object

ScoreFn = Callable[..., Any]


def load_function(spec: str) -> ScoreFn:
    """Return the function named by ``module:function`` or ``file.py:function``."""
    fn = load_object(spec, "reward.function")
    where, name = spec.rsplit(":", 1)
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

    def __init__(self, format_score: float = RewardConfig.format_score):
        self.format_score = format_score
        self._tasks: dict[str, Any] = {}

    def task(self, data_source: str):
        """Return the task that scores ``data_source`` (cached)."""
        if data_source not in self._tasks:
            task = task_for_source(data_source)
            task.format_score = self.format_score
            self._tasks[data_source] = task
        return self._tasks[data_source]

    def __call__(self, data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> dict:
        task = self.task(data_source)
        return {"score": task.score(solution_str, ground_truth), "acc": float(task.check(solution_str, ground_truth)[0])}


def score_one(fn: ScoreFn, data_source: str, text: str, ground_truth: Any,
              extra_info: Any) -> tuple[float, float | None, dict[str, float]]:
    """Return (score, acc or None, the other numeric entries of a dict answer) from a reward
    function's number or dict answer; raises ValueError for anything else (None, a string,
    NaN, inf), which scores ``error_score``."""
    out = fn(data_source, text, ground_truth, extra_info)
    acc, components = None, {}
    if isinstance(out, dict):
        if "score" not in out:
            raise ValueError(f"reward function returned a dict without 'score': {sorted(out)}")
        components = {k: float(v) for k, v in out.items()
                      if k not in ("score", "acc") and _is_number(v) and not isinstance(v, bool)}
        out, acc = out["score"], out.get("acc")
    if isinstance(out, bool) or not isinstance(out, (int, float)) and not _is_number(out):
        raise ValueError(f"reward function returned {type(out).__name__} {out!r:.40}, not a number")
    if not math.isfinite(float(out)):
        raise ValueError(f"reward function returned {float(out)}, not a finite number")
    return float(out), None if acc is None else float(acc), components


def _is_number(value: Any) -> bool:
    """True for number-like values that are not str/bytes (numpy and torch scalars)."""
    return hasattr(value, "__float__") and not isinstance(value, (str, bytes))


Scored = tuple[float, "float | None", str, dict]  # (score, acc or None, error message or "", components)


def score_batch(fn: ScoreFn, items: list[tuple], error_score: float, timeout_s: float) -> list[Scored]:
    """Score ``items`` (data_source, text, ground_truth, extra_info) with ``fn``; returns one
    (score, acc, error, components) per item, a failed item scoring ``error_score`` with its
    error and no components.

    With ``timeout_s > 0`` the items are scored in a forked child process that is killed when
    the batch takes longer: the items it did not finish score ``error_score`` with a timeout
    error, and the run goes on (a hung function cannot be stopped inside this process).
    """
    if timeout_s <= 0:
        return [_safe_score(fn, *item, error_score) for item in items]
    import multiprocessing
    import time

    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_score_into, args=(fn, items, error_score, send), daemon=True)
    child.start()
    send.close()
    results: dict[int, Scored] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < len(items) and receive.poll(max(0.0, deadline - time.monotonic())):
            i, result = receive.recv()
            results[i] = result
    except EOFError:  # the child died: what it did not send counts as failed
        pass
    finally:
        if child.is_alive():
            child.kill()
        child.join()
        receive.close()
    missing = f"TimeoutError: reward.timeout_s={timeout_s:g} s passed before this sample was scored"
    return [results.get(i, (error_score, None, missing, {})) for i in range(len(items))]


def _safe_score(fn: ScoreFn, source: str, text: str, truth: Any, extra: Any, error_score: float) -> Scored:
    try:
        score, acc, components = score_one(fn, source, text, truth, extra)
        return score, acc, "", components
    except Exception as exc:  # a bad sample must not end the run
        return error_score, None, f"{type(exc).__name__}: {exc}", {}


def _score_into(fn: ScoreFn, items: list[tuple], error_score: float, send) -> None:
    for i, item in enumerate(items):
        send.send((i, _safe_score(fn, *item, error_score)))
    send.close()
