"""Reward functions behind one interface: ``fn(data_source, solution_str, ground_truth, extra_info)``.

That is verl's ``compute_score`` signature, so a verl reward function is used unchanged. It
returns a float, or a dict with ``score`` (and optionally ``acc``); the dict's entries are what
verl records as ``reward_extra_info`` (its validation metrics read them, and ``pred`` for maj@N),
and its other numeric entries are the sample's reward components (GDPO reads them). Built in: the tasks'
rule scorers and those of the text sources verl scores by default (``hybridlab.scorers``); a
user's function is named by an import path ``package.module:function`` or a file
``path/to/file.py:function``.
"""
from __future__ import annotations

import asyncio
import functools
import inspect
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, NamedTuple

from hybridlab.errors import UserError
from hybridlab.sandbox import Sandbox, SandboxUnavailable
from hybridlab.scorers import ScorerOptions, SourceScorer, family, known_sources, reports_acc, scorer_for
from hybridlab.tasks.base import TASKS, Sample, task_for_source
from hybridlab.user_code import load_object

ScoreFn = Callable[..., Any]


def load_function(spec: str, kwargs: dict | None = None) -> ScoreFn:
    """Return the function named by ``module:function`` or ``file.py:function``, with
    ``kwargs`` (verl's ``reward_kwargs``) bound; it is called by keyword, as verl calls it."""
    fn = load_object(spec, "reward.function")
    where, name = spec.rsplit(":", 1)
    if not callable(fn):
        raise UserError(f"reward.function: {where}:{name} is a {type(fn).__name__}, not a function")
    kwargs = dict(kwargs or {})
    try:
        inspect.signature(fn).bind(data_source="", solution_str="", ground_truth=None, extra_info=None, **kwargs)
    except TypeError as exc:
        extra = f", {', '.join(f'{k}=...' for k in kwargs)}" if kwargs else ""
        raise UserError(f"reward.function: {where}:{name}{inspect.signature(fn)} cannot be called as"
                        f" fn(data_source=..., solution_str=..., ground_truth=..., extra_info=...{extra})"
                        f" (verl's compute_score, called by keyword): {exc}") from None
    except ValueError:  # no signature to read (a builtin): it is called as it is
        pass
    return functools.partial(fn, **kwargs) if kwargs else fn


def rule_for(data_source: str, options: ScorerOptions = ScorerOptions()) -> SourceScorer:
    """Return the built-in scorer of ``data_source``: a task's (``arith``, ``x/arith``...) or that of
    a source verl scores by default; raises UserError naming the sources that have one
    (SandboxUnavailable for a code source where code cannot be isolated)."""
    if data_source.rsplit("/", 1)[-1] in TASKS:
        task = task_for_source(data_source)
        task.format_score = options.format_score
        if task.needs_sandbox:  # raises SandboxUnavailable where code cannot be isolated
            task.use_sandbox(Sandbox(options.sandbox))

        def graded(text: str, truth: Any) -> dict:
            score, correct = task.grade(text, truth)  # one check: a sandboxed task's costs an execution
            return {"score": score, "acc": float(correct)}

        return graded
    try:
        return scorer_for(data_source, options)
    except SandboxUnavailable:  # a code source has a scorer: what is missing is the sandbox
        raise
    except UserError as exc:
        raise UserError(f"{exc}. Data sources with a built-in scorer: the tasks {', '.join(sorted(TASKS))}"
                        f" (also as PREFIX/TASK) and verl's {', '.join(known_sources())};"
                        " for other data set reward.kind=function with your own reward.function") from None


def runs_code(data_source: str) -> bool:
    """True when ``data_source``'s built-in scorer runs the answer in the code sandbox."""
    name = data_source.rsplit("/", 1)[-1]
    return family(data_source) == "code" or (name in TASKS and TASKS[name].needs_sandbox)


def check_sources(samples: Iterable[Sample], options: ScorerOptions) -> None:
    """Raise UserError naming the first sample (its file and row) whose ``data_source`` has no
    built-in scorer, and the sources that have one."""
    seen: set[str] = set()
    for sample in samples:
        if sample.data_source in seen:
            continue
        seen.add(sample.data_source)
        try:
            rule_for(sample.data_source, options)
        except UserError as exc:
            raise UserError(f"{sample.origin or 'a prompt of data.task'}: {exc}") from None


