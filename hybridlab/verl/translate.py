"""A verl run script's ``key=value`` settings as hybridlab's: verl's defaults for what the script
leaves unset, each key translated, noted or refused by ``keys.KEYS``, then the keys that decide
a setting together (devices, micro-batch token budgets, warm-up, steps, layouts, rewards).

A config is read the verl way when its settings name ``actor_rollout_ref`` (every ``main_ppo``
script sets its model there) or when asked (``hybridlab train --verl``). hybridlab's own keys
may follow (``mapping=...``, ``warm_start.max_steps=...``): an explicit hybridlab setting wins.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
from pathlib import Path
from typing import Any

import yaml

from hybridlab.config import ConfigError, RunConfig, config_with
from hybridlab.config.schema import config_fields
from hybridlab.verl.keys import AR, BY_KEY, A, Key, R, lookup

# verl 0.9.1's defaults (verl/trainer/config/_generated_ppo_trainer.yaml) where hybridlab's differ,
# by hybridlab key, with the verl key that sets each
VERL_DEFAULTS: dict[str, tuple[Any, str]] = {
    "warm_start.max_steps": (0, "(verl has no supervised warm start)"),
    "actor.lr": (1e-6, A + "optim.lr"),
    "actor.weight_decay": (0.01, A + "optim.weight_decay"),
    "actor.warmup_steps": (0, A + "optim.lr_warmup_steps"),
    "actor.ppo_mini_batch_size": (256, A + "ppo_mini_batch_size"),
    "actor.micro_batch_tokens": (0, A + "use_dynamic_bsz"),
    "actor.use_rollout_log_probs": (False, "(verl recomputes the old log-probs with the actor)"),
    "critic.lr": (1e-5, "critic.optim.lr"),
    "critic.weight_decay": (0.01, "critic.optim.weight_decay"),
    "critic.micro_batch_tokens": (0, "critic.use_dynamic_bsz"),
    "algorithm.adv_estimator": ("gae", "algorithm.adv_estimator"),
    "data.prompts_per_step": (1024, "data.train_batch_size"),
    "data.train_samples": (0, "(verl reads every row)"),
    "data.test_samples": (0, "(verl reads every row)"),
    "rollout.n": (1, R + "n"),
    "rollout.max_new_tokens": (512, "data.max_response_length"),
    "trainer.eval_every": (0, "trainer.test_freq"),
    "trainer.save_every": (0, "trainer.save_freq"),
    "trainer.max_minutes": (0.0, "(verl has no time limit)"),
    "trainer.logger": (["console", "wandb"], "trainer.logger"),
    "trainer.project_name": ("verl_examples", "trainer.project_name"),
    "name": ("gsm8k", "trainer.experiment_name"),
    "trainer.verl_names": (True, "(metrics also under verl's names)"),
    "trainer.run_dir": (None, "trainer.default_local_dir"),  # checkpoints/PROJECT/EXPERIMENT, set below
}
# verl's defaults of the keys that decide a setting together, with the hybridlab setting each decides
VERL_JOINT_DEFAULTS: dict[str, tuple[Any, str]] = {
    "trainer.total_epochs": (30, "trainer.steps"), "trainer.n_gpus_per_node": (8, "trainer.devices"),
    "trainer.nnodes": (1, "trainer.devices"), A + "ppo_max_token_len_per_gpu": (16384, "actor.micro_batch_tokens"),
    "critic.ppo_max_token_len_per_gpu": (32768, "critic.micro_batch_tokens"),
    R + "tensor_model_parallel_size": (2, "mapping"), "trainer.resume_mode": ("auto", "resume")}
MANAGERS = ("naive", "dapo", "gdpo")


@dataclasses.dataclass
class Translation:
    """What a verl run's settings became."""
    settings: dict[str, Any]                 # hybridlab key -> value: verl's defaults, the translation, own keys
    defaults: list[str]                      # one line per verl default that applied (explain prints them)
    noted: dict[str, str]                    # verl key -> why it changes nothing here
    own: dict[str, Any]                      # hybridlab's own keys among the settings (they win)
    layout: dict[str, int]                   # actor tp, pp, ep and rollout_tp, for the default mapping
    resume: str = "auto"                     # trainer.resume_mode
    resume_from: str | None = None           # trainer.resume_from_path (resume_mode=resume_path)

    def overrides(self) -> list[str]:
        """Return the settings as hybridlab ``key=value`` overrides (JSON values; a date read from
        YAML as its text)."""
        return [f"{k}={json.dumps(v, default=str)}" for k, v in self.settings.items()]

    def ignored_line(self) -> str:
        """Return the one line listing the accepted verl settings that change nothing here, with why."""
        if not self.noted:
            return ""
        return "ignored verl settings: " + "; ".join(f"{k} ({why})" for k, why in self.noted.items())

    def report(self) -> str:
        """Return what a verl run's settings became, for the start of a run and ``explain``: the
        ignored line and one line per verl default that applied."""
        lines = ["Read as verl's main_ppo settings (docs/verl.md).", *([self.ignored_line()] if self.noted else []),
                 "verl's defaults that applied (the settings left unset):"]
        return "\n".join(lines + [f"  {line}" for line in self.defaults])


