"""A RunConfig checked against every part it names, before any worker starts (the defaults it
implies, its dataflow and device mapping, are in ``dataflow/defaults.py``).

``load_config(path_or_preset, ["actor.lr=1e-4", ...])`` returns a validated RunConfig; every
mistake (unknown key, wrong type, impossible size, an unknown stage, estimator, loss, task or
reward function, a mapping that cannot run) is a ConfigError that names the key and what is
allowed. The config package below it is a leaf; the registries it asks (stages, algorithms,
mappings, tasks, rewards) do not import this module.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import yaml

from hybridlab.algos import ADV_ESTIMATORS, AGG_MODES, KL_PENALTIES, POLICY_LOSSES
from hybridlab.algos.advantages import ADV_INPUTS
from hybridlab.algos.preference import PREFERENCE_LOSSES, check_preference_settings
from hybridlab.algos.rollout_correction import IS_LEVELS, parse_is_threshold, parse_rs
from hybridlab.backend_checks import backend_problems
from hybridlab.config import ConfigError, RunConfig, config_with, resolve_config_path
from hybridlab.controller.mapping import DeviceMapping
from hybridlab.dataflow.agent_stages import agent_problems, agentic
from hybridlab.dataflow.defaults import EVAL_ROLES, dataflow_names, default_mapping, roles_needed
from hybridlab.dataflow.graph import Dataflow
from hybridlab.dataflow.pairs import step_inputs
from hybridlab.dataflow.prompts import data_files, has_test_prompts
from hybridlab.dataflow.stages import STAGES
from hybridlab.errors import UserError
from hybridlab.models.chat import template_file
from hybridlab.models.spec import ModelSpec
from hybridlab.models.zoo import CONVERTED, parse_preset
from hybridlab.sandbox.runner import sandbox_problems
from hybridlab.scorers import MATH_VERIFIERS, gsm8k
from hybridlab.tasks import Task, get_task
from hybridlab.telemetry.trackers import logger_problems
from hybridlab.verl import Translation, is_verl, verl_config
from hybridlab.workers.reward.scoring import load_function
from hybridlab.workers.rollout.worker import BACKENDS
from hybridlab.workers.train.backend import STRATEGIES


def _choice(problems: list[str], key: str, value, allowed) -> None:
    if value not in allowed:
        problems.append(f"{key}: {value!r} is not one of {', '.join(map(str, allowed))}")


def _setting(cfg: RunConfig, key: str):
    """Return the value of the dotted ``key`` of ``cfg``."""
    return functools.reduce(getattr, key.split("."), cfg)


def _positive(problems: list[str], cfg: RunConfig, *keys: str) -> None:
    for key in keys:
        if not (value := _setting(cfg, key)) > 0:
            problems.append(f"{key}: must be positive, got {value}")


def _at_least(problems: list[str], cfg: RunConfig, low, *keys: str) -> None:
    for key in keys:
        if (value := _setting(cfg, key)) < low:
            problems.append(f"{key}: must be at least {low}, got {value!r}")


def validate_config(cfg: RunConfig) -> None:
    """Raise ConfigError listing every problem of ``cfg``, each naming its key."""
    p = [*_rollout_problems(cfg), *_algorithm_problems(cfg), *_actor_problems(cfg), *_correction_problems(cfg),
         *_size_problems(cfg), *_warm_start_problems(cfg), *_trainer_problems(cfg), *_reward_problems(cfg),
         *_dpo_problems(cfg), *sandbox_problems(cfg.sandbox)]
    _check_data_and_model(cfg, p)
    if not any(x.startswith("algorithm.adv_estimator:") for x in p):  # the stages' inputs follow the estimator
        p += _dataflow_and_mapping_problems(cfg)
    if p:
        raise ConfigError("config is invalid:\n  - " + "\n  - ".join(p))


def _rollout_problems(cfg: RunConfig) -> list[str]:
    p: list[str] = []
    r = cfg.rollout
    _choice(p, "rollout.backend", r.backend, BACKENDS)
    _choice(p, "rollout.dtype", r.dtype, ("float32", "bfloat16"))
    if r.prefix_caching and r.backend != "vllm":
        p.append(f"rollout.prefix_caching: needs rollout.backend=vllm (the {r.backend} backend has no prefix cache)")
    _at_least(p, cfg, 1, "rollout.n", "rollout.max_new_tokens")
    _at_least(p, cfg, 0, "rollout.temperature", "rollout.top_k")
    if not 0 < r.top_p <= 1:
        p.append(f"rollout.top_p: must be in (0, 1], got {r.top_p}")
    _at_least(p, cfg, 1, "evaluation.n")
    _at_least(p, cfg, 0, "evaluation.temperature", "evaluation.top_k")
    if not 0 < cfg.evaluation.top_p <= 1:
        p.append(f"evaluation.top_p: must be in (0, 1], got {cfg.evaluation.top_p}")
    return p


def _algorithm_problems(cfg: RunConfig) -> list[str]:
    p: list[str] = []
    algo, r = cfg.algorithm, cfg.rollout
    _choice(p, "algorithm.adv_estimator", algo.adv_estimator, sorted(ADV_ESTIMATORS))
    if "uid" in ADV_INPUTS.get(algo.adv_estimator, ()) and r.n < 2:  # it compares samples within a group
        p.append(f"rollout.n: {algo.adv_estimator} compares samples within a group, so the group size must be at"
                 f" least 2, got {r.n}")
    _choice(p, "algorithm.kl_penalty", algo.kl_penalty, KL_PENALTIES)
    _choice(p, "algorithm.kl_ctrl.type", algo.kl_ctrl.type, ("fixed", "adaptive"))
    keys, weights = algo.gdpo_reward_keys, algo.gdpo_reward_weights
    if keys is not None and (not keys or not all(isinstance(k, str) for k in keys)):
        p.append(f"algorithm.gdpo_reward_keys: a list of reward component names, got {keys!r}")
    if weights is not None and (keys is None or len(weights) != len(keys)):
        p.append(f"algorithm.gdpo_reward_weights: one weight per algorithm.gdpo_reward_keys entry ({keys!r}),"
                 f" got {weights!r}")
    if algo.overlong_buffer.enable and not 0 < algo.overlong_buffer.len <= r.max_new_tokens:
        p.append(f"algorithm.overlong_buffer.len: must be in 1..rollout.max_new_tokens ({r.max_new_tokens}),"
                 f" got {algo.overlong_buffer.len}")
    return p


def _actor_problems(cfg: RunConfig) -> list[str]:
    p: list[str] = []
    a = cfg.actor
    _choice(p, "actor.precision", a.precision, ("fp32", "bf16"))
    _choice(p, "critic.precision", cfg.critic.precision, ("fp32", "bf16"))
    _choice(p, "actor.strategy", a.strategy, STRATEGIES)
    _choice(p, "critic.strategy", cfg.critic.strategy, STRATEGIES)
    _choice(p, "actor.kl_loss_type", a.kl_loss_type, KL_PENALTIES)
    _choice(p, "actor.loss_agg_mode", a.loss_agg_mode, AGG_MODES)
    _choice(p, "critic.loss_agg_mode", cfg.critic.loss_agg_mode, AGG_MODES)
    if a.policy_loss == "dro" and not (a.dro_beta or 0) > 0:
        p.append(f"actor.dro_beta: the dro policy loss needs a positive dro_beta, got {a.dro_beta}")
    _positive(p, cfg, "actor.tau_pos", "actor.tau_neg", "actor.clip_cov_ratio", "actor.kl_cov_ratio")
    if a.loss_scale_factor is not None and not a.loss_scale_factor > 0:
        p.append(f"actor.loss_scale_factor: must be a positive number (or null: the padded response length),"
                 f" got {a.loss_scale_factor}")
    _choice(p, "actor.policy_loss", a.policy_loss, sorted(POLICY_LOSSES))
    if a.clip_ratio_c <= 1:
        p.append(f"actor.clip_ratio_c: the dual-clip bound must be greater than 1, got {a.clip_ratio_c}")
    return p


def _size_problems(cfg: RunConfig) -> list[str]:
    p: list[str] = []
    data = cfg.data
    _at_least(p, cfg, 1, "data.prompts_per_step", "trainer.steps",
              "trainer.devices", "actor.ppo_epochs", "actor.ppo_mini_batch_size", "actor.micro_batch_size",
              "critic.ppo_mini_batch_size", "critic.micro_batch_size")
    _at_least(p, cfg, 0, "actor.micro_batch_tokens", "critic.micro_batch_tokens", "data.train_samples",
              "data.test_samples")
    for split in ("train", "test"):  # 0 means every row of the files; a task's generator needs a count
        if not getattr(data, f"{split}_samples") and not data.train_files:
            p.append(f"data.{split}_samples: 0 (every row) needs data.train_files; a task makes as many as asked")
    names = dataflow_names(cfg)
    uses_critic = any(n in ("values", "update_critic") for n in names)
    mini_batched = ("actor",) if "update_actor" in names else ()  # DPO updates on the whole batch
    for section in (*mini_batched, "critic") if uses_critic else mini_batched:
        mini = getattr(cfg, section).ppo_mini_batch_size
        if mini >= 1 and data.prompts_per_step % mini:
            p.append(f"{section}.ppo_mini_batch_size: {mini} prompts does not divide data.prompts_per_step"
                     f" ({data.prompts_per_step})")
    return p


def _warm_start_problems(cfg: RunConfig) -> list[str]:
    p: list[str] = []
    ws = cfg.warm_start
    _at_least(p, cfg, 0, "warm_start.max_steps", "warm_start.warmup_steps")
    _at_least(p, cfg, 1, "warm_start.eval_every", "warm_start.eval_samples", "warm_start.batch_size")
    if not 0 < ws.target_accuracy <= 1:
        p.append(f"warm_start.target_accuracy: must be in (0, 1], got {ws.target_accuracy}")
    _positive(p, cfg, "warm_start.lr")
    return p


def _dpo_problems(cfg: RunConfig) -> list[str]:
    d = cfg.dpo
    if cfg.data.preferences and d.online:
        return ["dpo.online: online DPO pairs the policy's own samples, but data.preferences reads the pairs from"
                " the data; turn one of them off"]
    if "pair_best_worst" in dataflow_names(cfg) and cfg.rollout.n < 2:
        return [f"rollout.n: pair_best_worst pairs a prompt's best sample with its worst, so it needs at least 2"
                f" samples per prompt, got {cfg.rollout.n}"]
    unknown_types = [t for t in d.loss_types if t not in PREFERENCE_LOSSES]
    if unknown_types:
        return [f"dpo.loss_type: {unknown_types[0]!r} is not one of {', '.join(PREFERENCE_LOSSES)}"]
    return check_preference_settings(d.loss_types, d.loss_weights, d.label_smoothing, d.beta)


def _trainer_problems(cfg: RunConfig) -> list[str]:
    p: list[str] = []
    _at_least(p, cfg, 1, "trainer.max_staleness")
    _at_least(p, cfg, 0, "trainer.eval_every", "trainer.save_every", "trainer.max_restarts", "trainer.spare_processes",
              "trainer.call_deadline_s")
    _at_least(p, cfg, 1, "trainer.keep_checkpoints", "trainer.max_bad_updates")
    _positive(p, cfg, "trainer.call_deadline_floor_s")
    _at_least(p, cfg, 0, "trainer.max_minutes", "trainer.critic_warmup")
    p.extend(logger_problems(cfg.trainer.logger))
    return p


def _reward_problems(cfg: RunConfig) -> list[str]:
    p: list[str] = []
    reward = cfg.reward
    _choice(p, "reward.kind", reward.kind, ("rule", "function", "model"))
    _choice(p, "reward.gsm8k_extraction", reward.gsm8k_extraction, gsm8k.METHODS)
    _choice(p, "reward.math_verifier", reward.math_verifier, MATH_VERIFIERS)
    if reward.timeout_s < 0:
        p.append(f"reward.timeout_s: must be 0 (no limit) or a positive number of seconds, got {reward.timeout_s}")
    if reward.kind == "function" and not reward.function:
        p.append("reward.function: reward.kind is 'function', so give an import path like mypkg.rewards:score")
    elif reward.kind == "function":  # import it now: a bad path or signature fails before any worker starts
        try:
            load_function(reward.function, reward.function_kwargs)
        except UserError as exc:
            p.append(str(exc))
    if reward.kind == "model" and not reward.model:
        p.append("reward.model: reward.kind is 'model', so give a reward-model checkpoint directory")
    return p


def _dataflow_and_mapping_problems(cfg: RunConfig) -> list[str]:
    p: list[str] = []
    names = dataflow_names(cfg)
    bad = [n for n in names if n not in STAGES]
    if bad:
        return [f"dataflow: unknown stage(s) {', '.join(map(str, bad))}; stages are: {', '.join(sorted(STAGES))}"]
    try:
        mapping = DeviceMapping.from_dict(cfg.mapping or default_mapping(cfg, names))
        p += [f"mapping.{x}" if not x.startswith(("too few", "colocate")) else f"mapping: {x}"
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
        if rollout is not None and rollout.tp > 1 and cfg.rollout.backend != "vllm":
            p.append(f"mapping.roles.rollout.tp: tp={rollout.tp} needs rollout.backend=vllm (the"
                     f" {cfg.rollout.backend!r} backend runs a whole model per device); use dp for replicas")
    except ConfigError:
        raise
    except Exception as exc:  # MappingError: malformed mapping
        p.append(f"mapping: {exc}")
    first = "generate_agent" if agentic(cfg) else "generate"
    if cfg.trainer.off_policy and names[0] != first:
        p.append(f"trainer.off_policy: the dataflow must start with {first!r} to overlap the next rollout")
    return p


def _correction_problems(cfg: RunConfig) -> list[str]:
    c, out, where = cfg.algorithm.rollout_correction, [], "algorithm.rollout_correction"
    if c.rollout_is is not None and c.rollout_is not in IS_LEVELS:
        out.append(f"{where}.rollout_is: {c.rollout_is!r} is not one of {', '.join(IS_LEVELS)} (or null: off)")
    checks = []
    if c.rollout_is is not None:
        checks.append(("rollout_is_threshold", lambda: parse_is_threshold(c.rollout_is_threshold)))
    if c.rollout_rs is not None:
        checks.append(("rollout_rs", lambda: parse_rs(c.rollout_rs, c.rollout_rs_threshold)))
    for key, check in checks:
        try:
            check()
        except (TypeError, ValueError) as exc:
            out.append(f"{where}.{key}: {exc}")
    if c.loss_type not in ("ppo_clip", "reinforce"):
        out.append(f"{where}.loss_type: {c.loss_type!r} is not one of ppo_clip, reinforce")
    if c.bypass_mode and cfg.actor.policy_loss not in ("vanilla", "bypass_mode"):
        out.append(f"{where}.bypass_mode: bypass mode runs its own loss (ppo_clip or reinforce, by loss_type), so"
                   f" actor.policy_loss must be vanilla or bypass_mode, got {cfg.actor.policy_loss!r}")
    if cfg.actor.policy_loss == "bypass_mode" and not c.bypass_mode:
        out.append(f"actor.policy_loss: bypass_mode needs {where}.bypass_mode=true (the rollout's log-probs stand in"
                   f" for the old ones)")
    return out


def _dp_problems(cfg: RunConfig, mapping, names: list[str]) -> list[str]:
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


def _check_data_and_model(cfg: RunConfig, p: list[str]) -> None:
    try:
        if not Path(cfg.model).is_dir():
            arch = parse_preset(cfg.model)[1]
            for section in ("actor", "critic"):
                if arch not in CONVERTED and getattr(cfg, section).strategy == "megatron":
                    p.append(f"{section}.strategy: the zoo's {arch} models have no Megatron conversion; use auto or"
                             " fsdp2")
        elif not (Path(cfg.model) / "config.json").is_file():
            p.append(f"model: {cfg.model} is not a Hugging Face checkpoint directory (no config.json)")
        elif not ModelSpec.read(cfg.model).converted:  # raises if transformers cannot build it
            for section in ("actor", "critic"):  # megatron asked for: name what it cannot reproduce
                if getattr(cfg, section).strategy == "megatron":
                    try:
                        ModelSpec.from_hf(cfg.model)
                    except UserError as exc:
                        raise UserError(f"{exc} ({section}.strategy=megatron; auto or fsdp2 trains it with"
                                        " FSDP2)") from None
    except UserError as exc:
        p.append(f"model: {exc}")
    if cfg.data.chat_template:
        try:
            template_file(cfg.data.chat_template)
        except UserError as exc:
            p.append(str(exc))
    if cfg.reward.model and not Path(cfg.reward.model).is_dir():
        p.append(f"reward.model: no checkpoint directory {cfg.reward.model!r}")
    for key in ("train_files", "test_files"):
        try:
            files = data_files(getattr(cfg.data, key), f"data.{key}")
        except UserError as exc:
            p.append(str(exc))
            continue
        p.extend(f"data.{key}: no file {path!r}" for path in files if not Path(path).is_file())
        if key == "train_files" and cfg.data.preferences and len(files) > 1:
            p.append("data.train_files: preference pairs are read from one file")
    if not cfg.data.train_files:
        try:
            task = get_task(cfg.data.task, **cfg.data.task_options)
            if cfg.data.preferences and type(task).wrong_answer is Task.wrong_answer:
                p.append(f"data.task: task {cfg.data.task!r} has no wrong_answer, so it cannot make preference pairs;"
                         " give them in data.train_files (TRL's columns)")
        except UserError as exc:
            p.append(f"data.task: {exc}")
    if cfg.warm_start.max_steps and cfg.data.train_files:
        p.append("warm_start.max_steps: the supervised warm start needs a task's worked answers; set it to 0 with"
                 " data.train_files")


def _model_config(cfg: RunConfig) -> dict | None:
    """The model's config.json when it is a directory (zoo presets pass the head checks by design)."""
    path = Path(cfg.model) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else None


def load_config(source: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Return the validated RunConfig from a YAML file or preset name (None: the defaults) plus
    ``key=value`` overrides (a verl run's settings when they name ``actor_rollout_ref``)."""
    return load_run(source, overrides)[0]


def load_run(source: str | Path | None = None, overrides: list[str] | None = None,
             verl: bool = False) -> tuple[RunConfig, "Translation | None"]:
    """Return the validated RunConfig and, for a verl run's settings (``verl``, or keys under
    ``actor_rollout_ref``), what they became; every config error surfaces here, before work."""
    overrides = list(overrides or [])
    if verl or is_verl(overrides):
        if source is not None:
            raise ConfigError(f"a verl run is read from its key=value settings, as verl's main_ppo takes them; give no"
                              f" hybridlab config ({str(source)!r})")
        cfg, translation = verl_config(overrides)
        validate_config(cfg)
        return cfg, translation
    data: dict = {}
    if source is not None:
        path = resolve_config_path(source)
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    cfg = config_with(data, overrides)
    validate_config(cfg)
    return cfg, None
