"""Regenerate ``rewards.json``: constructed responses and verl 0.9.1's scores for them.

verl is not a dependency: this script runs where verl's ``verl.utils.reward_score`` can be
imported, and ``tests/test_scorers.py`` only reads the JSON it writes. To regenerate:

    pip download --no-deps verl==0.9.1 -d /tmp/verl-wheel
    python -m zipfile -e /tmp/verl-wheel/verl-0.9.1-py3-none-any.whl /tmp/verl-src
    pip install --target /tmp/verl-deps --no-deps pylatexenc==2.11
    PYTHONPATH=/tmp/verl-deps python tests/verl_reference/make_rewards.py /tmp/verl-src

(math-verify must be installed, as hybridlab's requirements install it.) verl's package
``__init__`` files import its whole runtime; the script registers empty ``verl`` and ``verl.utils``
packages over the unpacked source, so only the scorers and their small imports load.

The responses are built from each family's ground truths by fixed templates (no RNG): right
answers in the spellings a model writes (commas, ``$``, ``\\dfrac``, units, nested ``\\boxed``),
wrong and malformed ones, and long ones whose answer lies before or inside verl's 300-character
clip.
"""
from __future__ import annotations

import json
import random
import sys
import types
from pathlib import Path

OUT = Path(__file__).with_name("rewards.json")
LONG = "Let me think step by step about this problem. " * 8  # 376 characters: past verl's 300-character clip


def load_verl(source: str):
    for name, sub in (("verl", "verl"), ("verl.utils", "verl/utils")):
        package = types.ModuleType(name)
        package.__path__ = [str(Path(source) / sub)]
        sys.modules[name] = package
    import verl.utils.reward_score as reward_score

    return reward_score


def gsm8k_cases() -> list[tuple[str, str, object]]:
    truths = ["72", "1000", "-5", "3.5", "18", "0", "250000", "12", "1234567", "0.25"]
    cases = []
    for t in truths:
        n = float(t)
        wrong = str(int(n) + 1) if n == int(n) else str(n + 1)
        spaced = f"{int(n):,}" if n == int(n) else t
        for body in (f"#### {t}", f"The answer is\n#### {t}", f"####{t}", f"#### {spaced}", f"#### ${t}",
                     f"#### {t}.", f"#### {t}.0", f"#### {wrong}", f"#### {t}\n#### {wrong}",
                     f"#### {wrong}\n#### {t}", f"The answer is {t}.", f"answer: {t} dollars", "####", "#### abc",
                     f"{LONG}#### {t}", f"#### {t}{LONG}", f"{t} apples and {wrong} pears",
                     f"#### -{t}", f"#### {t} #### ", f"It costs ${spaced}.", f"{t}.", ""):
            cases.append(("openai/gsm8k", body, t))
    return cases


MATH_TRUTHS = ["\\frac{1}{2}", "3\\sqrt{2}", "10", "\\text{(A)}", "x^2+1", "5", "(1,2)", "\\frac{\\sqrt{3}}{2}",
               "2\\pi", "-\\frac{3}{4}"]


def math_answers(t: str) -> list[str]:
    """Spellings of ``t`` and near misses a model writes inside or around a box."""
    return [t, t.replace("\\frac", "\\dfrac"), t.replace("\\frac", "\\tfrac"), f" {t} ", f"x = {t}", f"{t}^\\circ",
            f"{t}\\text{{ cm}}", f"\\left({t}\\right)", f"{t}\\%", f"{t}.", t.replace("{", "").replace("}", ""),
            f"{t}+1", f"\\${t}", t.replace("1}{2}", "1/2}") if "1}{2}" in t else f"{t},", "0.5", "1/2"]


def math_cases(source: str) -> list[tuple[str, str, object]]:
    cases = []
    for t in MATH_TRUTHS:
        for a in math_answers(t):
            cases += [(source, f"So the answer is $\\boxed{{{a}}}$.", t),
                      (source, f"\\boxed {a}$ done", t),
                      (source, f"\\fbox{{{a}}}", t)]
        cases += [(source, f"\\boxed{{{t}", t), (source, f"{LONG}\\boxed{{{t}}}", t),
                  (source, f"\\boxed{{\\boxed{{{t}}}}}", t), (source, f"\\boxed{{1}} then \\boxed{{{t}}}", t),
                  (source, f"\\boxed{{{t}}} then \\boxed{{1}}", t), (source, f"The answer is {t}", t)]
    return cases


def dapo_cases() -> list[tuple[str, str, object]]:
    truths = ["42", "1000", "\\frac{1}{2}", "34", "-7", "\\sqrt{2}", "90"]
    sources = ["math_dapo", "math", "math_dapo_reasoning", "aime2024", "aime25"]
    cases = []
    for i, t in enumerate(truths):
        source = sources[i % len(sources)]
        for body in (f"Answer: {t}", f"answer : {t}", f"ANSWER:{t}", f"Answer: ${t}$", f"Answer: {t} dollars",
                     f"Answer: x = {t}", f"Answer: \\boxed{{{t}}}", f"\\boxed{{{t}}}", f"The result is \\boxed{{{t}}}.",
                     f"Answer: {t}1", f"Answer: 1{t}", f"Answer: {t}\nAnswer: 3", f"Answer: 3\nAnswer: {t}",
                     f"Answer: {t}{LONG}", f"Answer: {t}\n{LONG}", f"{LONG}Answer: {t}", f"{LONG}\\boxed{{{t}}}",
                     f"Answer: {t}.", f"Answer: \\text{{{t}}}", f"Answer: {t}^\\circ", f"Answer: {t} degrees",
                     f"Answer: {t} ways", f"Answer: 1,000" if t == "1000" else f"Answer: {t},", f"{t}", "",
                     f"\\boxed{{{t}", f"\\boxed{{{t}}} and \\boxed{{0}}", f"Answer: \\frac12" if "1}{2" in t else
                     f"Answer: {{{t}}}", f"Answer: a {t}", f"Answer: an {t}"):
            cases.append((source, body, t))
    return cases