def is_verl(pairs: list[str]) -> bool:
    """True when the settings name verl's ``actor_rollout_ref`` section."""
    return any(_key(p).startswith(AR) for p in pairs)


def _key(pair: str) -> str:
    return pair.split("=", 1)[0].strip().lstrip("+~")


def parse_pairs(pairs: list[str]) -> dict[str, Any]:
    """Return ``{key: value}`` from Hydra-style ``key=value`` pairs (``+key`` and ``++key`` too;
    the value read as YAML, so ``'["console","wandb"]'`` is a list); raises ConfigError naming a
    malformed pair."""
    out = {}
    for pair in pairs:
        if "=" not in pair or pair.lstrip().startswith("~"):
            raise ConfigError(f"verl setting {pair!r} must look like key=value (Hydra's ~key deletion is not supported)")
        raw_key, raw = pair.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        out[raw_key.strip().lstrip("+")] = value
    return out


def _hybridlab_keys() -> set[str]:
    return {key for key, _ in config_fields()}


def check(values: dict[str, Any]) -> tuple[dict[str, Key], list[str]]:
    """Return the verl keys' table entries and hybridlab's own keys among ``values``; raises
    ConfigError naming an unknown key (with the closest covered ones) or a refused value."""
    known, own, hybridlab = {}, [], _hybridlab_keys()
    for key, value in values.items():
        entry = lookup(key)
        if entry is None:
            if key in hybridlab or key.split(".")[0] == "mapping":
                own.append(key)
                continue
            close = difflib.get_close_matches(key, list(BY_KEY), n=3, cutoff=0.6)
            raise ConfigError(f"unknown verl key {key}: hybridlab does not cover it"
                              + (f" (close: {', '.join(close)})" if close else "")
                              + "; the covered keys and what each becomes: docs/verl.md")
        why = entry.refuse(value) if entry.refuse else ""
        if why:
            raise ConfigError(f"{key}={value!r} is refused: {why}")
        known[key] = entry
    return known, own


def translate(pairs: list[str]) -> Translation:
    """Return hybridlab's settings for a verl run's ``key=value`` pairs; raises ConfigError for an
    unknown key, a refused value or settings that contradict each other, before any work."""
    values = parse_pairs(pairs)
    known, own_keys = check(values)
    own = {key: values[key] for key in own_keys}
    settings = {key: value for key, (value, _) in VERL_DEFAULTS.items()}
    for key, entry in known.items():
        if entry.to and not entry.joint and not entry.note:
            settings[entry.to] = entry.convert(values[key]) if entry.convert else values[key]
    settings.update(own)  # hybridlab's own keys win, also over what the joint rules compute from them
    get = {**{key: value for key, (value, _) in VERL_JOINT_DEFAULTS.items()}, **values}.get
    layout = _joint_settings(get, settings, own)
    settings.update(own)
    noted = {key: entry.note for key, entry in known.items() if entry.note and not entry.joint}
    resume, resume_from = get("trainer.resume_mode"), get("trainer.resume_from_path")
    if resume == "resume_path" and not resume_from:
        raise ConfigError("trainer.resume_mode=resume_path needs trainer.resume_from_path: the run directory (or its"
                          " latest checkpoint) to resume")
    return Translation(settings, _defaults_applied(values, settings, own), noted, own, layout, resume=resume,
                       resume_from=None if resume_from is None else str(resume_from))


