"""Waiting for a worker call on every rank, and the error that names the role, rank and method
when one fails, dies or does not answer."""
from __future__ import annotations

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from hybridlab.controller.worker import RemoteError


class WorkerError(RuntimeError):
    """A worker call failed: names the role, rank and method, with the remote traceback.

    ``kind`` says how: "raised" (the method raised), "died" (the process is gone), "stuck"
    (no answer by the call's deadline; its stacks were written) or "timed out" (no answer
    within an explicit timeout)."""

    def __init__(self, role: str, rank: int, method: str, detail: str, kind: str = "raised"):
        self.role, self.rank, self.method, self.kind = role, rank, method, kind
        super().__init__(f"worker {role} rank {rank} {kind} in {method}:\n{detail}")


def raise_for(exc: BaseException, role: str, rank: int, method: str) -> None:
    """Raise the WorkerError that ``exc`` (from waiting on ``role``'s ``rank``) means; returns never."""
    if isinstance(exc, RayTaskError):
        cause = exc.cause if isinstance(getattr(exc, "cause", None), RemoteError) else None
        detail = cause.tb if cause else str(exc)
        if "ModuleNotFoundError" in detail:
            detail += ("\nhint: worker classes must be importable in the worker processes: install their"
                       " module, or call ray.cloudpickle.register_pickle_by_value(module) before starting")
        raise WorkerError(role, rank, cause.method if cause else method, detail) from None
    if isinstance(exc, RayActorError):
        raise WorkerError(role, rank, method, f"the worker process died ({exc.__class__.__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''}); re-create the group",
                          kind="died") from None
    if isinstance(exc, GetTimeoutError):
        raise WorkerError(role, rank, method, "no answer within the timeout", kind="timed out") from None
    raise exc


def get_all(refs: list, ranks: list[int], role: str, method: str, timeout: float | None) -> list:
    """ray.get all refs within ``timeout``, turning a failure on any rank into a WorkerError.

    ray.get raises as soon as one rank fails, so a crash is reported even while its peers
    still wait (e.g. in a collective that can now never finish).
    """
    try:
        return ray.get(refs, timeout=timeout)
    except GetTimeoutError as exc:
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=0)
        _drain([r for r in refs if r not in pending], wait_s=0)
        raise_for(exc, role, ranks[refs.index(pending[0])] if pending else ranks[0], method)
    except BaseException as exc:
        rank = _failing_rank(refs, ranks, exc)
        _drain(refs)
        raise_for(exc, role, rank, method)


def _failing_rank(refs: list, ranks: list[int], exc: BaseException) -> int:
    cause = getattr(exc, "cause", None)
    if isinstance(cause, RemoteError):
        return cause.rank
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
    for ref in ready:
        try:
            ray.get(ref)
        except BaseException:
            return ranks[refs.index(ref)]
    return ranks[0]


def _drain(refs: list, wait_s: float = 1.0) -> None:
    """Collect the other ranks' answers after a failure, so Ray does not report them as unhandled."""
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s) if refs else ([], [])
    for ref in ready:
        try:
            ray.get(ref)
        except BaseException:
            pass
