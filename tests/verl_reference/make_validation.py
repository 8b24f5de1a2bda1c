"""Regenerate ``validation.json``: constructed validation answers and verl 0.9.1's validation
metrics for them (``process_validation_metrics`` and ``RayPPOTrainer._val_metrics_update``).

verl is not a dependency: this script reads the two functions' source from verl's unpacked wheel
and runs them alone (the modules that hold them import verl's whole runtime), and
``tests/test_verl_keys.py`` only reads the JSON it writes. To regenerate:

    pip download --no-deps verl==0.9.1 -d /tmp/verl-wheel
    python -m zipfile -e /tmp/verl-wheel/verl-0.9.1-py3-none-any.whl /tmp/verl-src
    python tests/verl_reference/make_validation.py /tmp/verl-src

Each case is one validation: its answers' data sources, prompt ids and reward extra info (the
``reward`` of each answer and, for a dict-valued reward, its entries), built from a seeded
generator so the file is the same on every run.
"""
from __future__ import annotations

import ast
import json
import random
import sys
from collections import defaultdict
from functools import partial
from pathlib import Path
from typing import Any, Callable

import numpy as np

OUT = Path(__file__).with_name("validation.json")
METRIC_FUNCTIONS = ("bootstrap_metric", "calc_maj_val", "process_validation_metrics")


def load_verl(source: str) -> Callable:
    """Return verl's ``_val_metrics_update`` as a function of (data_sources, uids, infos)."""
    namespace = {"np": np, "defaultdict": defaultdict, "partial": partial, "Any": Any, "Callable": Callable}
    tree = ast.parse((Path(source) / "verl/trainer/ppo/metric_utils.py").read_text())
    wanted = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in METRIC_FUNCTIONS]
    trainer = ast.parse((Path(source) / "verl/trainer/ppo/ray_trainer.py").read_text())
    cls = next(node for node in trainer.body if isinstance(node, ast.ClassDef) and node.name == "RayPPOTrainer")
    wanted += [node for node in cls.body if isinstance(node, ast.FunctionDef) and node.name == "_val_metrics_update"]
    assert len(wanted) == 4, [node.name for node in wanted]
    exec(compile(ast.Module(body=wanted, type_ignores=[]), "verl", "exec"), namespace)
    return lambda sources, uids, infos: namespace["_val_metrics_update"](None, np.array(sources), uids, infos, [])


def case(rng: random.Random, sources: list[str], prompts: int, n: int, kind: str) -> dict:
    """One validation: ``prompts`` prompts per source, ``n`` answers each; ``kind`` is ``number``
    (a bare score), ``dapo`` (score, acc, pred; a few distinct preds so votes tie and differ) or
    ``dict`` (score and a format component, no acc)."""
    rows = {"sources": [], "uids": [], "infos": defaultdict(list)}
    for source in sources:
        for p in range(prompts):
            for _ in range(n):
                rows["sources"].append(source)
                rows["uids"].append(f"{source}-{p}")
                if kind == "dapo":
                    pred = rng.choice(["12", "12", "7", "3/4", "x"][: 2 + p % 4])
                    right = pred == "12"
                    rows["infos"]["reward"].append(1.0 if right else -1.0)
                    rows["infos"]["score"].append(1.0 if right else -1.0)
                    rows["infos"]["acc"].append(float(right))
                    rows["infos"]["pred"].append(pred)
                elif kind == "dict":
                    score = rng.choice([0.0, 0.5, 1.0])
                    rows["infos"]["reward"].append(score)
                    rows["infos"]["score"].append(score)
                    rows["infos"]["format"].append(float(rng.random() < 0.7))
                else:
                    rows["infos"]["reward"].append(rng.choice([0.0, 1.0, 0.1]))
    rows["infos"] = dict(rows["infos"])
    return rows


def main(source: str) -> None:
    update = load_verl(source)
    rng = random.Random(0)
    cases = [case(rng, ["openai/gsm8k"], 5, 1, "number"), case(rng, ["openai/gsm8k", "lighteval/MATH"], 4, 3, "number"),
             case(rng, ["math_dapo"], 6, 4, "dapo"), case(rng, ["math_dapo", "aime2024"], 3, 5, "dapo"),
             case(rng, ["math_dapo"], 2, 8, "dapo"), case(rng, ["mine"], 4, 6, "dict"), case(rng, ["mine"], 3, 2, "dict")]
    for c in cases:
        c["metrics"] = {k: float(v) for k, v in update(c["sources"], c["uids"], c["infos"]).items()}
    OUT.write_text(json.dumps(cases, indent=0) + "\n")
    print(f"{OUT}: {len(cases)} cases, {sum(len(c['metrics']) for c in cases)} metrics")


if __name__ == "__main__":
    main(sys.argv[1])
