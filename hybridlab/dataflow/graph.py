"""Dataflow: an RL step as an ordered list of stages, validated, then run with futures.

Dependencies come from the declared fields: a stage waits for the earlier stages that write
what it reads (and, to keep results deterministic, for earlier stages that read what it
writes or write the same field); stages that replace the rows are barriers. Everything
else runs concurrently, so e.g. the reference and old log-prob passes overlap when their
roles live on different devices.
"""
from __future__ import annotations

import dataclasses
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Any, Iterable, Sequence

from hybridlab.dataflow.stages import STAGES, Stage, get_stage
from hybridlab.errors import UserError
from hybridlab.protocol import Batch


@dataclasses.dataclass
class StepResult:
    """What one RL step produced: the final Batch (every field the stages wrote), metrics, and
    ``stages``: each stage with the fields it added, in the order the stages finished."""

    step: int
    batch: Batch
    metrics: dict[str, Any]
    stages: list[tuple[str, list[str]]] = dataclasses.field(default_factory=list)


class DataflowError(UserError):
    """A dataflow that cannot run; the message lists every problem."""


class StageError(RuntimeError):
    """A stage failed while running; names the stage and its role, chained to the cause."""

    def __init__(self, stage: Stage, cause: BaseException):
        self.stage = stage
        super().__init__(f"stage {stage.name!r} (role {stage.role or 'controller'}) failed: "
                         f"{type(cause).__name__}: {cause}")


class Dataflow:
    """An editable list of stages; ``validate`` before ``run``."""

    def __init__(self, stages: Iterable[str | Stage]):
        self.stages: list[Stage] = [s if isinstance(s, Stage) else get_stage(s) for s in stages]

    @property
    def names(self) -> list[str]:
        """Return the stage names in order."""
        return [s.name for s in self.stages]

    def __repr__(self) -> str:
        return f"Dataflow({' -> '.join(self.names)})"

    def table(self, cfg: Any) -> list[dict]:
        """Return one row per stage (name, role, inputs, outputs, what it does) for display."""
        return [{"stage": s.name, "role": s.role or "controller", "inputs": ", ".join(s.inputs(cfg)),
                 "outputs": ", ".join(s.outputs(cfg)) or "(rows)", "does": s.doc} for s in self.stages]

    # ------------------------------------------------------------ validation
    def problems(self, cfg: Any, roles: Iterable[str], initial: Iterable[str]) -> list[str]:
        """Return every reason the dataflow cannot run with these roles and initial fields."""
        roles, have, out = set(roles), set(initial), []
        if not self.stages:
            out.append("dataflow: no stages")
        for i, stage in enumerate(self.stages):
            for role in [r for r in (stage.role, *stage.needs) if r]:
                if role not in roles:
                    out.append(f"dataflow[{i}] {stage.name}: runs on role {role!r}, which the device mapping does"
                               f" not have (roles: {', '.join(sorted(roles))})")
            for field in stage.inputs(cfg):
                if field not in have:
                    makers = sorted(s.name for s in STAGES.values() if field in s.outputs(cfg))
                    hint = f"; add a stage that produces it ({', '.join(makers)}) before it" if makers else ""
                    out.append(f"dataflow[{i}] {stage.name}: input {field!r} is not produced by any earlier stage"
                               f"{hint}")
            out += [f"dataflow[{i}] {stage.name}: {reason}" for reason in (stage.check(cfg) if stage.check else [])]
            have.update(stage.outputs(cfg))
        return out

    def validate(self, cfg: Any, roles: Iterable[str], initial: Iterable[str]) -> "Dataflow":
        """Raise DataflowError listing every problem; returns self when the dataflow can run."""
        problems = self.problems(cfg, roles, initial)
        if problems:
            raise DataflowError("dataflow is invalid:\n  - " + "\n  - ".join(problems))
        return self

    def dependencies(self, cfg: Any) -> list[set[int]]:
        """Return, per stage, the indices of earlier stages it must wait for."""
        deps: list[set[int]] = []
        for j, b in enumerate(self.stages):
            b_in, b_out = set(b.inputs(cfg)), set(b.outputs(cfg))
            mine = set()
            for i, a in enumerate(self.stages[:j]):
                a_in, a_out = set(a.inputs(cfg)), set(a.outputs(cfg))
                if a.replaces_rows or b.replaces_rows or a_out & (b_in | b_out) or a_in & b_out:
                    mine.add(i)
            deps.append(mine)
        return deps

    # --------------------------------------------------------------- running
    def run(self, ctx: Any, batch: Batch, skip: Sequence[str] = (),
            trace: list | None = None) -> tuple[Batch, dict[str, Any]]:
        """Run the stages on ``batch`` (those named in ``skip`` count as done); returns the final
        batch and the merged metrics, with ``timing/<stage>_s`` per stage. ``trace`` (a list)
        receives ``(stage name, fields it added or replaced)`` as each stage finishes."""
        deps = self.dependencies(ctx.cfg)
        done = {i for i, s in enumerate(self.stages) if s.name in skip}
        pending = [i for i in range(len(self.stages)) if i not in done]
        metrics: dict[str, Any] = {}
        running: dict[Any, int] = {}
        with ThreadPoolExecutor(max_workers=max(1, len(self.stages)), thread_name_prefix="stage") as pool:
            while pending or running:
                for i in [i for i in pending if deps[i] <= done]:
                    pending.remove(i)
                    running[pool.submit(_timed, self.stages[i], ctx, batch)] = i
                finished, _ = wait(list(running), return_when=FIRST_COMPLETED)
                for future in finished:
                    i = running.pop(future)
                    stage = self.stages[i]
                    try:
                        new, stage_metrics, seconds = future.result()
                    except BaseException as exc:
                        for other in running:
                            other.cancel()
                        wait(list(running))
                        raise StageError(stage, exc) from exc
                    if trace is not None:
                        trace.append((stage.name, _fields(new)))
                    batch = merge(batch, new, stage.replaces_rows)
                    metrics.update(stage_metrics)
                    metrics[f"timing/{stage.name}_s"] = seconds
                    done.add(i)
        return batch, metrics


def _timed(stage: Stage, ctx: Any, batch: Batch):
    timeline = getattr(ctx, "timeline", None)
    if timeline is not None:  # worker calls made by this thread are stamped with the stage
        timeline.stage = stage.name
    if hasattr(ctx, "stage_starting"):
        ctx.stage_starting(stage)
    start = time.perf_counter()
    new, metrics = stage.fn(ctx, batch)
    if hasattr(ctx, "stage_finished"):
        ctx.stage_finished(stage)
    return new, metrics, time.perf_counter() - start


def _fields(new: Batch | None) -> list[str]:
    return [] if new is None else [*new.tensors, *new.objects]


def merge(batch: Batch, new: Batch | None, replaces_rows: bool) -> Batch:
    """Return ``batch`` with a stage's output merged in (or the output itself, for a stage that
    replaces rows); raises ValueError when the row counts differ."""
    if new is None:
        return batch
    if replaces_rows:
        return new
    if len(new) != len(batch):
        raise ValueError(f"a stage returned {len(new)} rows for a batch of {len(batch)}")
    return Batch({**batch.tensors, **new.tensors}, {**batch.objects, **new.objects}, {**batch.meta, **new.meta})