def search_cases() -> list[tuple[str, str, object]]:
    sources = ["searchR1_nq", "searchR1_triviaqa", "searchR1_popqa", "searchR1_hotpotqa",
               "searchR1_2wikimultihopqa", "searchR1_musique", "searchR1_bamboogle"]
    targets = [["Paris"], ["George Washington", "Washington"], ["1969"], ["The Beatles"], ["New York City", "NYC"],
               ["an apple"], ["H2O"], ["Mount Everest"]]
    cases = []
    for i, target in enumerate(targets):
        source = sources[i % len(sources)]
        t = target[-1]
        for body in (f"<answer>{t}</answer>", f"<answer> {t.upper()} </answer>", f"<answer>the {t}.</answer>",
                     f"<answer>{t}!</answer>", f"<answer>{t} city</answer>", f"<answer>wrong</answer>",
                     f"<answer>wrong</answer> <answer>{t}</answer>", f"<answer>{t}</answer> <answer>wrong</answer>",
                     f"{t}", f"<answer>{t}", "<answer></answer>", f"<answer>\n{t}\n</answer>",
                     f"<answer>{t}</answer>" * 11, f"<answer>{t}</answer>" + "</answer>" * 10,
                     f"{LONG}<answer>{t}</answer>", f"<answer>A {t}</answer>", f"<answer>{t}'s</answer>",
                     f"<answer>{t.lower()}</answer>", f"<answer>{' '.join(t)}</answer>",
                     f"<think>{t}</think><answer>{t}</answer>", f"<ANSWER>{t}</ANSWER>",
                     f"<answer>{t}</answer>" * 10, f"<answer>the the {t}</answer>", f"<answer>{t}-{t}</answer>",
                     f"<answer>{t}\t</answer>", f"<answer>({t})</answer>"):
            cases.append((source, body, {"target": target}))
    return cases


NUMINA_TRUTHS = ["\\frac{1}{2}", "3", "2\\pi", "(1,2)", "[0,1)", "10\\%", "\\sqrt{2}", "1,000", "x^2+1",
                 "\\begin{pmatrix}1\\\\2\\end{pmatrix}", "5", "0.25", "-3", "\\text{(B)}", "\\frac{\\pi}{4}",
                 "2x+3", "e^2", "12"]


def numina_answers(t: str) -> list[str]:
    """Spellings of ``t`` and near misses, as a model writes a final answer."""
    return [t, t.replace("\\frac", "\\dfrac"), f"{t} cm", f"{t}.0", f" {t} ", "0.5", "1/2", "6.28", "1000",
            "(1, 2)", "\\left(1,2\\right)", "Interval.Ropen(0, 1)", "[1, 2]", "0.1", "10", "sqrt(2)", "1.4142",
            "x^2 + 1", "1 + x^2", "(B)", "B", "pi/4", "0.785398", "3+2x", "e**2", "7.389056", "12 apples", "-3.0",
            "4", "t", "\\$5", "5\\%", "2\\cdot\\pi"]


def numina_cases() -> list[tuple[str, str, object]]:
    sources = ["numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc",
               "numina_cn_k12", "numina_olympiads"]
    cases = []
    for i, t in enumerate(NUMINA_TRUTHS):
        answers = numina_answers(t)
        for j, a in enumerate(answers):
            template = ("The answer is \\boxed{%s}.", "Answer: %s", "So we get x = %s", "%s is the answer",
                        "Step 1: think. Step 2: \\boxed{%s}", "We find %s. Done", LONG + "answer is %s")[j % 7]
            cases.append((sources[(i + j) % len(sources)], template % a, t))
    return cases


def main(source: str) -> None:
    reward_score = load_verl(source)
    from verl.utils.reward_score import gsm8k, math_verify

    random.seed(0)  # searchR1's scorer prints one sample in 64 at random
    families = {"gsm8k": gsm8k_cases(), "math": math_cases("lighteval/MATH") + math_cases("HuggingFaceH4/MATH-500")[:40],
                "dapo": dapo_cases(), "search_r1": search_cases(), "numina": numina_cases()}
    out = {"verl": "0.9.1", "families": {}}
    for family, cases in families.items():
        rows = []
        for data_source, response, truth in cases:
            expected = reward_score.default_compute_score(data_source, response, truth)
            rows.append({"data_source": data_source, "response": response, "ground_truth": truth,
                         "expected": expected})
        out["families"][family] = rows
    out["gsm8k_flexible"] = [{"response": r, "ground_truth": t,
                              "expected": gsm8k.compute_score(r, t, method="flexible")}
                             for _, r, t in gsm8k_cases()]
    # verl runs this function in a spawned pool (for SIGALRM); run here on the main thread, it is the same check
    out["math_verify"] = [{"response": r, "ground_truth": t,
                           "expected": math_verify._verify_in_subprocess("\\boxed{" + t + "}", r)}
                          for _, r, t in math_cases("lighteval/MATH")[::3]]
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    print(f"{OUT}: " + ", ".join(f"{k} {len(v)}" for k, v in out["families"].items())
          + f", gsm8k_flexible {len(out['gsm8k_flexible'])}, math_verify {len(out['math_verify'])}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: make_rewards.py VERL_SOURCE_DIR (the unpacked verl 0.9.1 wheel)")
    main(sys.argv[1])