def _defaults_applied(values: dict, settings: dict, own: dict) -> list[str]:
    """Return one line per verl default that decided a setting: neither its verl key nor the
    hybridlab setting it decides was given."""
    given = {*values, *([A + "optim.lr_warmup_steps"] if A + "optim.lr_warmup_steps_ratio" in values else [])}
    lines = [f"{key}={json.dumps(settings[key])}  " + (verl if verl.startswith("(") else f"(verl's default of {verl})")
             for key, (_, verl) in VERL_DEFAULTS.items() if verl not in given and key not in own]
    decided = {"trainer.total_epochs": "trainer.total_training_steps" not in values,
               A + "ppo_max_token_len_per_gpu": bool(settings["actor.micro_batch_tokens"]),
               "critic.ppo_max_token_len_per_gpu": bool(settings["critic.micro_batch_tokens"])}
    return lines + [f"{key}={json.dumps(value)}  (verl's default, for {what})"
                    for key, (value, what) in VERL_JOINT_DEFAULTS.items()
                    if key not in values and what not in own and decided.get(key, True)]


def _joint_settings(get, settings: dict, own: dict) -> dict[str, int]:
    """Set what several verl keys decide together (in place; ``own``, hybridlab's keys, are kept);
    returns the layouts they ask for. The checks that need no file come first, so a refused value
    is named before the rows are read."""
    if not settings.get("data.train_files"):
        raise ConfigError("data.train_files: a verl run reads its prompts from parquet or JSONL files; give them")
    if "trainer.devices" not in own:
        settings["trainer.devices"] = int(get("trainer.n_gpus_per_node")) * int(get("trainer.nnodes"))
    if settings["trainer.run_dir"] is None:
        settings["trainer.run_dir"] = f"checkpoints/{settings['trainer.project_name']}/{settings['name']}"
    for role, prefix in (("actor", A), ("critic", "critic.")):  # the critic's use_dynamic_bsz follows the actor's
        dynamic = get(prefix + "use_dynamic_bsz", get(A + "use_dynamic_bsz", False))
        settings[f"{role}.micro_batch_tokens"] = int(get(prefix + "ppo_max_token_len_per_gpu")) if dynamic else 0
    settings.setdefault("critic.ppo_mini_batch_size", settings["actor.ppo_mini_batch_size"])
    settings.setdefault("critic.loss_agg_mode", settings.get("actor.loss_agg_mode", "token-mean"))
    engine = get("model_engine")
    if engine is not None:
        settings["actor.strategy"] = settings["critic.strategy"] = "megatron" if engine == "megatron" else "fsdp2"
    critic_model = get("critic.model.path")
    if critic_model is not None and str(critic_model) != str(settings.get("model")):
        raise ConfigError(f"critic.model.path={critic_model!r} differs from actor_rollout_ref.model.path: hybridlab's"
                          " critic starts from the actor's model (with a value head)")
    _reward_settings(get, settings)
    if get(R + "val_kwargs.do_sample"):  # verl's default: greedy validation, whatever the temperature says
        settings["evaluation.temperature"] = float(get(R + "val_kwargs.temperature") or 0.0)
    layout = _layout(get, settings["trainer.devices"])
    if "trainer.steps" not in own:
        settings["trainer.steps"] = _steps(get, settings)
    settings["actor.warmup_steps"] = _warmup_steps(get, settings)
    return layout


