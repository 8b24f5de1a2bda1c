"""Benchmarks: ``hybridlab bench NAME --json`` prints one JSON object of ratios against a baseline
measured side by side in the same run."""
from __future__ import annotations

import importlib

from hybridlab.errors import unknown

BENCHES = {
    "dispatch": "hybridlab.bench.dispatch",
    "train": "hybridlab.bench.train",
    "rollout": "hybridlab.bench.rollout",
    "sync": "hybridlab.bench.sync",
    "e2e": "hybridlab.bench.e2e",
    "learn": "hybridlab.bench.learn",
    "remap": "hybridlab.bench.remap",
    "soak": "hybridlab.bench.soak",
    "precision": "hybridlab.bench.precision",
    "lora": "hybridlab.bench.lora",
    "dpo": "hybridlab.bench.dpo",
    "agent": "hybridlab.bench.agent",
    "dashboard": "hybridlab.bench.dashboard",
    "plan": "hybridlab.bench.plan",
    "published": "hybridlab.bench.published",
    "start": "hybridlab.bench.start",
    "sandbox": "hybridlab.bench.sandbox",
    "tinker": "hybridlab.bench.tinker",
    "async": "hybridlab.bench.asynchronous",
}


def alternating(first, second, rounds: int) -> tuple:
    """Return the order in which two settings' sessions run: ``first, second, second, first, ...``
    for ``rounds`` pairs, so that each setting sees early and late sessions alike (1 round: one
    session of each, the smallest comparison; 2: the benchmarks' default)."""
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be an integer of at least 1, got {rounds!r}")
    return tuple((first, second, second, first)[i % 4] for i in range(2 * rounds))


def run(name: str, **options) -> dict:
    """Run benchmark ``name`` and return its result dict."""
    if name not in BENCHES:
        raise unknown("benchmark", name, BENCHES)
    return importlib.import_module(BENCHES[name]).run(**options)
