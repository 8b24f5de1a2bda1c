"""One spec per role: how its workers are built from the run's config, and what a change of
each setting costs (a call on the running worker, or re-creating the role).

    ROLE_SPECS["actor"].settings(cfg)          # the worker's keyword arguments, from the config
    plan_update(old_cfg, new_cfg)              # what an ``update`` must do, or why it cannot

Everything that changes workers reads these specs: starting a session (``role_classes``), live
setting changes (``configure`` on the running workers), re-creating a role whose settings are
built in (with its weights and optimizer carried in memory, as a remap does), and refusals of
what cannot change without losing the run.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from hybridlab.config import ConfigError, RunConfig
from hybridlab.config.schema import config_fields, setting_keys
from hybridlab.controller.group import RoleClass
from hybridlab.models.spec import ModelSpec
from hybridlab.workers.train.settings import TrainSettings

# Settings that cannot change once the session exists, and why (declared in the schema).
FIXED = {key: f.metadata["why"] for key, f in config_fields() if f.metadata.get("change") == "fixed"}
# Settings that change the device mapping: applied by a remap.
MAPPING_KEYS = setting_keys("remap")


def _train_settings(section: str) -> Callable[[RunConfig], dict]:
    def settings(cfg: RunConfig) -> dict:
        return {"settings": TrainSettings.of(cfg, section)}
    return settings


@dataclasses.dataclass(frozen=True)
class RoleSpec:
    """How one role's workers are built and changed."""

    name: str
    worker: str                                   # "module:Class" of the worker
    settings: Callable[[RunConfig], dict]         # the worker's keyword arguments from the config
    live: tuple[str, ...] = ()                    # config keys the running worker takes (``configure``)
    recreate: tuple[str, ...] = ()                # config keys that re-create the role
    # (both as the schema declares them: ``hybridlab.config.setting.setting``)
    stateful: bool = False                        # weights and optimizer carried across re-creation
    layout: tuple[str, ...] = ()                  # what it takes from the mapping's role: "tp", "pp", "ep"
    reads_spec: bool = False                      # takes the checkpoint's ModelSpec (``spec``), read here

    def worker_class(self) -> type:
        """Return the worker class (imported on first use: workers pull in heavy engines)."""
        import importlib

        module, name = self.worker.split(":")
        return getattr(importlib.import_module(module), name)

    def role_class(self, cfg: RunConfig, layout, model_dir: str, spec: ModelSpec | None = None):
        """Return the RoleClass that constructs this role's workers for ``layout``; a role that
        ``reads_spec`` gets the checkpoint's ModelSpec (``spec``, else read here) rather than
        reading it in every process (where that would import transformers: about 1.4 s of CPU each)."""
        kwargs = {**self.settings(cfg), **{key: getattr(layout, key) for key in self.layout}}
        if self.reads_spec:
            kwargs["spec"] = spec if spec is not None else ModelSpec.read(model_dir)
        return RoleClass(self.worker_class(), (model_dir,), kwargs)


