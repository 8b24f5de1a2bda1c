"""A RunConfig checked against every part it names, before any worker starts (the defaults it
implies, its dataflow and device mapping, are in ``dataflow/defaults.py``).

``load_config(path_or_preset, ["actor.lr=1e-4", ...])`` returns a validated RunConfig; every
mistake (unknown key, wrong type, impossible size, an unknown stage, estimator, loss, task or
reward function, a mapping that cannot run) is a ConfigError that names the key and what is
allowed. Each part checks its own section, in its own module (``validate_config`` lists them);
the config package below them is a leaf, and none of them imports this module.
"""
from __future__ import annotations

from pathlib import Path

import yaml

from hybridlab.algos.checks import algorithm_problems, correction_problems, loss_problems
from hybridlab.backend_checks import training_problems
from hybridlab.config import ConfigError, RunConfig, config_with, resolve_config_path
from hybridlab.config.bounds import bound_problems
from hybridlab.dataflow.config_checks import dataflow_problems
from hybridlab.dataflow.prompts import data_problems
from hybridlab.telemetry.trackers import logger_problems
from hybridlab.verl import Translation, is_verl, verl_config
from hybridlab.workers.reward.checks import reward_problems
from hybridlab.workers.rollout.checks import rollout_problems


def validate_config(cfg: RunConfig) -> None:
    """Raise ConfigError listing every problem of ``cfg``, each naming its key."""
    p = [*bound_problems(cfg), *rollout_problems(cfg), *algorithm_problems(cfg), *loss_problems(cfg),
         *correction_problems(cfg), *training_problems(cfg), *reward_problems(cfg), *data_problems(cfg),
         *logger_problems(cfg.trainer.logger)]
    if not any(x.startswith("algorithm.adv_estimator:") for x in p):  # the stages' inputs follow the estimator
        p += dataflow_problems(cfg)
    if p:
        raise ConfigError("config is invalid:\n  - " + "\n  - ".join(p))


def load_config(source: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Return the validated RunConfig from a YAML file or preset name (None: the defaults) plus
    ``key=value`` overrides (a verl run's settings when they name ``actor_rollout_ref``)."""
    return load_run(source, overrides)[0]


def load_run(source: str | Path | None = None, overrides: list[str] | None = None,
             verl: bool = False) -> tuple[RunConfig, "Translation | None"]:
    """Return the validated RunConfig and, for a verl run's settings (``verl``, or keys under
    ``actor_rollout_ref``), what they became; every config error surfaces here, before work."""
    overrides, translation = list(overrides or []), None
    if verl or is_verl(overrides):
        if source is not None:
            raise ConfigError(f"a verl run is read from its key=value settings, as verl's main_ppo takes them; give no"
                              f" hybridlab config ({str(source)!r})")
        cfg, translation = verl_config(overrides)
    else:
        cfg = config_with(_yaml_data(source), overrides)
    validate_config(cfg)
    return cfg, translation


def _yaml_data(source: str | Path | None) -> dict:
    """The plain form of a YAML config file or preset (None: empty, the defaults)."""
    if source is None:
        return {}
    path = resolve_config_path(source)
    try:
        return yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
