"""The mapping advisor against this machine: predicted and measured step time of GRPO on the
small and mid models, mapping by mapping, on two devices of one core each (threads bound).

For each model one session runs; it is remapped live onto each mapping of ``MAPPINGS`` (and
onto the planner's first choice when that is none of them), runs ``warmup`` steps and then
``steps`` timed ones. The prediction for a mapping uses the device profile (this machine's
from ``hybridlab calibrate``; measured here when there is none) and the responses' mean length
measured in that mapping's own steps; nothing is fitted to the step times.

Keys: ``rows`` (model, mapping, off_policy, predicted_s, measured_s, error = predicted /
measured - 1, and both per stage), ``median_abs_error`` (goal at most 0.20), and per model the
planner's ``first_choice`` against the best measured mapping (``gap``: measured first choice
over best measured - 1, goal at most 0.10).
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import tempfile
from pathlib import Path

from hybridlab.advisor.cost_model import Workload, predict
from hybridlab.advisor.plan import best, plan
from hybridlab.advisor.profile import LOCAL, load_profile, profile_dir
from hybridlab.controller.mapping import DeviceMapping
from hybridlab.environment import processor
from hybridlab.errors import UserError
from hybridlab.models.zoo import resolve_model

ROLES = ("actor", "rollout", "reward")
GOALS = {"median_abs_error": 0.20, "first_choice_gap": 0.10}


def _colocated(devices: int, **layouts) -> dict:
    return {"pools": {"main": {"devices": devices}},
            "roles": {r: {"pool": "main", "dp": devices, "colocate": "engine", **layouts.get(r, {})} for r in ROLES}}


def _split(reward: str) -> dict:
    roles = {"actor": {"pool": "train", "colocate": "t"}, "rollout": {"pool": "gen", "colocate": "g"},
             "reward": {"pool": "train" if reward == "train" else "gen", "colocate": "t" if reward == "train" else "g"}}
    return {"pools": {"train": {"devices": 1}, "gen": {"devices": 1}}, "roles": roles}


# name -> (mapping, off_policy)
MAPPINGS = {
    "colocated": (_colocated(2), False),
    "colocated_off_policy": (_colocated(2), True),
    "split": (_split("train"), False),
    "split_off_policy": (_split("train"), True),
    "split_reward_beside_rollout_off_policy": (_split("gen"), True),
    "actor_tp2": (_colocated(2, actor={"tp": 2, "dp": 1}), False),
    "rollout_tp2": (_colocated(2, rollout={"tp": 2, "dp": 1}), False),
    "one_device": (_colocated(1), False),
}


def _settings(model_dir: Path, run_dir: Path, prompts: int, group: int, new_tokens: int) -> list[str]:
    return [f"model={model_dir}", "warm_start.max_steps=0", f"data.prompts_per_step={prompts}",
            f"rollout.n={group}", f"rollout.max_new_tokens={new_tokens}", f"actor.ppo_mini_batch_size={prompts}",
            "data.test_samples=8", "trainer.progress=false", "trainer.telemetry=false", "trainer.eval_every=0",
            "trainer.bind_threads=true", "trainer.spare_processes=0", "trainer.save_every=0",
            f"trainer.run_dir={run_dir}"]


def _measure(rl, mapping: dict, off_policy: bool, warmup: int, steps: int) -> dict:
    """Remap ``rl`` (and set off-policy), run the steps; returns the median step and stage seconds
    and the responses' mean length of the timed steps."""
    rl.update(f"trainer.off_policy={str(off_policy).lower()}")
    if DeviceMapping.from_dict(mapping) != rl.mapping:
        rl.remap(mapping)
    for _ in range(warmup):
        rl.step()
    timed = [rl.step().metrics for _ in range(steps)]
    stages = [k for k in timed[0] if k.startswith("timing/") and k != "timing/step_s"]
    return {"measured_s": round(statistics.median(m["timing/step_s"] for m in timed), 4),
            "measured_stage_s": {k[7:-2]: round(statistics.median(m[k] for m in timed), 4) for k in stages},
            "response_mean": statistics.mean(m["response_length/mean"] for m in timed)}


def _first_choice(rl, profile, work: Workload) -> tuple[str, dict, bool, float]:
    """Return the planner's best mapping on the session's two devices, on- or off-policy:
    (label, mapping dict, off_policy, predicted seconds)."""
    options = []
    for off in (False, True):  # off-policy changes the stages too (the old log-probs are computed)
        cfg = dataclasses.replace(rl.cfg, trainer=dataclasses.replace(rl.cfg.trainer, off_policy=off))
        c = best(plan(cfg, 2, profile, work=work))
        options.append((c.label + (", off-policy" if off else ""), c.mapping.to_dict(), off, c.prediction.step_s))
    return min(options, key=lambda o: o[3])


