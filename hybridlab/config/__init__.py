"""The run configuration: the schema (``schema.py``, nested dataclasses with verl's key names),
how YAML and overrides become one (``loading.py``) and the checks across keys (``checks.py``);
``load_config`` gives a RunConfig that passed them all.

``load_config(path_or_preset, ["actor.lr=1e-4", ...])`` returns a validated RunConfig; every
mistake (unknown key, wrong type, impossible size) is a ConfigError that names the key and
what is allowed, raised before any worker starts.
"""
from __future__ import annotations

from pathlib import Path

import yaml

from hybridlab.config.checks import (dataflow_names, default_dataflow, default_mapping, roles_needed,
                                     validate_config)
from hybridlab.config.loading import apply_override, build, resolve_config_path
from hybridlab.config.schema import (CONFIG_DIR, ActorConfig, AlgorithmConfig, ConfigError, CriticConfig,
                                     DataConfig, RewardConfig, RolloutConfig, RunConfig, TrainerConfig,
                                     WarmStartConfig)

__all__ = ["CONFIG_DIR", "ActorConfig", "AlgorithmConfig", "ConfigError", "CriticConfig", "DataConfig",
           "RewardConfig", "RolloutConfig", "RunConfig", "TrainerConfig", "WarmStartConfig", "apply_override",
           "build", "dataflow_names", "default_dataflow", "default_mapping", "load_config", "resolve_config_path",
           "roles_needed", "validate_config"]


def load_config(source: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Return the validated RunConfig from a YAML file or preset name (None: the defaults) plus
    ``key=value`` overrides."""
    data: dict = {}
    if source is not None:
        path = resolve_config_path(source)
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    for pair in overrides or []:
        apply_override(data, pair)
    cfg = build(RunConfig, data)
    validate_config(cfg)
    return cfg
