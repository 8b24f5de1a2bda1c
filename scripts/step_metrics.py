"""Record, or check against a record, the per-step metrics of seeded runs: a refactor of the step
must reproduce them exactly.

    .venv/bin/python scripts/step_metrics.py record OUT.json   # the runs' metrics
    .venv/bin/python scripts/step_metrics.py check OUT.json    # runs again; exit 1 naming each difference

Each run is the embedded default run (its warm start) shrunk to a few short steps, once as GRPO and
once as PPO (critic, reference, KL in the reward), with trainer.seed fixed; every metric is kept
except those that measure time, throughput, memory or device use. The numbers depend on the
processor (vLLM's and torch's CPU kernels): compare records made on the same machine kind.
"""
from __future__ import annotations

import json
import re
import sys
import tempfile
from pathlib import Path

SHRUNK = ["model=tiny", "data.prompts_per_step=8",
          "rollout.n=4", "rollout.max_new_tokens=8", "actor.ppo_mini_batch_size=8", "data.test_samples=16",
          "trainer.steps=3", "trainer.eval_every=0", "trainer.save_every=0", "trainer.progress=false",
          "trainer.telemetry=false", "trainer.seed=7"]
RUNS = {"grpo": [], "ppo": ["algorithm.adv_estimator=gae", "algorithm.use_kl_in_reward=true",
                            "critic.ppo_mini_batch_size=8"]}
# what a run measures rather than computes: differs between two runs of the same code
MEASURED = re.compile(r"^(timing|perf|busy|device|mem|sync/seconds|sync/bytes_per_s)|_s$|seconds|per_s|warnings$|^time$")


def run_metrics(name: str, overrides: list[str]) -> dict:
    """Return {"steps": [each step's computed metrics], "eval": [the evaluation curve]} of one run."""
    from hybridlab.dataflow.session import RLSession

    with tempfile.TemporaryDirectory() as tmp:
        rl = RLSession("grpo", [*SHRUNK, *overrides, f"trainer.run_dir={tmp}/{name}"])
        try:
            summary = rl.start().train()
        finally:
            rl.shutdown()
        rows = [json.loads(line) for line in Path(tmp, name, "metrics.jsonl").read_text().splitlines()]
    steps = [{k: v for k, v in row.items() if not MEASURED.search(k)} for row in rows]
    return {"steps": steps, "eval": [{"step": c["step"], "accuracy": c["accuracy"]} for c in summary["eval_curve"]],
            "warm_start": {k: v for k, v in (summary["warm_start"] or {}).items() if k != "seconds"}}


def differences(want: dict, got: dict, where: str = "") -> list[str]:
    """Return a line per value that differs between two records (keys missing on either side too)."""
    if isinstance(want, dict) and isinstance(got, dict):
        out = []
        for key in sorted(set(want) | set(got)):
            if key not in got or key not in want:
                out.append(f"{where}{key}: only in the {'record' if key in want else 'new run'}")
            else:
                out += differences(want[key], got[key], f"{where}{key}/")
        return out
    if isinstance(want, list) and isinstance(got, list) and len(want) == len(got):
        return [d for i, (w, g) in enumerate(zip(want, got)) for d in differences(w, g, f"{where}{i}/")]
    same = want == got or (want != want and got != got)  # NaN equals NaN here
    return [] if same else [f"{where.rstrip('/')}: recorded {want!r}, now {got!r}"]


def main(argv: list[str]) -> int:
    """Record or check (see the module docstring); returns the exit status: 1 when a check differs."""
    if len(argv) != 2 or argv[0] not in ("record", "check"):
        print(__doc__, file=sys.stderr)
        return 2
    got = {name: run_metrics(name, overrides) for name, overrides in RUNS.items()}
    path = Path(argv[1])
    if argv[0] == "record":
        path.write_text(json.dumps(got, indent=1) + "\n")
        print(f"recorded {path}")
        return 0
    diff = differences(json.loads(path.read_text()), json.loads(json.dumps(got)))
    print("\n".join(diff) or f"identical to {path}")
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
