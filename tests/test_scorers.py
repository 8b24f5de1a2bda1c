"""The scorers of verl's text data sources against verl 0.9.1's own functions, on the constructed
responses in ``verl_reference/rewards.json`` (made by ``verl_reference/make_rewards.py``; CI does
not need verl), and ``hybridlab score``, which scores given responses as a run would."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from hybridlab.cli import main
from hybridlab.errors import UserError
from hybridlab.scorers import ScorerOptions, algebra, gsm8k, scorer_for
from hybridlab.tasks.dataset import write_rows
from hybridlab.workers.reward.scoring import _safe_score, rule_for

REFERENCE = json.loads((Path(__file__).parent / "verl_reference" / "rewards.json").read_text())


def verl_result(expected) -> dict:
    """verl's answer as hybridlab reports it: a float is the score; a dict keeps score, acc, pred."""
    if isinstance(expected, dict):
        return {"score": float(expected["score"]), "acc": float(expected["acc"]), "pred": expected["pred"]}
    return {"score": float(expected)}


@pytest.mark.parametrize("family", sorted(REFERENCE["families"]))
def test_each_family_scores_as_verl_does(family):
    rows = REFERENCE["families"][family]
    assert len(rows) >= 200
    differ = []
    for row in rows:
        expected = verl_result(row["expected"])
        got = scorer_for(row["data_source"])(row["response"], row["ground_truth"])
        if {k: got[k] for k in expected} != expected:
            differ.append((row["data_source"], row["response"][:80], row["ground_truth"], expected, got))
    assert differ == []
    # the cases reach both outcomes, not one
    assert len({verl_result(r["expected"])["score"] for r in rows}) >= 2


def test_gsm8k_flexible_extraction_scores_as_verl_does():
    rows = REFERENCE["gsm8k_flexible"]
    got = [gsm8k.score(r["response"], r["ground_truth"], method="flexible")["score"] for r in rows]
    assert got == [float(r["expected"]) for r in rows]
    assert scorer_for("openai/gsm8k", ScorerOptions(gsm8k_extraction="flexible"))("it is 72 apples", "72")["score"] == 1.0
    assert scorer_for("openai/gsm8k")("it is 72 apples", "72")["score"] == 0.0  # strict wants "#### 72"


def test_math_verify_scores_as_verls_math_verify():
    rows = REFERENCE["math_verify"]
    mv = scorer_for("lighteval/MATH", ScorerOptions(math_verifier="math-verify"))
    assert mv is scorer_for("aime2024", ScorerOptions(math_verifier="math-verify"))
    assert [mv(r["response"], r["ground_truth"])["score"] for r in rows] == [float(r["expected"]) for r in rows]
    # where the rules and the algebra part: 2/4 is 1/2 by algebra, not by the MATH string check
    assert scorer_for("lighteval/MATH")("\\boxed{2/4}", "\\frac{1}{2}")["score"] == 0.0
    assert mv("\\boxed{2/4}", "\\frac{1}{2}")["score"] == 1.0


def test_math_verify_off_the_main_thread_neither_raises_nor_scores_zero():
    results = []
    thread = threading.Thread(target=lambda: results.append(algebra.score("so \\boxed{\\frac{2}{4}}", "0.5")))
    thread.start()
    thread.join()
    assert results == [{"score": 1.0, "acc": 1.0}]


def test_a_math_verify_timeout_is_an_error_not_a_zero(monkeypatch):
    monkeypatch.setattr(algebra, "_check", lambda response, truth: time.sleep(30))
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="math-verify on this response took longer than 1 s"):
        algebra.score("\\boxed{1}", "1", timeout_s=1)
    assert time.monotonic() - start < 5
    # through the reward worker's per-sample guard: error_score, with the reason, counted as an error
    def fn(data_source, solution_str, ground_truth, extra_info):
        return algebra.score(solution_str, ground_truth, timeout_s=1)

    assert _safe_score(fn, "math", "\\boxed{1}", "1", None, -2.0) == (
        -2.0, None, "TimeoutError: math-verify on this response took longer than 1 s", {})


def test_the_bound_holds_when_the_main_thread_blocks_sigalrm():
    """A library may leave SIGALRM blocked on the main thread, so the process's alarm goes to
    another thread: the bound still ends the work on time (it took the whole 5 s before), and the
    main thread's mask is left as it was."""
    import signal
    import threading

    from hybridlab.scorers.limits import bounded

    other = threading.Event()
    threading.Thread(target=other.wait, args=(10,), daemon=True).start()  # a thread that takes SIGALRM
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="work took longer than 1 s"):
            bounded(lambda: time.sleep(5), 1, "work")
        assert time.monotonic() - start < 3
        assert signal.SIGALRM in signal.pthread_sigmask(signal.SIG_BLOCK, set())  # still blocked, as found
    finally:
        other.set()
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


@pytest.mark.parametrize("source, why", [
    ("hiyouga/geometry3k", "an image task"),
    ("my/own_data", "not a source verl scores by default")])
def test_sources_without_a_scorer_are_refused_by_name_with_the_list(source, why):
    with pytest.raises(UserError) as err:
        rule_for(source)
    assert f"no built-in scorer for data_source {source!r}" in str(err.value) and why in str(err.value)
    assert "openai/gsm8k" in str(err.value) and "arith" in str(err.value) and "reward.function" in str(err.value)


