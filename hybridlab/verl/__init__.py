"""Coming from verl: a ``main_ppo`` run script's settings read as hybridlab's (``translate``), with
the table of every covered key (``keys``) and the devices placed as verl places them."""
from __future__ import annotations

from hybridlab.config import RunConfig
from hybridlab.dataflow.defaults import dataflow_names, default_mapping
from hybridlab.verl.translate import Translation, build_config, is_verl, translate

__all__ = ["Translation", "is_verl", "verl_config", "verl_mapping"]


def verl_mapping(cfg: RunConfig, layout: dict[str, int]) -> dict:
    """Return verl's placement: actor, rollout, ref, critic and reward in one pool of
    ``trainer.devices`` devices, sharing processes (the hybrid engine), the training roles with
    the actor's tp, pp and ep and the rollout with its own tp, each data parallel over the rest."""
    mapping = default_mapping(cfg, dataflow_names(cfg))
    devices = cfg.trainer.devices
    for role, spec in mapping["roles"].items():
        if role in ("actor", "ref", "critic"):
            spec.update(tp=layout["tp"], pp=layout["pp"], ep=layout["ep"],
                        dp=max(1, devices // (layout["tp"] * layout["pp"])))
        elif role == "rollout":
            spec.update(tp=layout["rollout_tp"], dp=max(1, devices // layout["rollout_tp"]))
    return mapping


def verl_config(pairs: list[str]) -> tuple[RunConfig, Translation]:
    """Return the (unvalidated) RunConfig of a verl run's ``key=value`` settings and what they
    became; an explicit hybridlab ``mapping`` wins over verl's placement."""
    translation = translate(pairs)
    cfg = build_config(translation)
    if cfg.mapping is None and any(v != 1 for v in translation.layout.values()):
        cfg.mapping = verl_mapping(cfg, translation.layout)
    return cfg, translation
