"""Code tasks scored as verl scores ``codecontests``, ``apps``, ``codeforces`` and ``taco`` (its
``prime_code``), but run in the sandbox: the code is the response's last ```` ```python ````
block (or the whole response), run against every test input by ``harness.py`` inside the
sandbox; its outputs are compared here, where the expected outputs stay.

The score is 1.0 when every test passes, otherwise the share of the first ten that pass (verl's
``continuous`` score). A stdin test passes when the printed text equals the expected one after
stripping (also line by line), when the non-empty lines equal the expected stripped non-empty
lines, or when they are numbers within ``numpy.allclose`` of the expected ones (not all
integers); a call-based test when the returned value equals the expected JSON value (or its
first element). A call-based answer that fails a test is scored as verl's per-test pass scores it:
that pass drops ``fn_name``, so the program runs as a stdin program (a function that prints
nothing gets 0). Differences from verl, chosen: each test runs in a fresh module (verl first runs
all tests in one, then each again); a call's result is compared as JSON, so a tuple equals a
list and a result JSON cannot encode fails; the time limits are ``sandbox.test_timeout_s`` per
test and ``sandbox.wall_s`` in all.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from hybridlab.sandbox.runner import Execution, Sandbox

HARNESS = Path(__file__).with_name("harness.py").read_text()  # run as /code/main.py in the sandbox
FIRST = 10  # verl's continuous score looks at the first ten tests


def extract_code(response: str) -> str:
    """Return the code of a response: what follows its last ```python fence, up to the next fence."""
    return response.split("```python")[-1].split("```")[0]


def read_cases(ground_truth: Any) -> dict:
    """Return the test cases ({"inputs", "outputs", "fn_name"?}) from verl's ground truth (a dict
    or its JSON text); raises ValueError for anything else."""
    cases = json.loads(ground_truth) if isinstance(ground_truth, (str, bytes)) else ground_truth
    if not isinstance(cases, dict) or not isinstance(cases.get("inputs"), list) or \
            len(cases["inputs"]) != len(cases.get("outputs") or []):
        raise ValueError("code ground truth must be {'inputs': [...], 'outputs': [...]} of one length"
                         " (and optionally 'fn_name'), as verl's prime_code reads it")
    return cases


def run_tests(sandbox: Sandbox, code: str, cases: dict) -> tuple[list[dict], Execution]:
    """Run ``code`` on every input in one sandboxed execution; returns each test's raw result
    ({"output"} or {"error"}) and the execution. The harness reports each test as it finishes:
    a test it did not reach (``sandbox.wall_s`` or the output limit ended the run) is an error, and
    so is anything malformed on its channel (the program can write there too)."""
    call_based = cases.get("fn_name") is not None
    tests = {"inputs": [_text(x) if call_based else _lines(x) for x in cases["inputs"]], "fn_name": cases.get("fn_name"),
             "seconds": sandbox.config.test_timeout_s}
    ran = sandbox.run_python(HARNESS, files={"solution.py": code, "tests.json": json.dumps(tests)})
    why = "the sandbox's limit ended it" if ran.timed_out or ran.output_exceeded else f"exit {ran.exit_code}"
    results = [{"error": f"not reached ({why})"} for _ in tests["inputs"]]
    for line in ran.stdout.splitlines():
        try:
            got = json.loads(line)
            i = got["i"]
            valid = isinstance(got.get("output", got.get("error")), str) and 0 <= i < len(results)
        except Exception:
            continue
        if valid and "error" in results[i] and results[i]["error"].startswith("not reached"):
            results[i] = {k: v for k, v in got.items() if k in ("output", "error")}
    return results, ran


def passed(result: dict, expected: Any, call_based: bool) -> bool:
    """True when one test's raw result matches its expected output."""
    if not isinstance(result.get("output"), str):
        return False
    if call_based:
        try:
            output = json.loads(result["output"])
        except ValueError:
            return False
        return call_matches(output, json.loads(_text(expected)))
    return stdin_matches(result["output"], "\n".join(expected) if isinstance(expected, list) else str(expected))


def call_matches(output: Any, expected: Any) -> bool:
    """A call's result against the expected JSON value, as verl compares them (dict keys read
    as integers where they are)."""
    expected = _int_keys(expected)
    return output == expected or (isinstance(expected, list) and bool(expected) and output == expected[0])


def stdin_matches(printed: str, expected: str) -> bool:
    """Printed text against the expected text, as verl's checks compare them in turn."""
    lines = printed.splitlines()
    if "\n".join(lines).strip() == expected.strip() or "\n".join(x.strip() for x in lines).strip() == expected.strip():
        return True
    wanted = [x.strip() for x in expected.split("\n") if x]
    if lines == [expected] or lines == wanted:
        return True
    lines = [x for x in lines if x]
    if lines == wanted:
        return True
    if len(lines) != len(wanted) or all(x.isdigit() and y.isdigit() for x, y in zip(lines, wanted)):
        return False
    try:
        return bool(np.allclose([float(x) for x in lines], [float(y) for y in wanted]))
    except ValueError:
        return False


def score_code(sandbox: Sandbox, response: str, ground_truth: Any) -> dict:
    """Return ``{"score", "acc", "tests_passed", "sandbox_limit"}`` for a response to a code task:
    the score as verl's (1.0 when all pass, else the share of the first ten), acc 1 when all pass,
    the share of all tests passed, and 1 when a sandbox limit ended the run."""
    cases, code = read_cases(ground_truth), extract_code(response)
    results, ran = run_tests(sandbox, code, cases)
    call_based = cases.get("fn_name") is not None
    ok = [passed(r, e, call_based) for r, e in zip(results, cases["outputs"])]
    if call_based and not all(ok):  # verl's per-test pass drops fn_name: the program runs as a stdin one
        results, ran = run_tests(sandbox, code, {**cases, "fn_name": None})
        ok = [passed(r, e, False) for r, e in zip(results, cases["outputs"])]
    score = 1.0 if all(ok) else sum(ok[:FIRST]) / max(1, min(FIRST, len(ok)))
    return {"score": score, "acc": float(all(ok)), "tests_passed": sum(ok) / max(1, len(ok)),
            "sandbox_limit": float(ran.timed_out or ran.output_exceeded)}


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _lines(value: Any) -> str:
    """A stdin test's input as text (verl joins a list of lines)."""
    return "\n".join(value) if isinstance(value, list) else str(value)


def _int_keys(value: Any) -> Any:
    """verl's reading of a JSON dict with integer keys (JSON keys are strings)."""
    try:
        if isinstance(value, dict):
            return [{int(k): v for k, v in value.items()}]
        if isinstance(value, list) and value and isinstance(value[0], dict):
            return [{int(k): v for k, v in value[0].items()}]
    except ValueError:
        pass
    return value