ROLE_SPECS: dict[str, RoleSpec] = {spec.name: spec for spec in (
    RoleSpec("actor", "hybridlab.workers.train.workers:ActorWorker", _train_settings("actor"),
             live=setting_keys("live", "actor"), stateful=True, recreate=setting_keys("recreate", "actor"),
             layout=("tp", "pp", "ep"), reads_spec=True),
    RoleSpec("ref", "hybridlab.workers.train.workers:RefWorker", _train_settings("actor"),
             live=setting_keys("live", "ref"), recreate=setting_keys("recreate", "ref"),
             layout=("tp", "pp", "ep"), reads_spec=True),
    RoleSpec("critic", "hybridlab.workers.train.workers:CriticWorker", _train_settings("critic"),
             live=setting_keys("live", "critic"), stateful=True, recreate=setting_keys("recreate", "critic"),
             layout=("tp", "pp", "ep"), reads_spec=True),
    RoleSpec("rollout", "hybridlab.workers.rollout.worker:RolloutWorker",
             lambda cfg: {"backend": cfg.rollout.backend, "kv_cache_mb": cfg.rollout.kv_cache_mb,
                          "seed": cfg.trainer.seed, "truncate_prompts": cfg.data.truncate_prompts,
                          "dtype": cfg.rollout.dtype, "prefix_caching": cfg.rollout.prefix_caching,
                          "lora_rank": cfg.actor.lora.rank if cfg.actor.lora.sync == "adapter" else 0,
                          "sandbox": cfg.sandbox},
             recreate=setting_keys("recreate", "rollout"), layout=("tp",)),
    RoleSpec("reward", "hybridlab.workers.reward.worker:RewardWorker",
             lambda cfg: {"kind": "rule" if cfg.reward.kind == "model" else cfg.reward.kind,
                          "function": cfg.reward.function, "function_kwargs": cfg.reward.function_kwargs,
                          "format_score": cfg.reward.format_score,
                          "error_score": cfg.reward.error_score, "timeout_s": cfg.reward.timeout_s,
                          "gsm8k_extraction": cfg.reward.gsm8k_extraction,
                          "math_verifier": cfg.reward.math_verifier, "sandbox": cfg.sandbox},
             recreate=setting_keys("recreate", "reward")),
)}


def role_classes(cfg: RunConfig, mapping, model_dir: str) -> dict:
    """Return ``{role: RoleClass}`` for every role of ``mapping`` (the checkpoint's spec read once)."""
    spec = ModelSpec.read(model_dir) if any(ROLE_SPECS[r].reads_spec for r in mapping.roles) else None
    return {role: ROLE_SPECS[role].role_class(cfg, layout, model_dir, spec) for role, layout in mapping.roles.items()}


def worker_classes() -> dict[str, type]:
    """Return ``{role: worker class}`` for every role there is (what a warm process can host)."""
    return {name: spec.worker_class() for name, spec in ROLE_SPECS.items()}


def _changed_keys(old: RunConfig, new: RunConfig) -> set[str]:
    """Return the dotted keys whose values differ (sections compared field by field)."""
    out: set[str] = set()

    def walk(a, b, prefix: str) -> None:
        if dataclasses.is_dataclass(a) and dataclasses.is_dataclass(b):
            for f in dataclasses.fields(a):
                walk(getattr(a, f.name), getattr(b, f.name), f"{prefix}{f.name}.")
        elif a != b:
            out.add(prefix.rstrip("."))

    walk(old, new, "")
    return out


@dataclasses.dataclass
class UpdatePlan:
    """What an ``update`` does to the workers: live calls per role, roles to re-create, a remap."""

    configure: dict[str, dict]        # role -> new worker settings, applied on the running workers
    recreate: set[str]                # roles re-created (state carried) for built-in settings
    remap: bool                       # the device mapping changes


def plan_update(old: RunConfig, new: RunConfig, roles) -> UpdatePlan:
    """Return what changing ``old`` to ``new`` does to the running ``roles``; raises ConfigError
    naming a fixed setting and why it cannot change."""
    changed = _changed_keys(old, new)
    for key in sorted(changed):
        fixed = next((f for f in FIXED if key == f or key.startswith(f + ".")), None)
        if fixed is not None:
            raise ConfigError(f"{key} cannot change in a running session: {FIXED[fixed]}")
    configure, recreate = {}, set()
    for role in roles:
        spec = ROLE_SPECS[role]
        if _touches(changed, spec.recreate):
            recreate.add(role)
        elif _touches(changed, spec.live):
            configure[role] = spec.settings(new)
    return UpdatePlan(configure, recreate, remap=_touches(changed, MAPPING_KEYS))


def _touches(changed: set[str], keys) -> bool:
    """True when a changed key is one of ``keys`` or inside one (a section such as actor.fsdp)."""
    return any(c == k or c.startswith(k + ".") for c in changed for k in keys)
