"""The checks of the reward settings (``reward.*``): its kind, the scorers' options and, for a
user's function, the import itself, so a bad path or signature fails before any worker starts.
``reward_problems`` returns them, each naming its key; ``hybridlab.run_config.validate_config``
runs it with the rest.
"""
from __future__ import annotations

import math
from pathlib import Path

from hybridlab.config import RunConfig
from hybridlab.config.bounds import one_of
from hybridlab.errors import UserError
from hybridlab.scorers import MATH_VERIFIERS, gsm8k
from hybridlab.workers.reward.scoring import load_function
from hybridlab.workers.reward.worker import KINDS


def reward_problems(cfg: RunConfig) -> list[str]:
    """Return the problems of ``reward.*``."""
    reward = cfg.reward
    p = [*one_of("reward.kind", reward.kind, KINDS),
         *one_of("reward.gsm8k_extraction", reward.gsm8k_extraction, gsm8k.METHODS),
         *one_of("reward.math_verifier", reward.math_verifier, MATH_VERIFIERS)]
    if not math.isfinite(reward.timeout_s) or reward.timeout_s < 0:
        p.append(f"reward.timeout_s: must be 0 (no limit) or a finite positive number of seconds, got {reward.timeout_s}")
    if reward.kind == "function" and not reward.function:
        p.append("reward.function: reward.kind is 'function', so give an import path like mypkg.rewards:score")
    elif reward.kind == "function":
        try:
            load_function(reward.function, reward.function_kwargs)
        except UserError as exc:
            p.append(str(exc))
    if reward.kind == "model" and not reward.model:
        p.append("reward.model: reward.kind is 'model', so give a reward-model checkpoint directory")
    if reward.model and not Path(reward.model).is_dir():
        p.append(f"reward.model: no checkpoint directory {reward.model!r}")
    return p
