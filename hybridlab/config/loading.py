"""How YAML and ``key=value`` overrides become a RunConfig (``build``, ``apply_override``):
unknown keys and wrong types are ConfigErrors naming the key; verl's spellings of the policy
loss's keys are accepted."""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from hybridlab.config.schema import CONFIG_DIR, RunConfig
from hybridlab.config.setting import ConfigError


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


def _coerce(value: Any, tp, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, args[0], where)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, where)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):  # YAML reads 1e-4 (no dot) as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if tp is float and isinstance(value, float) and math.isnan(value):  # YAML's .nan, or "nan"
        raise ConfigError(f"{where}: expected a number, got nan")
    check = origin or tp
    if check is bool and not isinstance(value, bool) or check is not bool and isinstance(value, bool) \
            or not isinstance(value, check):
        raise ConfigError(f"{where}: expected {_type_name(check)}, got {value!r} ({type(value).__name__})")
    return value


def verl_key(key: str) -> str:
    """Return hybridlab's key for a verl-style one: verl nests the loss's settings in a section,
    ``actor.policy_loss.loss_mode`` (hybridlab: ``actor.policy_loss``), ``actor.policy_loss.<k>``
    (``actor.<k>``) and ``actor.policy_loss.rollout_correction.<k>`` (where verl's trainer copies
    it from: ``algorithm.rollout_correction.<k>``); other keys are returned unchanged."""
    prefix = "actor.policy_loss."
    if not key.startswith(prefix):
        return key
    rest = key[len(prefix):]
    if rest == "loss_mode":
        return "actor.policy_loss"
    return f"algorithm.{rest}" if rest.startswith("rollout_correction") else f"actor.{rest}"


def _flatten_policy_loss(data: dict) -> dict:
    """Move a verl-style ``actor.policy_loss`` section's keys to hybridlab's (``verl_key``)."""
    actor = data.get("actor")
    if not isinstance(actor, dict) or not isinstance(actor.get("policy_loss"), dict):
        return data
    data, actor = dict(data), dict(actor)
    section = actor.pop("policy_loss")
    data["actor"] = actor
    for key, value in section.items():
        target = verl_key(f"actor.policy_loss.{key}").split(".")
        node = data
        for part in target[:-1]:
            node[part] = dict(node.get(part) or {})
            node = node[part]
        node[target[-1]] = value
    return data


def build(cls, data: Any, where: str = ""):
    """Return ``cls`` built from the dict ``data``; unknown keys and wrong types are ConfigErrors."""
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping of keys, got {data!r}")
    if cls is RunConfig:
        data = _flatten_policy_loss(data)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    bad = [k for k in data if k not in fields]
    if bad:
        prefix = f"{where}." if where else ""
        raise ConfigError(f"unknown key {prefix}{bad[0]}; allowed keys{' in ' + where if where else ''}: "
                          f"{', '.join(fields)}")
    kwargs = {k: _coerce(v, hints[k], f"{where}.{k}" if where else k) for k, v in data.items()}
    return cls(**kwargs)


def apply_override(data: dict, pair: str) -> None:
    """Apply one ``dotted.key=value`` override (the value is parsed as YAML) to ``data`` in place."""
    if "=" not in pair:
        raise ConfigError(f"override {pair!r} must look like key=value, e.g. actor.lr=1e-4")
    key, raw = pair.split("=", 1)
    key = verl_key(key.strip())
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:  # text YAML cannot read (a Jinja chat template): a string, the field's type decides
        value = raw
    node, cls, parts = data, RunConfig, key.strip().split(".")
    for i, part in enumerate(parts):
        fields = {f.name: f for f in dataclasses.fields(cls)} if cls else {}
        if cls and part not in fields:
            where = ".".join(parts[:i]) or "the config"
            raise ConfigError(f"unknown key {'.'.join(parts[:i + 1])}; allowed keys in {where}: {', '.join(fields)}")
        if i == len(parts) - 1:
            node[part] = value
            return
        hint = typing.get_type_hints(cls)[part] if cls else None
        cls = hint if hint is not None and dataclasses.is_dataclass(hint) else None
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{'.'.join(parts[:i + 1])} is not a section; cannot set {key}")


def config_with(data: dict, overrides) -> RunConfig:
    """Return the RunConfig of ``data`` (a config's plain form, changed in place) with ``key=value``
    ``overrides`` applied; unvalidated: the checks across keys are ``run_config.validate_config``'s."""
    for pair in overrides:
        apply_override(data, pair)
    return build(RunConfig, data)


def resolve_config_path(source: str | Path) -> Path:
    """Return the YAML file for ``source``: a path, or a preset name from configs/."""
    path = Path(source)
    if path.is_file():
        return path
    preset = CONFIG_DIR / f"{source}.yaml"
    if preset.is_file():
        return preset
    presets = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")) if CONFIG_DIR.is_dir() else []
    raise ConfigError(f"no config file {str(source)!r}; give a YAML path or a preset: {', '.join(presets)}")
