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
}


def run(name: str, **options) -> dict:
    """Run benchmark ``name`` and return its result dict."""
    if name not in BENCHES:
        raise unknown("benchmark", name, BENCHES)
    return importlib.import_module(BENCHES[name]).run(**options)