def _steps(get, settings: dict) -> int:
    """Return trainer.total_training_steps, else total_epochs x (train rows // train_batch_size)."""
    steps = get("trainer.total_training_steps")
    if steps is not None:
        return int(steps)
    rows, batch = count_rows(settings["data.train_files"]), int(settings["data.prompts_per_step"])
    if rows < batch:
        raise ConfigError(f"data.train_batch_size={batch} is more than the {rows} rows of data.train_files: no"
                          " step fits in an epoch (verl's default is 1024; set data.train_batch_size)")
    return int(get("trainer.total_epochs")) * (rows // batch)


def _layout(get, devices: int) -> dict[str, int]:
    """Return the actor's tp, pp, ep and the rollout's tp; raises ConfigError naming a size that
    does not divide the devices."""
    layout = {"tp": get(A + "megatron.tensor_model_parallel_size") or 1,
              "pp": get(A + "megatron.pipeline_model_parallel_size") or 1,
              "ep": get(A + "megatron.expert_model_parallel_size") or 1,
              "rollout_tp": get(R + "tensor_model_parallel_size") or 1}
    layout = {k: int(v) for k, v in layout.items()}
    for key, size in ((R + "tensor_model_parallel_size", layout["rollout_tp"]),
                      (A + "megatron.tensor_model_parallel_size x pipeline_model_parallel_size",
                       layout["tp"] * layout["pp"])):
        if devices % size:
            raise ConfigError(f"{key} = {size} does not divide the {devices} devices of trainer.n_gpus_per_node x"
                              f" trainer.nnodes (verl's defaults: rollout tp 2 on 8 devices a node)")
    return layout


def _warmup_steps(get, settings: dict) -> int:
    """verl counts warm-up in training steps (its scheduler steps once per update); hybridlab in
    optimizer steps: a training step makes ppo_epochs x ceil(train_batch_size / mini-batch) of them."""
    steps = get(A + "optim.lr_warmup_steps", -1)
    if steps is None or steps < 0:
        steps = int(float(get(A + "optim.lr_warmup_steps_ratio", 0.0)) * settings["trainer.steps"])
    per_step = int(get(A + "ppo_epochs", 1)) * math.ceil(settings["data.prompts_per_step"]
                                                         / settings["actor.ppo_mini_batch_size"])
    return int(steps) * per_step


def _reward_settings(get, settings: dict) -> None:
    """Set the reward from verl 0.9's ``reward.*`` keys or the legacy ones they replace."""
    def either(new: str, legacy: str) -> Any:
        return get(f"reward.{new}") if get(f"reward.{new}") is not None else get(legacy)

    manager = either("reward_manager.name", "reward_model.reward_manager") or "naive"
    if manager not in MANAGERS:
        raise ConfigError(f"reward manager {manager!r} is refused: hybridlab scores as verl's {', '.join(MANAGERS)}"
                          " managers do (dapo: with algorithm.overlong_buffer from overlong_buffer_cfg)")
    if settings.get("algorithm.overlong_buffer.enable") and manager != "dapo":
        raise ConfigError(f"reward_model.reward_kwargs.overlong_buffer_cfg.enable=true with reward manager {manager!r}:"
                          " verl's dapo manager is the one that reads it; set reward_model.reward_manager=dapo")
    path = either("custom_reward_function.path", "custom_reward_function.path")
    if path:
        name = either("custom_reward_function.name", "custom_reward_function.name") or "compute_score"
        settings["reward.kind"], settings["reward.function"] = "function", f"{path}:{name}"
    if either("reward_model.enable", "reward_model.enable"):
        if path:
            raise ConfigError("reward_model.enable=true with a custom_reward_function: hybridlab scores with one of them")
        settings["reward.kind"] = "model"


def count_rows(files: Any) -> int:
    """Return the rows of the train files (parquet metadata, or non-blank JSONL lines); raises
    ConfigError naming a file that does not exist."""
    total = 0
    for name in [files] if isinstance(files, str) else list(files):
        path = Path(str(name)).expanduser()
        if not path.is_file():
            raise ConfigError(f"data.train_files: no such file {str(path)!r}")
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq  # only here: its import costs every command a second

            total += pq.ParquetFile(path).metadata.num_rows
        else:
            with open(path, encoding="utf-8") as f:
                total += sum(1 for line in f if line.strip())
    return total


def build_config(translation: Translation) -> RunConfig:
    """Return the unvalidated RunConfig of a translation (its layout applied by the caller)."""
    return config_with({}, translation.overrides())
