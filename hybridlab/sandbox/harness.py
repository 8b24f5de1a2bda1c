"""The test harness that runs *inside* the sandbox (as /code/main.py, on the sandbox's own
interpreter: standard library only). It runs /code/solution.py against each input of
/code/tests.json, each in a fresh module, the way verl's ``prime_code`` runs APPS-style tests:

- standard-input tasks: the program's statements become the body of a function ``code()``
  (an ``if __name__ == "__main__":`` block unwrapped), run with stdin holding the input and its
  printed output captured;
- call-based tasks (``fn_name``): the function, or ``Solution().fn_name`` where the program
  defines ``class Solution``, called with the input's lines read as JSON values.

Common modules are star-imported first, as verl's harness does. The expected outputs never
enter the sandbox: the harness prints one JSON line of raw results (each test's output or
error, one JSON line per test as it finishes) on a copy of its stdout, and the trainer compares
them (``code_tests.py``).
"""
import ast
import io
import json
import os
import signal
import sys
import types

STAR = ("string", "re", "datetime", "collections", "heapq", "bisect", "copy", "math", "random", "statistics",
        "itertools", "functools", "operator", "io", "sys", "json", "builtins", "typing")
PRELUDE = "".join(f"from {m} import *\n" for m in STAR) + "".join(f"import {m}\n" for m in STAR[:16]) + \
    "sys.setrecursionlimit(6*10**5)\n"


class TimeLimit(Exception):
    """A test ran past its time limit (raised inside the program by the timer)."""


class Stdin(io.StringIO):
    """stdin holding the input, whose readline returns lines without their newline (as verl's)."""

    def __init__(self, text):
        super().__init__(text)
        self.text, self.lines = text, iter(text.split("\n"))

    def readline(self, *args):
        """The next line, without its newline."""
        return next(self.lines)

    def readlines(self, *args):
        """Every line, without newlines."""
        return self.text.split("\n")

    def read(self, *args):
        """The whole input."""
        return self.text


def as_function(source):
    """The program's statements as the body of ``code()``, imports kept at the top."""
    try:
        tree = ast.parse(source)
        last = tree.body[-1]
        if isinstance(last, ast.If) and ast.unparse(last.test).strip() == "__name__ == '__main__'":
            source = ast.unparse(tree.body[:-1]) + "\n" + ast.unparse(last.body)
    except Exception:
        pass
    out, started = "", False
    for line in source.split("\n"):
        imported = line.startswith("from ") or line.startswith("import ")
        if not imported and not started:
            out += "stdin = sys.stdin\nstdout = sys.stdout\ndef code():\n"
            started = True
        out += ("\t" + line if started or not imported else line) + "\n"
    return out


def load(text):
    """Return a fresh module made of ``text``."""
    module = types.ModuleType("solution")
    exec(compile(text, "solution.py", "exec"), module.__dict__)
    return module


def give_input(raw):
    """Put the test's input on descriptor 0 too (``open(0).read()``, ``sys.stdin.buffer``)."""
    with open("/sandbox/.input", "w") as f:
        f.write(raw)
    fd = os.open("/sandbox/.input", os.O_RDONLY)
    if fd != 0:  # 0 itself when the last test's program closed it (open(0) does on exit)
        os.dup2(fd, 0)
        os.close(fd)


def run_one(source, fn_name, raw, seconds):
    """Return {"output": ...} (stdin tasks: the printed text; call-based: the result as JSON) or
    {"error": ...} for one test input, in a fresh module."""
    signal.setitimer(signal.ITIMER_REAL, seconds)
    real_stdin, real_stdout = sys.stdin, sys.stdout
    try:
        if fn_name is None:
            module = load(PRELUDE + as_function(source))
            give_input(raw)
            sys.stdin, sys.stdout = Stdin(raw), io.StringIO()
            try:
                module.code()
            except SystemExit:
                pass
            return {"output": sys.stdout.getvalue()}
        module = load(PRELUDE + source)
        target = module.Solution() if "class Solution" in source else module
        args = [json.loads(line) for line in raw.split("\n")]
        if args and isinstance(args[0], dict):
            try:
                args = [{int(k): v for k, v in args[0].items()}]
            except ValueError:
                pass
        result = getattr(target, fn_name)(*args)
        return {"output": json.dumps(list(result) if isinstance(result, tuple) else result)}
    except BaseException as exc:  # a wrong program, not a harness failure
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        sys.stdin, sys.stdout = real_stdin, real_stdout


def on_alarm(signum, frame):
    """A test's time limit: raised inside the program."""
    raise TimeLimit("time limit of the test passed")


def main():
    """Run every test and write one JSON line per test as it finishes ({"i", "output"} or
    {"i", "error"}), so the tests done count when a limit ends the run."""
    # the results go out on a copy of stdout; the program's own writes to descriptor 1 go nowhere
    channel = io.open(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    with open("/code/tests.json") as f:
        tests = json.load(f)
    with open("/code/solution.py") as f:
        source = f.read()
    signal.signal(signal.SIGALRM, on_alarm)
    for i, raw in enumerate(tests["inputs"]):
        channel.write(json.dumps({"i": i, **run_one(source, tests.get("fn_name"), raw, tests["seconds"])}) + "\n")
        channel.flush()


if __name__ == "__main__":
    main()
