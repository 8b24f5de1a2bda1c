"""The sandbox for model-written code (hybridlab.sandbox): the red-team list (each case fails,
is counted, and leaves the host as it was: no files outside the sandbox, no stray processes, the
trainer untouched), the code tasks scored as verl's prime_code scores them, and the refusal to
run code where isolation is missing. Short limits, so a hang costs seconds."""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import uuid
from pathlib import Path

import pytest
import torch

from hybridlab.config.schema import SandboxConfig
from hybridlab.errors import UserError
from hybridlab.sandbox import Sandbox, SandboxUnavailable
from hybridlab.sandbox.cgroup import parent_dir, stray_processes
from hybridlab.sandbox.code_tests import score_code
from hybridlab.sandbox.runner import NOBODY

LIMITS = SandboxConfig(wall_s=3, cpu_s=2, memory_mb=256, processes=16, file_mb=4, output_kb=64, test_timeout_s=2)
CODE_REFERENCE = json.loads((Path(__file__).parent / "verl_reference" / "code.json").read_text())
SUM = {"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]}


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return Sandbox(LIMITS)


@pytest.fixture
def host_unchanged():
    """Fails the test if a sandbox process or cgroup is left behind."""
    yield
    assert stray_processes(NOBODY if os.geteuid() == 0 else None) == set()
    assert list(parent_dir().glob("hybridlab-sandbox-*")) == []


def test_a_program_runs_as_an_unprivileged_user_with_an_empty_environment(sandbox, host_unchanged):
    ran = sandbox.run_python("import os, sys\nprint(os.getcwd(), sorted(os.environ), sys.stdin.read())", stdin="in")
    assert ran.ok and ran.stdout.split() == ["/sandbox", "['HOME',", "'LANG',", "'PATH',", "'PWD']", "in"]


def test_a_fork_bomb_is_held_by_the_process_limit_and_ended_by_the_wall_limit(sandbox, host_unchanged):
    counted = sandbox.run_python("import os, time\nn = 0\nwhile True:\n    try:\n        pid = os.fork()\n"
                                 "    except OSError as e:\n        print(n, e.errno, flush=True)\n        break\n"
                                 "    if pid == 0:\n        time.sleep(5)\n        os._exit(0)\n    n += 1")
    n, errno = map(int, counted.stdout.split())
    assert errno == 11 and 0 < n < LIMITS.processes  # EAGAIN: the pids cgroup's limit, which holds as root
    bomb = sandbox.run_python("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
    assert bomb.timed_out and not bomb.ok


def test_a_memory_bomb_fails_with_memory_error(sandbox, host_unchanged):
    ran = sandbox.run_python("a = [bytearray(64 << 20) for _ in range(64)]")  # 4 GiB in 64 MiB steps
    assert ran.exit_code == 1 and ran.stderr.strip().endswith("MemoryError")


def test_an_infinite_loop_is_ended_by_the_cpu_limit_and_a_sleeping_one_by_the_wall_limit(sandbox, host_unchanged):
    spinning = Sandbox(dataclasses.replace(LIMITS, wall_s=60, cpu_s=1)).run_python("while True:\n    pass")
    assert spinning.exit_code == 128 + 9 and not spinning.timed_out  # SIGKILL at RLIMIT_CPU, long before the wall
    sleeping = sandbox.run_python("import time\nwhile True:\n    time.sleep(1)")
    assert sleeping.timed_out and sleeping.exit_code is None and LIMITS.wall_s <= sleeping.seconds < LIMITS.wall_s + 10


def test_a_gigabyte_of_output_is_cut_off_at_the_output_limit(sandbox, host_unchanged):
    ran = sandbox.run_python("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)")
    assert ran.output_exceeded and not ran.timed_out and ran.exit_code is None
    assert ran.stdout == "x" * (LIMITS.output_kb << 10)


def test_writing_outside_its_directory_fails(sandbox, tmp_path, host_unchanged):
    marker = f"hybridlab-redteam-{uuid.uuid4().hex}"
    targets = [f"/tmp/{marker}", f"{tmp_path}/{marker}", f"/usr/{marker}", f"/code/{marker}", f"/{marker}",
               f"/etc/{marker}", f"/dev/{marker}", f"/proc/{marker}", f"/sandbox/{marker}"]
    ran = sandbox.run_python("import sys\nfor path in sys.argv[1:] or %r:\n    try:\n        open(path, 'w').write('x')\n"
                             "        print('wrote', path)\n    except OSError as e:\n        print('refused', path)"
                             % targets)
    assert ran.ok and [line.split()[0] for line in ran.stdout.splitlines()] == ["refused"] * 8 + ["wrote"]
    assert not Path("/tmp", marker).exists() and list(tmp_path.iterdir()) == []


def test_secrets_of_the_trainer_are_absent(sandbox, tmp_path, monkeypatch, host_unchanged):
    secret = f"s3cr3t-{uuid.uuid4().hex}"
    monkeypatch.setenv("HYBRIDLAB_TEST_TOKEN", secret)
    run_file = tmp_path / "run" / "secret.txt"
    run_file.parent.mkdir()
    run_file.write_text(secret)
    run_file.chmod(0o644)  # readable by anyone on the host: only its absence protects it
    ran = sandbox.run_python(f"import os\nprint(dict(os.environ))\nfor path in [{str(run_file)!r}, '/proc/1/environ',"
                             f" '/proc/{os.getpid()}/environ', '/root/.bashrc', '/etc/shadow']:\n    try:\n"
                             "        print(open(path).read())\n    except OSError as e:\n        print(type(e).__name__)")
    assert ran.ok and secret not in ran.stdout + ran.stderr
    # /proc/1 is the program itself (its PID namespace's init), with the sandbox's fixed environment
    assert ran.stdout.splitlines()[1:] == ["FileNotFoundError",
                                           "PATH=/usr/bin:/bin\0HOME=/sandbox\0LANG=C.UTF-8\0PWD=/sandbox\0",
                                           "FileNotFoundError", "FileNotFoundError", "FileNotFoundError"]


def test_a_listener_on_the_hosts_loopback_cannot_be_reached(sandbox, host_unchanged):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.2)
        port = listener.getsockname()[1]
        ran = sandbox.run_python(f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
                                 "    print('connected')\nexcept OSError as e:\n    print(type(e).__name__)")
        with pytest.raises(TimeoutError):
            listener.accept()
    assert ran.ok and ran.stdout.strip() == "ConnectionRefusedError"


def test_signalling_its_parent_or_the_trainer_fails(sandbox, host_unchanged):
    ran = sandbox.run_python(f"import os, signal\nprint(os.getppid())\nfor pid in [{os.getpid()}, {os.getppid()}]:\n"
                             "    try:\n        os.kill(pid, signal.SIGKILL)\n        print('sent', pid)\n"
                             "    except OSError as e:\n        print(type(e).__name__)")
    # its parent is outside its PID namespace (getppid() is 0), and so are the trainer and its parent
    assert ran.ok and ran.stdout.split() == ["0", "ProcessLookupError", "ProcessLookupError"]


def test_a_process_that_daemonizes_does_not_outlive_the_execution(sandbox, host_unchanged):
    ran = sandbox.run_python("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
                             "        os.close(1)\n        os.close(2)\n        time.sleep(60)\n    os._exit(0)\n"
                             "print('parent done')")
    assert ran.ok and ran.stdout == "parent done\n" and ran.seconds < LIMITS.wall_s


def test_a_segfault_through_ctypes_fails_and_the_next_execution_runs(sandbox, host_unchanged):
    ran = sandbox.run_python("import ctypes\nctypes.string_at(0)")
    assert ran.exit_code == 128 + 11  # SIGSEGV
    assert sandbox.run_python("print(6 * 7)").stdout == "42\n"


@pytest.mark.parametrize("row", CODE_REFERENCE, ids=lambda row: f"{row['data_source']}-{row['score']:g}")
def test_code_answers_score_as_verls_prime_code(sandbox, row, host_unchanged):
    """tests/verl_reference/make_code.py: verl 0.9.1's prime_code on each answer."""
    assert score_code(sandbox, row["response"], row["ground_truth"])["score"] == row["score"]


def test_tests_done_before_a_limit_count_and_the_input_is_on_descriptor_zero(sandbox, host_unchanged):
    cases = {"inputs": ["1 2\n", "3 4\n", "5 6\n"], "outputs": ["3\n", "7\n", "11\n"]}
    # the third test turns off the harness's per-test timer, so the wall limit (3 s) ends the run in it
    slow_last = ("import signal, time\na, b = map(int, open(0).read().split())\nif a == 5:\n"
                 "    signal.signal(signal.SIGALRM, signal.SIG_IGN)\n    time.sleep(60)\nprint(a + b)")
    scored = score_code(sandbox, slow_last, cases)
    assert scored == {"score": 2 / 3, "acc": 0.0, "tests_passed": 2 / 3, "sandbox_limit": 1.0}


def test_lines_the_program_writes_on_the_results_channel_cannot_pass_a_test(sandbox, host_unchanged):
    """The harness reports on a copy of stdout (descriptor 3): the program can write there too.
    Malformed lines are ignored, and a line claiming an output is only an output, compared with
    expected outputs the sandbox never holds."""
    forged = ("import os\nfor line in ['[1, 2]', '{\"i\": 0}', '{\"i\": 1, \"output\": 7}', '{\"i\": 9, \"output\": \"x\"}',"
              " '{\"i\": 0, \"output\": \"wrong\"}', 'not json']:\n    os.write(3, (line + chr(10)).encode())\nprint(0)")
    assert score_code(sandbox, forged, SUM)["score"] == 0.0


def test_the_red_team_scores_zero_through_the_reward_worker_and_is_counted(tiny_dir, host_unchanged):
    from hybridlab.protocol import Batch
    from hybridlab.workers.reward.worker import RewardWorker

    worker = RewardWorker(str(tiny_dir), kind="rule", sandbox=LIMITS)
    attacks = ["import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
               "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", "import ctypes\nctypes.string_at(0)",
               "a, b = map(int, input().split())\nprint(a + b)"]
    texts = [f"```python\n{code}\n```" for code in attacks]
    ids = [worker.tokenizer(t, add_special_tokens=False).input_ids[:8] for t in texts]
    batch = Batch({"responses": torch.tensor(ids), "response_mask": torch.ones(4, 8)},
                  {"final_response": texts, "data_source": ["codecontests"] * 4, "ground_truth": [SUM] * 4})
    out = worker.compute_reward(batch)
    assert out["token_level_scores"].sum(-1).tolist() == [0.0, 0.0, 0.0, 1.0]
    # the fork bomb ran into the wall limit (counted); the harness holds the output bomb's prints in
    # memory, where it fails with MemoryError like the segfault fails
    assert [c["sandbox_limit"] for c in out.objects["reward_extra_info"]] == [1.0, 0.0, 0.0, 0.0]
    assert out["reward_error"].sum() == 0 and out.objects["reward_answer"] == [{}] * 4  # verl's bare score


def test_code_is_never_run_where_isolation_is_missing(monkeypatch, tmp_path):
    with pytest.raises(SandboxUnavailable, match=r"missing: the interpreter sandbox.python=/nowhere/python; the"
                                                 r" directory /nowhere/lib of sandbox.read_only$"):
        Sandbox(SandboxConfig(python="/nowhere/python", read_only=["/nowhere/lib"]))
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on the PATH
    with pytest.raises(SandboxUnavailable, match=r"hybridlab never runs it without one; missing: bubblewrap's bwrap"):
        Sandbox(LIMITS)


def test_the_python_tool_answers_with_the_exit_status_and_output(host_unchanged):
    import asyncio

    from hybridlab.agents.tools import call_tool, load_tools, parse_tool_calls
    from hybridlab.sandbox import tool

    tools = load_tools("hybridlab.sandbox.tool:python")
    assert tools["python"].schema["function"]["parameters"]["required"] == ["code"]
    tool.configure(LIMITS)
    try:
        # as the agent loop runs it: a model turn's call, parsed, and the answer the model reads next
        turn = '<tool_call>\n{"name": "python", "arguments": {"code": "print(2 ** 10)"}}\n</tool_call>'
        answer = asyncio.run(call_tool(tools, parse_tool_calls(turn)[0], timeout_s=10))
        assert not answer.error and json.loads(answer.content) == {"exit_code": 0, "stdout": "1024\n", "stderr": ""}
        assert tool.python("import sys\nprint(6 * 7)\nprint('oops', file=sys.stderr)\nsys.exit(3)") == \
            {"exit_code": 3, "stdout": "42\n", "stderr": "oops\n"}
        assert tool.python("print('x' * 5000)")["stdout"] == "x" * 2000 + "\n[... 3001 more characters]"
        assert tool.python("import time\nwhile True:\n    time.sleep(1)") == \
            {"exit_code": None, "stdout": "", "stderr": "", "ended": "it ran past the 3 s limit"}
    finally:
        tool.configure(SandboxConfig())


def test_the_python_tool_and_code_data_are_refused_by_name_where_the_sandbox_is_missing(tmp_path):
    from hybridlab.config import ConfigError
    from hybridlab.run_config import load_config
    from hybridlab.scorers import ScorerOptions
    from hybridlab.tasks import Sample
    from hybridlab.workers.reward.scoring import check_sources

    with pytest.raises(ConfigError) as err:
        load_config(None, ["rollout.tools=hybridlab.sandbox.tool:python", "sandbox.python=/nowhere/python"])
    assert str(err.value) == ("config is invalid:\n  - rollout.tools: code cannot be run in a sandbox here, and"
                              " hybridlab never runs it without one; missing: the interpreter"
                              " sandbox.python=/nowhere/python")
    sample = Sample(prompt="p", ground_truth=SUM, data_source="apps", origin="train.parquet row 3")
    with pytest.raises(UserError, match=r"^train.parquet row 3: code cannot be run in a sandbox here, and hybridlab"
                                         r" never runs it without one; missing: the interpreter"
                                         r" sandbox.python=/nowhere/python$"):
        check_sources([sample], ScorerOptions(sandbox=SandboxConfig(python="/nowhere/python")))


def test_countdown_in_python_is_evaluated_in_the_sandbox_through_the_reward_worker(tiny_dir, host_unchanged):
    from hybridlab.protocol import Batch
    from hybridlab.scorers import ScorerOptions
    from hybridlab.tasks import Sample, get_task
    from hybridlab.workers.reward.scoring import check_sources
    from hybridlab.workers.reward.worker import RewardWorker

    task = get_task("countdown_code")
    task.use_sandbox(Sandbox(LIMITS))
    for sample in task.split("train", 5):  # the worked answers are Python that reaches the target
        assert sample.prompt.endswith(" in python:") and task.check(sample.answer, sample.ground_truth) == (True, True)
    truth = {"target": 5, "numbers": [2, 4, 1]}
    answers = {"max(2, 4) + 1": (True, True),     # the builtins of numbers run in the sandbox
               "abs(1 - 4) + 2": (True, True),
               "2 + 4 + 1": (False, True),        # the wrong number, well formed
               "2 + 4 + 5": (False, False),       # 5 is not given
               "2 + 2 + 1": (False, False),       # 2 is given once
               "len('abcde')": (False, False),    # no other literal, no other function
               "-~-~1 + 2": (False, False),       # ~ would build numbers that were not given
               "len([[]]) + 4": (False, False),   # so would lists and len
               "(2 + 4) * (": (False, False)}     # not an expression
    assert {a: task.check(a, truth) for a in answers} == answers
    # a power too large to print meets the sandbox's limits there, and scores as wrong
    assert task.check("9 ** 9 ** 9", {"target": 1, "numbers": [9, 9, 9]}) == (False, True)
    worker = RewardWorker(str(tiny_dir), kind="rule", sandbox=LIMITS)
    texts = ["max(2, 4) + 1", "2 + 4 + 1", "2 + 4 + 5"]
    ids = [worker.tokenizer(t, add_special_tokens=False).input_ids[:4] for t in texts]
    batch = Batch({"responses": torch.tensor([i + [0] * (4 - len(i)) for i in ids]), "response_mask": torch.ones(3, 4)},
                  {"final_response": texts, "data_source": ["countdown_code"] * 3, "ground_truth": [truth] * 3})
    out = worker.compute_reward(batch)
    assert out["token_level_scores"].sum(-1).tolist() == [1.0, 0.0, 0.0] and out["acc"].tolist() == [1.0, 0.0, 0.0]
    missing = ScorerOptions(sandbox=SandboxConfig(python="/nowhere/python"))
    with pytest.raises(UserError, match=r"^a prompt of data.task: code cannot be run in a sandbox here, and hybridlab"
                                         r" never runs it without one; missing: the interpreter"
                                         r" sandbox.python=/nowhere/python$"):
        check_sources([Sample(prompt="p", ground_truth=truth, data_source="countdown_code")], missing)


def test_hybridlab_score_runs_code_rows_in_the_sandbox(tmp_path, capsys):
    from hybridlab.cli import main
    from hybridlab.tasks.dataset import write_rows

    rows = [{"prompt": "add", "data_source": "codecontests", "reward_model": {"ground_truth": json.dumps(SUM)}}] * 2
    data = write_rows(rows, tmp_path / "code.jsonl")
    answers = tmp_path / "answers.jsonl"
    answers.write_text("\n".join(json.dumps({"response": f"```python\n{code}\n```"}) for code in
                       ["a, b = map(int, input().split())\nprint(a + b)", "print(3)"]) + "\n")
    assert main(["score", "sandbox.wall_s=5", "--data", str(data), "--responses", str(answers), "--json"]) == 0
    out = [json.loads(line) for line in capsys.readouterr()[0].splitlines()]
    assert out == [{"score": 1.0, "acc": 1.0, "tests_passed": 1.0, "sandbox_limit": 0.0},
                   {"score": 0.5, "acc": 0.0, "tests_passed": 0.5, "sandbox_limit": 0.0}]


def test_bench_sandbox_reports_the_overhead_and_leaks_nothing(capsys):
    from hybridlab.cli import main

    assert main(["bench", "sandbox", "--json", "--opt", "executions=5"]) == 0
    out = json.loads(capsys.readouterr()[0])
    assert (out["leaked_processes"], out["leaked_files"], out["leaked_cgroups"]) == (0, 0, 0)
    assert out["executions"] == 5 and out["goal_met"] == (out["overhead_ms"] <= out["goal_ms"] == 50.0)
    assert out["overhead_ms"] == pytest.approx(1000 / out["sandboxed_per_s"] - 1000 / out["bare_per_s"], abs=1.0)


def test_bad_sandbox_settings_are_named_before_any_work():
    from hybridlab.config import ConfigError
    from hybridlab.run_config import load_config

    with pytest.raises(ConfigError) as err:
        load_config(None, ["sandbox.processes=2", "sandbox.wall_s=0"])
    assert str(err.value) == ("config is invalid:\n  - sandbox.wall_s: must be at least 0.1, got 0.0\n"
                              "  - sandbox.processes: must be at least 4, got 2")
