"""The checks of the sampling settings (``rollout.*``, ``evaluation.*``) that ask the rollout
backends; the ranges are the schema's (``config/bounds.py``). ``rollout_problems`` returns them,
each naming its key; ``hybridlab.run_config.validate_config`` runs it with the rest.
"""
from __future__ import annotations

from hybridlab.config import RunConfig
from hybridlab.config.bounds import one_of
from hybridlab.workers.rollout.worker import BACKENDS

DTYPES = ("float32", "bfloat16")


def rollout_problems(cfg: RunConfig) -> list[str]:
    """Return the problems of the rollout backend, its dtype and its prefix cache."""
    r = cfg.rollout
    p = [*one_of("rollout.backend", r.backend, BACKENDS), *one_of("rollout.dtype", r.dtype, DTYPES)]
    if r.prefix_caching and r.backend != "vllm":
        p.append(f"rollout.prefix_caching: needs rollout.backend=vllm (the {r.backend} backend has no prefix cache)")
    return p
