"""A time bound for the scorers' algebra (sympy can take minutes on an adversarial answer).

``SIGALRM`` exists only on a process's main thread (the reward worker's, ``hybridlab score``'s);
there the bound raises ``TimeoutError``. Off it (a thread, an async actor) the work runs unbounded
here, and ``reward.timeout_s`` cuts off a hung batch.

The alarm is the process's, and the kernel hands it to a thread that does not block it. A library
may have left ``SIGALRM`` blocked on the main thread: the alarm then goes to another thread and
the main thread only sees it once its work returns (a 30 s sleep bounded at 1 s took 30 s). So
the main thread unblocks ``SIGALRM`` for the work, and its mask is put back after it.
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
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGALRM})
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return work()
    except _Alarm:
        raise TimeoutError(f"{what} took longer than {seconds:g} s") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        signal.signal(signal.SIGALRM, previous)
