"""A time bound for the scorers' algebra (sympy can take minutes on an adversarial answer).

``SIGALRM`` exists only on a process's main thread (the reward worker's, ``hybridlab score``'s);
there the bound raises ``TimeoutError``. Off it (a thread, an async actor) the work runs unbounded
here, and ``reward.timeout_s`` cuts off a hung batch.
"""
from __future__ import annotations

import signal
import threading
from typing import Callable, TypeVar

T = TypeVar("T")


class _Alarm(BaseException):
    """Raised by the alarm: a BaseException, so a library's ``except Exception`` lets it through."""


def bounded(work: Callable[[], T], seconds: float, what: str) -> T:
    """Return ``work()``; on the main thread raises TimeoutError naming ``what`` past ``seconds``."""
    if threading.current_thread() is not threading.main_thread():
        return work()

    def alarm(signum, frame):
        raise _Alarm

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return work()
    except _Alarm:
        raise TimeoutError(f"{what} took longer than {seconds:g} s") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
