"""Scorers for the text ``data_source`` values verl scores by default, with verl's results.

``scorer_for(data_source, options)`` returns ``fn(response, ground_truth) -> {"score", "acc", ...}``
for a source verl knows, or raises UserError naming why there is none. The families:

- ``openai/gsm8k``: ``gsm8k`` (strict ``####``; ``reward.gsm8k_extraction=flexible``: the last number)
- the MATH family: ``math_equiv`` (the MATH benchmark's string check)
- ``math_dapo``, ``math``, ``math_dapo_reasoning``, ``aime*``: ``minerva`` (DAPO's ``Answer:`` check)
- the seven ``searchR1_*`` sources: ``qa_em`` (exact match after SQuAD normalisation)
- the six ``numina_*`` sources: ``numina`` (verl's ``prime_math``: PRM800K's grader, then ``numina_equal``)
- ``codecontests``, ``apps``, ``codeforces``, ``taco``: the code run against its tests in the
  sandbox (``hybridlab.sandbox.code_tests``, verl's ``prime_code`` scores)

``reward.math_verifier=math-verify`` checks the MATH and DAPO families by algebra (``algebra``).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

from hybridlab.config.schema import SandboxConfig
from hybridlab.errors import UserError
from hybridlab.sandbox import Sandbox
from hybridlab.sandbox.code_tests import score_code
from hybridlab.scorers import algebra, gsm8k, math_equiv, minerva, numina, qa_em

SourceScorer = Callable[[str, Any], dict]
MATH_VERIFIERS = ("rules", "math-verify")

GSM8K = ("openai/gsm8k",)
MATH = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
DAPO = ("math_dapo", "math", "math_dapo_reasoning")  # and every source that starts with "aime"
SEARCH_R1 = tuple(f"searchR1_{name}" for name in
                  ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle"))
NUMINA = tuple(f"numina_{name}" for name in
               ("aops_forum", "synthetic_math", "amc_aime", "synthetic_amc", "cn_k12", "olympiads"))
CODE = ("codecontests", "apps", "codeforces", "taco")

# verl scores these by default; hybridlab does not, for the reason given
REFUSED = {
    "hiyouga/geometry3k": "an image task (verl's geo3k scores answers to pictures); hybridlab trains on text only",
}


@dataclasses.dataclass(frozen=True)
class ScorerOptions:
    """The reward settings the source scorers read."""
    format_score: float = 0.0           # gsm8k and searchR1: a found but wrong answer
    gsm8k_extraction: str = "strict"    # gsm8k.METHODS
    math_verifier: str = "rules"        # MATH_VERIFIERS
    sandbox: SandboxConfig = dataclasses.field(default_factory=SandboxConfig)  # where code answers run

    @classmethod
    def of(cls, reward, sandbox: SandboxConfig = SandboxConfig()) -> "ScorerOptions":
        """Return the options of a run's ``reward`` and ``sandbox`` settings."""
        return cls(reward.format_score, reward.gsm8k_extraction, reward.math_verifier, sandbox)


def family(data_source: str) -> str | None:
    """Return the scorer family of ``data_source`` (gsm8k, math, dapo, search_r1, numina, code), or None."""
    if data_source in GSM8K:
        return "gsm8k"
    if data_source in MATH:
        return "math"
    if data_source in DAPO or data_source.startswith("aime"):
        return "dapo"
    if data_source in SEARCH_R1:
        return "search_r1"
    if data_source in NUMINA:
        return "numina"
    if data_source in CODE:
        return "code"
    return None


def reports_acc(data_source: str, options: ScorerOptions = ScorerOptions()) -> bool:
    """True when verl's scorer of ``data_source`` answers with an ``acc`` (DAPO's dict), False
    when it answers a bare score (GSM8K, MATH, Search-R1, Math-Verify); verl names its validation
    metric after ``acc`` or ``reward`` accordingly. Sources verl does not know: True."""
    kind = family(data_source)
    return kind is None or (kind == "dapo" and options.math_verifier == "rules")


def known_sources() -> list[str]:
    """Return the data sources these scorers serve (``aime*`` as a pattern)."""
    return [*GSM8K, *MATH, *DAPO, "aime*", *SEARCH_R1, *NUMINA, *CODE]


def scorer_for(data_source: str, options: ScorerOptions = ScorerOptions()) -> SourceScorer:
    """Return the scorer of ``data_source`` under ``options``; raises UserError for a source
    verl scores that hybridlab refuses (with why) or one no scorer serves."""
    kind = family(data_source)
    if kind is None:
        why = REFUSED.get(data_source, "not a source verl scores by default")
        raise UserError(f"no built-in scorer for data_source {data_source!r}: {why}")
    if kind in ("math", "dapo") and options.math_verifier == "math-verify":
        return algebra.score
    if kind == "gsm8k":
        return functools.partial(gsm8k.score, method=options.gsm8k_extraction, format_score=options.format_score)
    if kind == "search_r1":
        return functools.partial(qa_em.score, format_score=options.format_score)
    if kind == "code":  # raises SandboxUnavailable, naming what is missing, where code cannot be isolated
        return functools.partial(score_code, Sandbox(options.sandbox))
    return {"math": math_equiv.score, "dapo": minerva.score, "numina": numina.score}[kind]