class RuleScorer:
    """The built-in scorers, chosen per sample by ``data_source`` (verl's compute_score signature)."""

    def __init__(self, options: ScorerOptions = ScorerOptions()):
        self.options = options
        self._scorers: dict[str, SourceScorer] = {}

    def scorer(self, data_source: str) -> SourceScorer:
        """Return the scorer of ``data_source`` (cached); raises UserError when there is none."""
        if data_source not in self._scorers:
            self._scorers[data_source] = rule_for(data_source, self.options)
        return self._scorers[data_source]

    def __call__(self, data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> dict:
        return self.scorer(data_source)(solution_str, ground_truth)

    def accuracy(self, data_source: str, text: str, ground_truth: Any) -> float:
        """Return the built-in scorer's accuracy for one response (NaN where no scorer serves the
        source, or it fails on this response)."""
        try:
            return float(self(data_source, text, ground_truth)["acc"])
        except Exception:
            return float("nan")


def score_one(fn: ScoreFn, data_source: str, text: str, ground_truth: Any,
              extra_info: Any) -> tuple[float, float | None, dict[str, Any]]:
    """Return (score, acc or None, the entries of a dict answer: numbers as floats and strings
    such as ``pred``, {} for a number) from a reward function's number or dict answer; raises
    ValueError for anything else (None, a string, NaN, inf), which scores ``error_score``."""
    out = fn(data_source=data_source, solution_str=text, ground_truth=ground_truth, extra_info=extra_info)
    if inspect.isawaitable(out):  # an async reward function (verl awaits those): run it to its result
        out = asyncio.run(_result_of(out))
    acc, answer = None, {}
    if isinstance(out, dict):
        if "score" not in out:
            raise ValueError(f"reward function returned a dict without 'score': {sorted(out)}")
        answer = {k: v if isinstance(v, str) else float(v) for k, v in out.items()
                  if isinstance(v, str) or _is_number(v)}
        out, acc = out["score"], out.get("acc")
    if isinstance(out, bool) or not isinstance(out, (int, float)) and not _is_number(out):
        raise ValueError(f"reward function returned {type(out).__name__} {out!r:.40}, not a number")
    if not math.isfinite(float(out)):
        raise ValueError(f"reward function returned {float(out)}, not a finite number")
    return float(out), None if acc is None else float(acc), answer


async def _result_of(awaitable: Any) -> Any:
    return await awaitable


def _is_number(value: Any) -> bool:
    """True for number-like values that are not str/bytes (numpy and torch scalars)."""
    return hasattr(value, "__float__") and not isinstance(value, (str, bytes))


Scored = tuple[float, "float | None", str, dict]  # (score, acc or None, error message or "", dict answer)


class SampleScore(NamedTuple):
    """One response scored as a run scores it."""
    score: float
    acc: float              # NaN where unknown
    error: str              # "" unless the scorer failed (then score is error_score)
    answer: dict            # the entries of the scorer's dict answer as verl records them ({} for a number)
    components: dict        # the reward components: its numeric entries other than score and acc

    @property
    def acc_reported(self) -> bool:
        """True when the scorer's answer carried the acc, as verl sees it."""
        return "acc" in self.answer


def score_samples(fn: ScoreFn, rules: RuleScorer, kind: str, items: list[tuple], error_score: float,
                  timeout_s: float) -> list[SampleScore]:
    """Return each item (data_source, text, ground_truth, extra_info) scored by ``fn`` as the reward
    worker scores it: ``timeout_s`` bounds a user's function and math-verify (the other built-in
    rules never hang); a function that gives no acc gets the built-in scorer's, and a failed
    built-in scorer none (it is not run again). Code answers run ``sandbox.parallel`` at once."""
    code = kind == "rule" and any(runs_code(item[0]) for item in items)
    # the sandbox bounds code itself; a forked child killed at reward.timeout_s would leave its sandboxes behind
    hangs = (kind == "function" or rules.options.math_verifier != "rules") and not code
    parallel = rules.options.sandbox.parallel if code else 1
    out = []
    for (source, text, truth, _), (score, acc, error, answer) in zip(
            items, score_batch(fn, items, error_score, timeout_s if hangs else 0.0, parallel)):
        components = {k: v for k, v in answer.items() if k not in ("score", "acc") and not isinstance(v, str)}
        if kind == "rule" and not reports_acc(source, rules.options):
            answer = {}  # verl's scorer of this source answers with a number
        if acc is None:
            acc = rules.accuracy(source, text, truth) if kind == "function" else float("nan")
        out.append(SampleScore(score, acc, error, answer, components))
    return out


def score_batch(fn: ScoreFn, items: list[tuple], error_score: float, timeout_s: float,
                parallel: int) -> list[Scored]:
    """Score ``items`` (data_source, text, ground_truth, extra_info) with ``fn``; returns one
    (score, acc, error, dict answer) per item, in order, a failed item scoring ``error_score``
    with its error and no answer. With ``timeout_s > 0`` in a child process killed at the
    deadline (``_score_forked``), else with ``parallel`` > 1 in threads (``_score_threaded``)."""
    if timeout_s > 0:
        return _score_forked(fn, items, error_score, timeout_s)
    if parallel > 1:
        return _score_threaded(fn, items, error_score, parallel)
    return [_safe_score(fn, *item, error_score) for item in items]


def _score_threaded(fn: ScoreFn, items: list[tuple], error_score: float, parallel: int) -> list[Scored]:
    """Score ``parallel`` items at once in threads (for scorers that wait on a subprocess: the
    sandbox); returns ``score_batch``'s answers."""
    for source in {item[0] for item in items}:  # built once, before the threads share them
        try:
            getattr(fn, "scorer", lambda _: None)(source)
        except Exception:  # named again, and scored error_score, by each of its items
            pass
    with ThreadPoolExecutor(parallel, thread_name_prefix="score") as pool:
        return list(pool.map(lambda item: _safe_score(fn, *item, error_score), items))


def _score_forked(fn: ScoreFn, items: list[tuple], error_score: float, timeout_s: float) -> list[Scored]:
    """Score the items in a forked child process that is killed when the batch takes longer than
    ``timeout_s`` (a hung function cannot be stopped inside this process): the items it did not
    finish score ``error_score`` with a timeout error, and the run goes on; returns
    ``score_batch``'s answers."""
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
        score, acc, answer = score_one(fn, source, text, truth, extra)
        return score, acc, "", answer
    except Exception as exc:  # a bad sample must not end the run
        return error_score, None, f"{type(exc).__name__}: {exc}", {}


def _score_into(fn: ScoreFn, items: list[tuple], error_score: float, send) -> None:
    for i, item in enumerate(items):
        send.send((i, _safe_score(fn, *item, error_score)))
    send.close()
