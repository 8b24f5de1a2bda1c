"""The run configuration, a leaf of the package (it imports nothing else of hybridlab): the
schema (``schema.py``, with the training roles' sections in ``training.py`` and the algorithm's
in ``algorithm.py``: nested dataclasses with verl's key names, each field declaring how a change
of it applies, ``setting.py``) and how YAML and ``key=value`` overrides become a RunConfig
(``loading.py``), with the range of each numeric setting (``bounds.py``). The checks that ask the
stage, algorithm, mapping, task and reward registries live in those parts; ``hybridlab.run_config``
(``load_config``) lists them one level up.
"""
from __future__ import annotations

from hybridlab.config.algorithm import AlgorithmConfig
from hybridlab.config.loading import apply_override, build, config_with, resolve_config_path
from hybridlab.config.schema import (CONFIG_DIR, DataConfig, RewardConfig, RolloutConfig, RunConfig, TrainerConfig,
                                     WarmStartConfig)
from hybridlab.config.setting import ConfigError
from hybridlab.config.training import ActorConfig, CriticConfig

__all__ = ["CONFIG_DIR", "ActorConfig", "AlgorithmConfig", "ConfigError", "CriticConfig", "DataConfig",
           "RewardConfig", "RolloutConfig", "RunConfig", "TrainerConfig", "WarmStartConfig", "apply_override",
           "build", "config_with", "resolve_config_path"]
