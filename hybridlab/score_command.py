"""``hybridlab score``: score given responses with the reward a run with these settings uses.

A user checks a reward before a long run: the data file's rows (verl's columns) and a JSONL file
with one ``{"response": TEXT}`` per row, in order, go through the same scorer the run's reward
workers build (``reward.kind`` rule or function, ``reward.gsm8k_extraction``,
``reward.math_verifier``, ``reward.format_score``, ``reward.error_score``, ``reward.timeout_s``).
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from hybridlab.config.schema import SandboxConfig
from hybridlab.errors import UserError
from hybridlab.scorers import ScorerOptions
from hybridlab.tasks import Sample
from hybridlab.tasks.dataset import load_dataset, read_rows


def read_responses(path: str | Path, rows: int) -> list[str]:
    """Return the ``response`` of each row of a JSONL file; raises UserError naming the file and
    row for a bad row, or the counts when they differ from the data file's ``rows``."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"--responses {path}: no such file")
    out = []
    for number, row in read_rows(path):
        if not isinstance(row.get("response"), str):
            raise UserError(f"{path}: row {number}: expected a string 'response', got the keys {sorted(row)}")
        out.append(row["response"])
    if len(out) != rows:
        raise UserError(f"{path} has {len(out)} responses and the data file {rows} rows;"
                        " give one response per row, in the data file's order")
    return out


def score_responses(reward, samples: list[Sample], responses: list[str],
                    sandbox: SandboxConfig = SandboxConfig()) -> list[dict]:
    """Return one ``{"score", "acc", ..., "error"}`` per response under the ``reward`` settings
    (a RewardConfig; code answers run in ``sandbox``): ``acc`` where it is known, the other
    entries of a dict-valued reward (``pred``...), and ``error`` where scoring failed (then
    ``score`` is ``reward.error_score``)."""
    from hybridlab.workers.reward.scoring import RuleScorer, check_sources, load_function, score_samples

    if reward.kind == "model":
        raise UserError("reward.kind=model scores token ids with a reward model; hybridlab score checks the rule"
                        " and function rewards")
    rules = RuleScorer(ScorerOptions.of(reward, sandbox))
    if reward.kind == "rule":
        check_sources(samples, rules.options)
    fn = load_function(reward.function, reward.function_kwargs) if reward.kind == "function" else rules
    items = [(s.data_source, text, s.ground_truth, s.extra_info) for s, text in zip(samples, responses)]
    return [{"score": row.score, **({} if math.isnan(row.acc) else {"acc": row.acc}),
             **row.components, **{k: v for k, v in row.answer.items() if k not in ("score", "acc")},
             **({"error": row.error} if row.error else {})}
            for row in score_samples(fn, rules, reward.kind, items, reward.error_score, reward.timeout_s)]


def summary(rows: list[dict]) -> str:
    """Return one line: the rows, their mean score, accuracy (where known) and errors."""
    known = [r["acc"] for r in rows if "acc" in r]
    accuracy = f", accuracy {sum(known) / len(known):.3f} over {len(known)}" if known else ""
    errors = sum(1 for r in rows if "error" in r)
    return f"{len(rows)} responses: mean score {sum(r['score'] for r in rows) / len(rows):.4f}{accuracy}, {errors} errors"


def cmd_score(args) -> int:
    """Score ``--responses`` against ``--data`` and print the scores; returns the exit status."""
    from hybridlab.run_config import load_config

    cfg = load_config(args.config, args.overrides)
    samples = load_dataset(args.data)
    rows = score_responses(cfg.reward, samples, read_responses(args.responses, len(samples)), cfg.sandbox)
    if cfg.algorithm.overlong_buffer.enable:
        print("note: algorithm.overlong_buffer's length penalty counts the run's response tokens; these scores"
              " are before it", file=sys.stderr)
    if args.json:
        for row in rows:
            print(json.dumps(row))
        print(summary(rows), file=sys.stderr)
        return 0
    for sample, row in zip(samples, rows):
        extra = "".join(f" {k}={v:g}" if isinstance(v, float) else f" {k}={v}" for k, v in row.items()
                        if k not in ("score", "error"))
        print(f"{sample.origin}: score {row['score']:g}{extra}{'  ' + row['error'] if 'error' in row else ''}")
    print(summary(rows))
    return 0


def add_command(sub) -> None:
    """Add ``score`` to the ``hybridlab`` command's subparsers."""
    s = sub.add_parser("score", help="score given responses with the reward a run with these settings uses")
    s.add_argument("config", nargs="?", default=None, help="YAML file or preset name (omit for the defaults)")
    s.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. reward.math_verifier=math-verify")
    s.add_argument("--data", required=True, help="the prompts: a verl-format parquet or JSONL file")
    s.add_argument("--responses", required=True, help="a JSONL file with one {\"response\": TEXT} per data row, in order")
    s.add_argument("--json", action="store_true",
                   help="print one JSON object per row (score, acc, the reward's other numbers, error); the summary"
                        " goes to standard error")
    s.set_defaults(func=cmd_score)
