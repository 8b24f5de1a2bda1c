"""Live remap of a running RL session against the restart path, per transition.

After a few GRPO steps of the small model (colocated on one device), each transition is done
three times from the same mapping (one step apart):

- ``remap_s``: ``rl.remap(new)`` on the running session with ``trainer.spare_processes=2`` (the
  default of this benchmark; the spares have warmed up before the timer starts): only changed
  roles re-created, in spare processes, the actor's weights and AdamW moments carried through
  Ray's object store, the rollout resynced;
- ``remap_fresh_s``: the same remap with no spares (every re-created role in a new process);
- ``restart_s``: what a user does without live remapping, exactly: save the actor's weights and
  optimizer state with the engine-level checkpoint code, shut the workers down (Ray stays up),
  start a new session on the new mapping from the saved weights (no second warm start), load
  the optimizer state, and sync the rollout.

``exact``: the actor's weights, moments and step after each remap (with and without spares)
equal those before, bit for bit.
"""
from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path

import torch

from hybridlab.dataflow.session import RLSession
from hybridlab.environment import processor
from hybridlab.errors import UserError
from hybridlab.models.zoo import resolve_model
from hybridlab.workers.train import checkpoint
from hybridlab.workers.train.checkpoint import merge_state

COLOCATED = {"pools": {"main": {"devices": 1}},
             "roles": {r: {"pool": "main", "colocate": "engine"} for r in ("actor", "rollout", "reward")}}
SEPARATE = {"pools": {"train": {"devices": 1}, "gen": {"devices": 1}},
            "roles": {"actor": {"pool": "train"}, "rollout": {"pool": "gen", "colocate": "g"},
                      "reward": {"pool": "gen", "colocate": "g"}}}
ACTOR_TP2 = {"pools": {"train": {"devices": 2}, "gen": {"devices": 1}},
             "roles": {"actor": {"pool": "train", "tp": 2}, "rollout": {"pool": "gen", "colocate": "g"},
                       "reward": {"pool": "gen", "colocate": "g"}}}
SPARES = 2  # enough for either transition (each starts two processes)
TRANSITIONS = (("colocated_to_separate", COLOCATED, SEPARATE), ("actor_tp1_to_tp2", SEPARATE, ACTOR_TP2))


def _settings(model: str, run_dir: Path) -> list[str]:
    return [f"model={model}", "warm_start.max_steps=0", "data.prompts_per_step=8", "rollout.n=4",
            "rollout.max_new_tokens=8", "actor.ppo_mini_batch_size=8", "data.test_samples=8",
            "trainer.progress=false", "trainer.telemetry=false", f"trainer.run_dir={run_dir}",
            f"trainer.spare_processes={SPARES}"]


def _actor_state(rl) -> dict[str, torch.Tensor]:
    parts = rl.workers.groups["actor"].checkpoint_state()
    out = {f"{key}/{name}": t for key, named in merge_state(parts).items() for name, t in named.items()}
    out["step"] = torch.tensor(next(p for p in parts if p)["step"])
    return out


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def restart(rl, new_mapping: dict, workdir: Path):
    """The restart path onto ``new_mapping``; returns (the new session, seconds it took)."""
    start = time.perf_counter()
    ckpt = checkpoint.save_checkpoint(rl.workers.groups["actor"], rl.model_dir, workdir / "ckpt")
    rl.shutdown()
    # No spares here: a new session's spares would warm up against its own start.
    cfg = dataclasses.replace(rl.cfg, model=str(ckpt), mapping=new_mapping,
                              trainer=dataclasses.replace(rl.cfg.trainer, run_dir=str(workdir / "restarted"),
                                                          spare_processes=0))
    fresh = RLSession(cfg).start()
    checkpoint.load_optimizer(fresh.workers.groups["actor"], ckpt)
    fresh.sync_weights()
    return fresh, time.perf_counter() - start


def run(model: str = "small", steps: int = 3, transitions: str = "all") -> dict:
    """Return per transition ``remap_s``, ``restart_s``, ``speedup``, ``bytes_moved``,
    ``roles_recreated`` and ``exact``, with the processor. ``transitions``: ``all`` or names of
    TRANSITIONS separated by commas."""
    names = [t[0] for t in TRANSITIONS]
    chosen = names if transitions == "all" else [t.strip() for t in str(transitions).split(",")]
    if not chosen or set(chosen) - set(names):
        raise UserError(f"benchmark remap: transitions must be 'all' or names from {', '.join(names)} separated"
                        f" by commas; got {transitions!r}")
    model_dir = resolve_model(model)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, before, after in (t for t in TRANSITIONS if t[0] in chosen):
            work = Path(tmp) / name
            rl = RLSession(None, _settings(model_dir, work / "run") + [f"mapping={before}"]).start()
            try:
                for _ in range(steps):
                    rl.step()
                state = _actor_state(rl)
                rl.workers.spares.wait_ready()  # what a session that has run a while has
                report = rl.remap(after)
                rl.update("trainer.spare_processes=0")  # the paths below run without: no refill to warm
                exact = _equal(state, _actor_state(rl))
                rl.step()  # the remapped session trains
                rl.remap(before)  # back, untimed: the other paths start from the same mapping
                state = _actor_state(rl)
                no_spares = rl.remap(after)
                exact = exact and _equal(state, _actor_state(rl))
                rl.remap(before)
                fresh, restart_s = restart(rl, after, work)
                fresh.step()
                fresh.shutdown()
            finally:
                rl.shutdown()
            restart_s = round(restart_s, 3)
            results.append({"transition": name, "remap_s": report.seconds["total"], "restart_s": restart_s,
                            "speedup": round(restart_s / report.seconds["total"], 2),
                            "remap_fresh_s": no_spares.seconds["total"],
                            "speedup_fresh": round(restart_s / no_spares.seconds["total"], 2),
                            "spares_used": report.spares_used,
                            "bytes_moved": report.bytes_moved, "roles_recreated": report.roles_recreated,
                            "processes_started": report.processes_started, "phases_s": report.seconds,
                            "exact": exact})
    return {"benchmark": "remap", "model": model, "processor": processor(), "spare_processes": SPARES,
            "transitions": results, "goal_speedup": 5.0}
