"""The range of every numeric setting that has one, spelled once (``RANGES``), and the helper
the parts' own checks are written with (``one_of``).

``bound_problems(cfg)`` names each setting outside its range. The checks that ask a registry
(an estimator, a backend, a reward kind) or read several keys together live in the part they
check; ``hybridlab.run_config.validate_config`` lists them all.
"""
from __future__ import annotations

import functools
import math
from typing import Any

# key: the lowest value allowed, or "positive", or "(0, 1]"
RANGES: dict[str, float | str] = {
    "rollout.n": 1, "rollout.max_new_tokens": 1, "rollout.temperature": 0, "rollout.top_k": 0, "rollout.top_p": "(0, 1]",
    "evaluation.n": 1, "evaluation.temperature": 0, "evaluation.top_k": 0, "evaluation.top_p": "(0, 1]",
    "actor.tau_pos": "positive", "actor.tau_neg": "positive", "actor.clip_cov_ratio": "positive",
    "actor.kl_cov_ratio": "positive",
    "data.prompts_per_step": 1, "trainer.steps": 1, "trainer.devices": 1, "actor.ppo_epochs": 1,
    "actor.ppo_mini_batch_size": 1, "actor.micro_batch_size": 1, "critic.ppo_mini_batch_size": 1,
    "critic.micro_batch_size": 1, "actor.micro_batch_tokens": 0, "critic.micro_batch_tokens": 0,
    "data.train_samples": 0, "data.test_samples": 0,
    "warm_start.max_steps": 0, "warm_start.warmup_steps": 0, "warm_start.eval_every": 1, "warm_start.eval_samples": 1,
    "warm_start.batch_size": 1, "warm_start.target_accuracy": "(0, 1]", "warm_start.lr": "positive",
    "trainer.max_staleness": 1, "trainer.eval_every": 0, "trainer.save_every": 0, "trainer.max_restarts": 0,
    "trainer.spare_processes": 0, "trainer.call_deadline_s": 0, "trainer.keep_checkpoints": 1,
    "trainer.max_bad_updates": 1, "trainer.call_deadline_floor_s": "positive", "trainer.max_minutes": 0,
    "trainer.critic_warmup": 0,
    "sandbox.wall_s": 0.1, "sandbox.cpu_s": 1, "sandbox.memory_mb": 64,
    "sandbox.processes": 4,  # bwrap and the program take two
    "sandbox.file_mb": 1, "sandbox.open_files": 16, "sandbox.output_kb": 1, "sandbox.test_timeout_s": 0.1,
    "sandbox.parallel": 1,
}


def one_of(key: str, value: Any, allowed) -> list[str]:
    """Return the problem of ``value`` for ``key`` when it is not in ``allowed`` (else none)."""
    return [] if value in allowed else [f"{key}: {value!r} is not one of {', '.join(map(str, allowed))}"]


def bound_problems(cfg: Any) -> list[str]:
    """Return a problem for each setting of ``RANGES`` outside its range, naming the key."""
    out = []
    for key, bound in RANGES.items():
        value = functools.reduce(getattr, key.split("."), cfg)  # the dotted key's value
        if isinstance(value, float) and math.isnan(value):  # NaN compares false with every bound
            out.append(f"{key}: must be a number, got nan")
        elif bound == "positive" and not value > 0:
            out.append(f"{key}: must be positive, got {value}")
        elif bound == "(0, 1]" and not 0 < value <= 1:
            out.append(f"{key}: must be in (0, 1], got {value}")
        elif not isinstance(bound, str) and value < bound:
            out.append(f"{key}: must be at least {bound}, got {value!r}")
    return out
