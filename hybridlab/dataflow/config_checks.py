"""The checks of a config's step: its stages and their inputs, the device mapping they run on,
and the batch sizes they split (over mini-batches, data-parallel ranks and preference pairs).
``dataflow_problems`` returns them, each naming its key; ``hybridlab.run_config.validate_config``
runs it with the rest, once the estimator (which decides the stages' inputs) is known.
"""
from __future__ import annotations

import json
from pathlib import Path

from hybridlab.algos.preference import PREFERENCE_LOSSES, check_preference_settings
from hybridlab.backend_checks import backend_problems
from hybridlab.config import ConfigError, RunConfig
from hybridlab.controller.mapping import DeviceMapping
from hybridlab.dataflow.agent_stages import agent_problems, agentic
from hybridlab.dataflow.defaults import EVAL_ROLES, dataflow_names, default_mapping, roles_needed
from hybridlab.dataflow.graph import Dataflow
from hybridlab.dataflow.pairs import step_inputs
from hybridlab.dataflow.prompts import has_test_prompts
from hybridlab.dataflow.stages import STAGES
from hybridlab.dataflow.stream import stream_problems


def dataflow_problems(cfg: RunConfig) -> list[str]:
    """Return the problems of the config's dataflow, mapping, batch sizes and DPO settings."""
    names = dataflow_names(cfg)
    bad = [n for n in names if n not in STAGES]
    if bad:
        return [f"dataflow: unknown stage(s) {', '.join(map(str, bad))}; stages are: {', '.join(sorted(STAGES))}"]
    p = [*_mini_batch_problems(cfg, names), *_dpo_problems(cfg, names)]
    try:
        p += _mapping_problems(cfg, names, DeviceMapping.from_dict(cfg.mapping or default_mapping(cfg, names)))
    except ConfigError:
        raise
    except Exception as exc:  # MappingError: malformed mapping
        p.append(f"mapping: {exc}")
    first = "generate_agent" if agentic(cfg) else "generate"
    if cfg.trainer.rollout_data_dir and (cfg.data.preferences or cfg.dpo.online):
        p.append("trainer.rollout_data_dir: writes the generated samples of RL steps, and a DPO step trains pairs"
                 " (data.preferences, dpo.online); unset it")
    for key in ("off_policy", "streaming"):
        if getattr(cfg.trainer, key) and names[0] != first:
            p.append(f"trainer.{key}: the dataflow must start with {first!r} to overlap the next rollout")
    return p


def _mapping_problems(cfg: RunConfig, names: list[str], mapping: DeviceMapping) -> list[str]:
    p = [f"mapping.{x}" if not x.startswith(("too few", "colocate")) else f"mapping: {x}"
         for x in mapping.problems(_model_config(cfg))]
    p += Dataflow(names).problems(cfg, mapping.roles, step_inputs(cfg))
    missing = [r for r in EVAL_ROLES if r not in mapping.roles and r not in roles_needed(names)]  # else named
    if has_test_prompts(cfg) and missing:
        p.append(f"mapping: the greedy evaluation of the test prompts generates on the rollout and scores on the"
                 f" reward role; add {' and '.join(missing)}")
    p += _dp_problems(cfg, mapping, names)
    p += backend_problems(cfg, mapping)
    rollout = mapping.roles.get("rollout")
    p += agent_problems(cfg, rollout.tp if rollout is not None else 1)
    p += stream_problems(cfg, mapping)
    if rollout is not None and rollout.tp > 1 and cfg.rollout.backend != "vllm":
        p.append(f"mapping.roles.rollout.tp: tp={rollout.tp} needs rollout.backend=vllm (the"
                 f" {cfg.rollout.backend!r} backend runs a whole model per device); use dp for replicas")
    return p


def _mini_batch_problems(cfg: RunConfig, names: list[str]) -> list[str]:
    uses_critic = any(n in ("values", "update_critic") for n in names)
    mini_batched = ("actor",) if "update_actor" in names else ()  # DPO updates on the whole batch
    out = []
    for section in (*mini_batched, "critic") if uses_critic else mini_batched:
        mini, prompts = getattr(cfg, section).ppo_mini_batch_size, cfg.data.prompts_per_step
        if mini >= 1 and prompts % mini:
            out.append(f"{section}.ppo_mini_batch_size: {mini} prompts does not divide data.prompts_per_step"
                       f" ({prompts})")
    return out


def _dpo_problems(cfg: RunConfig, names: list[str]) -> list[str]:
    d = cfg.dpo
    if cfg.data.preferences and d.online:
        return ["dpo.online: online DPO pairs the policy's own samples, but data.preferences reads the pairs from"
                " the data; turn one of them off"]
    if "pair_best_worst" in names and cfg.rollout.n < 2:
        return [f"rollout.n: pair_best_worst pairs a prompt's best sample with its worst, so it needs at least 2"
                f" samples per prompt, got {cfg.rollout.n}"]
    unknown_types = [t for t in d.loss_types if t not in PREFERENCE_LOSSES]
    if unknown_types:
        return [f"dpo.loss_type: {unknown_types[0]!r} is not one of {', '.join(PREFERENCE_LOSSES)}"]
    return check_preference_settings(d.loss_types, d.loss_weights, d.label_smoothing, d.beta)


def _dp_problems(cfg: RunConfig, mapping: DeviceMapping, names: list[str]) -> list[str]:
    out = []
    n = cfg.rollout.n
    actor = mapping.roles.get("actor")
    if cfg.data.preferences and actor is not None and cfg.data.prompts_per_step % actor.dp:
        out.append(f"data.prompts_per_step: {cfg.data.prompts_per_step} preference pairs per step do not split over"
                   f" the actor's data-parallel size {actor.dp} (each rank takes whole pairs, as many as the others)")
    for role, section, stage in (("actor", cfg.actor, "update_actor"), ("critic", cfg.critic, "update_critic")):
        layout = mapping.roles.get(role)
        if layout is None or stage not in names:  # mini-batches are the update stage's (DPO's takes the batch whole)
            continue
        rows = section.ppo_mini_batch_size * n
        if rows % layout.dp:
            out.append(f"{role}.ppo_mini_batch_size: {section.ppo_mini_batch_size} prompts x rollout.n {n} = {rows}"
                       f" sequences per update is not divisible by the {role}'s data-parallel size {layout.dp}")
    return out


def _model_config(cfg: RunConfig) -> dict | None:
    """The model's config.json when it is a directory (zoo presets pass the head checks by design)."""
    path = Path(cfg.model) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else None