def _row(rl, model: str, work: Workload, name: str, mapping: dict, off_policy: bool, profile, warmup: int,
         steps: int) -> dict:
    """Measure one mapping on the session and predict it (``work``: the session's workload, with
    the measured steps' mean response length); returns its row."""
    m = _measure(rl, mapping, off_policy, warmup, steps)
    p = predict(dataclasses.replace(work, response_mean=m["response_mean"]), rl.cfg, DeviceMapping.from_dict(mapping),
                profile)
    return {"model": model, "name": name, "mapping": mapping, "off_policy": off_policy,
            "devices": sum(pool["devices"] for pool in mapping["pools"].values()), "predicted_s": p.step_s, **m,
            "error": round(p.step_s / m["measured_s"] - 1, 3), "predicted_stage_s": p.stage_s}


def _model_rows(model: str, names: list[str], profile, warmup: int, steps: int, sizes: tuple[int, int, int]) -> tuple:
    """Measure ``names`` and the planner's first choice on one session of ``model``; returns the
    rows and the name of the row that is the first choice."""
    from hybridlab.dataflow.session import RLSession

    model_dir = resolve_model(model)
    with tempfile.TemporaryDirectory() as tmp:
        first_mapping = json.dumps(MAPPINGS[names[0]][0])
        rl = RLSession(None, _settings(model_dir, Path(tmp) / "run", *sizes) + [f"mapping={first_mapping}"]).start()
        try:
            work = Workload.of(rl.cfg, model_dir)  # the prompts and the model: read once
            rows = [_row(rl, model, work, n, *MAPPINGS[n], profile, warmup, steps) for n in names]
            mean = statistics.mean(r["response_mean"] for r in rows)
            label, mapping, off, _ = _first_choice(rl, profile, dataclasses.replace(work, response_mean=mean))
            same = next((r for r in rows if r["off_policy"] == off
                         and DeviceMapping.from_dict(r["mapping"]) == DeviceMapping.from_dict(mapping)), None)
            if same is None:
                rows.append(_row(rl, model, work, label, mapping, off, profile, warmup, steps))
            return rows, same["name"] if same else label
        finally:
            rl.shutdown()


def _first_choice_row(rows: list[dict], chosen: str) -> dict:
    two = [r for r in rows if r["devices"] == 2]
    fastest = min(two, key=lambda r: r["measured_s"])
    pick = next(r for r in two if r["name"] == chosen)
    return {"name": chosen, "measured_s": pick["measured_s"], "best_measured": fastest["name"],
            "best_measured_s": fastest["measured_s"], "gap": round(pick["measured_s"] / fastest["measured_s"] - 1, 3)}


def run(models: str = "small,mid", mappings: str = "all", steps: int = 3, warmup: int = 1, prompts: int = 8,
        group: int = 8, max_new_tokens: int = 32, profile: str = "") -> dict:
    """Return predicted against measured step time per model and mapping (see the module docstring)."""
    from hybridlab.advisor.calibrate import calibrate

    names = list(MAPPINGS) if mappings == "all" else [n.strip() for n in str(mappings).split(",")]
    if not names or set(names) - set(MAPPINGS):
        raise UserError(f"benchmark plan: mappings must be 'all' or names from {', '.join(MAPPINGS)} separated by"
                        f" commas; got {mappings!r}")
    if not (profile_dir() / f"{LOCAL}.json").is_file() and not profile:
        calibrate(progress=lambda text: None)  # this machine's profile, measured once and saved
    device = load_profile(profile or None)
    rows, first = [], {}
    for model in [m.strip() for m in models.split(",") if m.strip()]:
        found, chosen = _model_rows(model, names, device, warmup, steps, (prompts, group, max_new_tokens))
        rows += found
        first[model] = _first_choice_row(found, chosen)
    errors = [abs(r["error"]) for r in rows]
    return {"benchmark": "plan", "processor": processor(), "profile": device.name,
            "profile_source": device.sources, "steps": steps, "warmup": warmup, "rows": rows,
            "median_abs_error": round(statistics.median(errors), 3), "first_choice": first,
            "goals": GOALS, "goals_met": {"median_abs_error": statistics.median(errors) <= GOALS["median_abs_error"],
                                          "first_choice_gap": all(f["gap"] <= GOALS["first_choice_gap"]
                                                                  for f in first.values())}}
