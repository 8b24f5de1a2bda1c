"""Whether a device mapping can run a config here: a mapping from what a user gives (a
DeviceMapping, a dict, YAML text) and every reason it cannot run (the config's own checks with
the running model, and the devices against the cluster). Remaps, the mapping editor and the
advisor's plans all ask here."""
from __future__ import annotations

import dataclasses

import yaml

from hybridlab.config import ConfigError, RunConfig
from hybridlab.controller.mapping import DeviceMapping, MappingError
from hybridlab.run_config import validate_config


def parse_mapping(value: DeviceMapping | dict | str) -> DeviceMapping:
    """Return a DeviceMapping from a DeviceMapping, a dict or YAML text; MappingError names what is wrong."""
    if isinstance(value, DeviceMapping):
        return value
    if isinstance(value, str):
        try:
            return DeviceMapping.from_yaml(value)  # text or a file path; duplicate keys are errors
        except yaml.YAMLError as exc:
            raise MappingError(f"mapping: not valid YAML: {exc}") from None
    return DeviceMapping.from_dict(value)  # names anything that is not a mapping


def remap_problems(cfg: RunConfig, mapping: DeviceMapping, cluster_gpus: float, model_dir: str | None = None) -> list[str]:
    """Return every reason ``mapping`` cannot run ``cfg``'s dataflow here (empty when it can):
    the config's own checks with the running model (``model_dir``: its heads and layers against
    the layouts) and the mapping, and the devices against the cluster."""
    checked = dataclasses.replace(cfg, mapping=mapping.to_dict(), **({"model": model_dir} if model_dir else {}))
    try:
        validate_config(checked)
        problems = []
    except ConfigError as exc:
        problems = [line.strip()[2:] for line in str(exc).splitlines()[1:]] or [str(exc)]
    need = sum(p.devices for p in mapping.pools.values())
    if need > cluster_gpus:
        problems.append(f"mapping: the pools need {need} devices, the cluster has {cluster_gpus:g}")
    return problems
