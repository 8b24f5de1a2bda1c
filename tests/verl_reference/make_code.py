"""Regenerate ``code.json``: constructed answers to code tasks and verl 0.9.1's ``prime_code``
scores for them (what verl gives ``codecontests``, ``apps``, ``codeforces`` and ``taco`` without a
Sandbox Fusion service).

verl's ``prime_code`` runs the code on the host with no sandbox; every program here is written
by this script and harmless. ``tests/test_sandbox.py`` scores the same answers in hybridlab's
sandbox and compares. To regenerate (as ``make_rewards.py`` says, with verl's wheel unpacked):

    python tests/verl_reference/make_code.py /tmp/verl-src
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from make_rewards import load_verl

OUT = Path(__file__).with_name("code.json")

SUM = {"inputs": ["1 2\n", "3 4\n", "10 -2\n"], "outputs": ["3\n", "7\n", "8\n"]}
SUM_ANSWERS = [
    "a, b = map(int, input().split())\nprint(a + b)",
    "import sys\na, b = map(int, sys.stdin.readline().split())\nprint(a + b)",
    "import sys\nx = sys.stdin.read().split()\nprint(int(x[0]) + int(x[1]))",
    "def main():\n    a, b = map(int, input().split())\n    print(a + b)\n\nif __name__ == '__main__':\n    main()",
    "a, b = map(int, input().split())\nprint(a + b, end='   ')",
    "a, b = map(int, input().split())\nprint()\nprint(a + b)\nprint()",
    "a, b = map(int, input().split())\nprint(float(a + b))",
    "a, b = map(int, input().split())\nprint(a * b)",
    "a, b = map(int, input().split())\nprint(a + b if a < 5 else 0)",
    "a, b = map(int, input().split())\nprint(a + b if a > 2 else -1)",
    "print(1 / 0)",
    "def broken(:\n    pass",
    "a, b = map(int, input().split())\nprint(a + b)\nraise SystemExit(0)",
    "import sys\nprint(sum(map(int, input().split())), file=sys.stderr)",
    "",
]
FLOAT = {"inputs": ["3\n", "7\n"], "outputs": ["0.3333333333\n", "0.1428571429\n"]}
FLOAT_ANSWERS = ["print(1 / int(input()))", "print(round(1 / int(input()), 2))", "print('%.10f' % (1 / int(input())))",
                 "n = int(input())\nprint(1 / n, 0)"]
LINES = {"inputs": ["3\n", "2\n"], "outputs": ["1\n2\n3\n", "1\n2\n"]}
LINES_ANSWERS = ["for i in range(int(input())):\n    print(i + 1)", "print(*range(1, int(input()) + 1))",
                 "for i in range(int(input())):\n    print('  ', i + 1, '  ')",
                 "print('\\n'.join(str(i + 1) for i in range(int(input()))) + '\\n\\n')"]
TWELVE = {"inputs": [f"{i}\n" for i in range(12)], "outputs": [f"{i * i}\n" for i in range(12)]}
TWELVE_ANSWERS = ["n = int(input())\nprint(n * n)", "n = int(input())\nprint(n * n if n != 10 else 0)",
                  "n = int(input())\nprint(n * n if n not in (2, 10) else 0)", "n = int(input())\nprint(n * n if n != 11 else 0)",
                  "n = int(input())\nprint(n * n if n % 2 else -1)"]
CALL = {"fn_name": "twoSum", "inputs": ["[2, 7, 11, 15]\n9", "[3, 2, 4]\n6", "[3, 3]\n6"],
        "outputs": ["[0, 1]", "[1, 2]", "[0, 1]"]}
CALL_ANSWERS = [
    "class Solution:\n    def twoSum(self, nums, target):\n        seen = {}\n        for i, x in enumerate(nums):\n"
    "            if target - x in seen:\n                return [seen[target - x], i]\n            seen[x] = i",
    "def twoSum(nums, target):\n    for i in range(len(nums)):\n        for j in range(i + 1, len(nums)):\n"
    "            if nums[i] + nums[j] == target:\n                return (i, j)",
    "def twoSum(nums, target):\n    return [0, 1]",
    "def twoSum(nums, target):\n    return nums[100]",
    "def two_sum(nums, target):\n    return [0, 1]",
]
WRAPPED = {"fn_name": "double", "inputs": ["4", "[1, 2]"], "outputs": ["[8]", "[[1, 2, 1, 2]]"]}
WRAPPED_ANSWERS = ["def double(x):\n    return x * 2", "def double(x):\n    return [x * 2]", "def double(x):\n    return x"]


def cases() -> list[tuple[str, str, dict]]:
    """(data source, response, ground truth) for every answer, in fences or bare."""
    out = []
    groups = [("codecontests", SUM, SUM_ANSWERS), ("apps", FLOAT, FLOAT_ANSWERS), ("taco", LINES, LINES_ANSWERS),
              ("codeforces", TWELVE, TWELVE_ANSWERS), ("apps", CALL, CALL_ANSWERS), ("taco", WRAPPED, WRAPPED_ANSWERS)]
    for source, truth, answers in groups:
        for i, code in enumerate(answers):
            response = f"Here is my solution:\n```python\n{code}\n```\nDone." if i % 2 == 0 else code
            out.append((source, response, truth))
    first, last = SUM_ANSWERS[7], SUM_ANSWERS[0]
    out.append(("codecontests", f"```python\n{first}\n```\nbetter:\n```python\n{last}\n```", SUM))  # the last block
    out.append(("codecontests", SUM_ANSWERS[0], json.dumps(SUM)))  # ground truth as JSON text
    return out


def main(source: str) -> None:
    reward_score = load_verl(source)
    rows = [{"data_source": s, "response": r, "ground_truth": t,
             "score": float(reward_score.default_compute_score(s, r, json.dumps(t) if isinstance(t, dict) else t))}
            for s, r, t in cases()]
    OUT.write_text(json.dumps(rows, indent=0) + "\n")
    print(f"{OUT}: {len(rows)} answers, {sum(r['score'] == 1.0 for r in rows)} right")


if __name__ == "__main__":
    main(sys.argv[1])
