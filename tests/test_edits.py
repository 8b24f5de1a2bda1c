"""StepBoundary: edits of a session wait for a step boundary, keep their order, and are never
applied inside a step or after their caller gave up."""
from __future__ import annotations

import threading
import time

import pytest

from hybridlab.dataflow.edits import StepBoundary


def test_an_edit_made_during_a_step_waits_for_its_end_and_returns_its_result():
    boundary, log = StepBoundary(), []
    inside, release = threading.Event(), threading.Event()

    def stepper():
        with boundary.step():
            log.append("step starts")
            inside.set()
            release.wait(5)
            log.append("step ends")
        with boundary.step():
            log.append("next step")

    thread = threading.Thread(target=stepper)
    thread.start()
    inside.wait(5)
    threading.Timer(0.3, release.set).start()
    assert boundary.run(lambda: log.append("edit") or 42) == 42
    thread.join(5)
    assert log.index("edit") > log.index("step ends") and log.index("edit") < log.index("next step")


def test_edits_apply_in_the_order_they_were_made():
    boundary, log = StepBoundary(), []
    with boundary.lock:  # a step is running
        threads = [threading.Thread(target=boundary.run, args=(lambda i=i: log.append(i),)) for i in range(3)]
        for t in threads:
            t.start()
            time.sleep(0.1)  # each edit is queued before the next one is made
    for t in threads:
        t.join(5)
    assert log == [0, 1, 2]


def test_an_edit_from_inside_a_step_is_refused():
    boundary = StepBoundary()
    with boundary.step():
        with pytest.raises(RuntimeError, match="cannot run inside a step: call it between steps"):
            boundary.run(lambda: None)


def test_an_edit_whose_caller_gave_up_is_never_applied():
    import ctypes

    boundary, log, caller = StepBoundary(), [], {}

    def impatient():
        try:
            boundary.run(lambda: log.append("late edit"), poll_s=0.01)
        except KeyboardInterrupt:
            caller["gave up"] = True

    with boundary.lock:  # a step is running while the user waits, then presses Ctrl-C
        thread = threading.Thread(target=impatient)
        thread.start()
        time.sleep(0.2)
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(KeyboardInterrupt))
        thread.join(5)
    with boundary.step():  # the next step boundary
        pass
    assert caller == {"gave up": True} and log == []


def test_an_edit_error_reaches_its_caller_and_the_next_edit_still_runs():
    boundary = StepBoundary()
    with pytest.raises(ValueError, match="bad edit"):
        boundary.run(lambda: (_ for _ in ()).throw(ValueError("bad edit")))
    assert boundary.run(lambda: "fine") == "fine"