def test_numina_answers_are_never_run_as_python():
    """verl's prime_math evaluates an answer with \\pi, or a list against a matrix, with Python's
    eval: the first answer below makes verl 0.9.1 create the file. Here only arithmetic is
    evaluated, so no answer runs code or exhausts memory."""
    import os

    from hybridlab.scorers.numina_equal import arithmetic

    marker = Path(f"/tmp/hlnumina{os.getpid()}")  # no underscore: verl reads one as a base subscript first
    marker.unlink(missing_ok=True)
    try:
        attack = f"\\boxed{{\\pi + len(str(open('{marker}', 'w')))}}"
        assert scorer_for("numina_olympiads")(attack, "\\pi")["score"] == 0.0 and not marker.exists()
        matrix = f"Answer: [len(str(open('{marker}', 'w')))]"
        assert scorer_for("numina_olympiads")(matrix, "\\begin{pmatrix}1\\\\2\\end{pmatrix}")["score"] == 0.0
        assert not marker.exists()
    finally:
        marker.unlink(missing_ok=True)
    assert arithmetic("[2*3, 2**10, -(1/4)]") == [6, 1024, -0.25]
    with pytest.raises(ValueError, match="too large"):
        arithmetic("9**9**9")
    assert scorer_for("numina_cn_k12")("so the answer is \\boxed{2\\pi}", "6.28")["score"] == 1.0  # pi as 3.14


def _gsm8k_data(tmp_path: Path, sources=("openai/gsm8k",) * 3) -> Path:
    truths = ["72", "1000", "-5"]
    return write_rows([{"prompt": f"question {i}", "data_source": s, "reward_model": {"ground_truth": truths[i]}}
                       for i, s in enumerate(sources)], tmp_path / "gsm8k.parquet")


def _responses(tmp_path: Path, texts: list[str]) -> Path:
    path = tmp_path / "responses.jsonl"
    path.write_text("".join(json.dumps({"response": t}) + "\n" for t in texts))
    return path


def test_score_prints_one_json_row_per_response_and_a_summary(tmp_path, capsys):
    data = _gsm8k_data(tmp_path)
    responses = _responses(tmp_path, ["#### 72", "#### 1,000", "it is -5"])
    assert main(["score", "--data", str(data), "--responses", str(responses), "--json"]) == 0
    out, err = capsys.readouterr()
    assert [json.loads(line) for line in out.splitlines()] == [
        {"score": 1.0, "acc": 1.0}, {"score": 1.0, "acc": 1.0}, {"score": 0.0, "acc": 0.0}]
    assert err.strip().endswith("3 responses: mean score 0.6667, accuracy 0.667 over 3, 0 errors")
    # the settings a run would use: flexible extraction and a format score
    assert main(["score", "reward.gsm8k_extraction=flexible", "reward.format_score=0.1", "--data", str(data),
                 "--responses", str(_responses(tmp_path, ["#### 71", "1,000", "it is -5"])), "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr()[0].splitlines()]
    assert [r["score"] for r in rows] == [0.1, 0.1, 1.0]  # flexible keeps the comma, as verl's does


def test_score_runs_a_users_function_with_its_dict_fields(tmp_path, capsys):
    module = tmp_path / "my_reward.py"
    module.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    if solution_str == 'boom':\n"
                      "        raise ValueError('cannot read boom')\n"
                      "    return {'score': float(len(solution_str)), 'length_bonus': 0.5, 'note': 'x'}\n")
    assert main(["score", "reward.kind=function", f"reward.function={module}:compute_score", "reward.error_score=-1",
                 "--data", str(_gsm8k_data(tmp_path)), "--responses", str(_responses(tmp_path, ["ab", "boom", "#### -5"])),
                 "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr()[0].splitlines()]
    # acc comes from the built-in gsm8k scorer where the function gives none, as in a run; every
    # field of the dict, a string one too
    assert rows == [{"score": 2.0, "acc": 0.0, "length_bonus": 0.5, "note": "x"},
                    {"score": -1.0, "acc": 0.0, "error": "ValueError: cannot read boom"},
                    {"score": 7.0, "acc": 1.0, "length_bonus": 0.5, "note": "x"}]


def test_score_refuses_bad_input_by_name(tmp_path, capsys):
    data = _gsm8k_data(tmp_path, ("openai/gsm8k", "hiyouga/geometry3k", "openai/gsm8k"))
    three = _responses(tmp_path, ["#### 72", "x", "y"])
    assert main(["score", "--data", str(data), "--responses", str(three)]) == 2
    assert "gsm8k.parquet: row 2: no built-in scorer for data_source 'hiyouga/geometry3k': an image task" in \
        capsys.readouterr().err
    assert main(["score", "--data", str(_gsm8k_data(tmp_path)), "--responses",
                 str(_responses(tmp_path, ["#### 72"]))]) == 2
    assert "has 1 responses and the data file 3 rows" in capsys.readouterr().err
    assert main(["score", "reward.math_verifier=sympy", "--data", str(data), "--responses", str(three)]) == 2
    err = capsys.readouterr().err
    assert "reward.math_verifier" in err and "'sympy'" in err and "rules, math-verify" in err


def test_score_names_a_bad_responses_row(tmp_path, capsys):
    responses = tmp_path / "bad.jsonl"
    responses.write_text('{"response": "#### 72"}\n\n{"text": "#### 1000"}\n{"response": "x"}\n')
    assert main(["score", "--data", str(_gsm8k_data(tmp_path)), "--responses", str(responses)]) == 2
    assert "bad.jsonl: row 3: expected a string 'response', got the keys ['text']" in capsys.readouterr().err
