"""Config loading and validation: every mistake names its key before any worker starts."""
from __future__ import annotations

import subprocess
import sys

import pytest

from hybridlab.config import CONFIG_DIR, ConfigError, RunConfig
from hybridlab.dataflow.graph import Dataflow, DataflowError
from hybridlab.dataflow.prompts import PROMPT_FIELDS
from hybridlab.dataflow.defaults import dataflow_names, default_dataflow, roles_needed
from hybridlab.run_config import load_config

INVALID = "config is invalid:\n  - "  # before each problem of a config that loads but cannot run


def test_defaults_are_the_grpo_preset():
    default, preset = load_config(), load_config("grpo")
    assert default.algorithm.adv_estimator == "grpo" and default.model == "tiny" and default.data.task == "arith"
    assert preset.dataflow is None and preset.to_dict() == default.to_dict()
    assert dataflow_names(preset) == ["generate", "reward", "rollout_as_old_logprob", "advantages", "update_actor",
                                      "sync_weights"]


_ON_POLICY = ["generate", "reward", "rollout_as_old_logprob", "advantages", "update_actor", "sync_weights"]
PRESET_STAGES = {  # preset -> the stage list it resolves to (its `dataflow` key, or the default for its settings)
    "cispo": _ON_POLICY, "clip_cov": _ON_POLICY, "gmpo": _ON_POLICY, "gpg": _ON_POLICY, "grpo": _ON_POLICY,
    "gspo": _ON_POLICY, "kl_cov": _ON_POLICY, "sapo": _ON_POLICY, "rg_arithmetic": _ON_POLICY, "countdown_code": _ON_POLICY,
    "online_dpo": ["generate", "reward", "pair_best_worst", "ref_logprob", "update_actor_dpo", "sync_weights"],
    "agent_calc": ["generate_agent", "reward", "rollout_as_old_logprob", "advantages", "update_actor", "sync_weights"],
    "dpo": ["ref_logprob", "update_actor_dpo", "sync_weights"],
    "dapo": ["generate", "reward", "filter_groups", "old_logprob", "advantages", "update_actor", "sync_weights"],
    "ppo": ["generate", "reward", "old_logprob", "ref_logprob", "values", "kl_reward", "advantages", "update_critic",
            "update_actor", "sync_weights"],
    "reinforce_plus_plus": ["generate", "reward", "old_logprob", "ref_logprob", "kl_reward", "advantages",
                            "update_actor", "sync_weights"],
    "remax": ["generate", "reward", "remax_baseline", "old_logprob", "ref_logprob", "advantages", "update_actor",
              "sync_weights"],
    "rloo": ["generate", "reward", "old_logprob", "ref_logprob", "advantages", "update_actor", "sync_weights"],
}


def test_the_preset_table_lists_every_preset():
    assert sorted(PRESET_STAGES) == sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


@pytest.mark.parametrize("preset", sorted(PRESET_STAGES))
def test_every_preset_resolves_to_its_stages_and_a_written_dataflow_is_the_default(preset):
    cfg = load_config(preset)
    assert dataflow_names(cfg) == PRESET_STAGES[preset]
    assert default_dataflow(cfg) == PRESET_STAGES[preset]  # a written `dataflow` key only restates the default


def test_presets_cover_the_algorithms():
    names = {p.stem for p in CONFIG_DIR.glob("*.yaml")}
    assert {"ppo", "grpo", "rloo", "reinforce_plus_plus", "remax", "dapo"} <= names
    assert "critic" in roles_needed(dataflow_names(load_config("ppo")))
    assert "critic" not in roles_needed(dataflow_names(load_config("grpo")))


def test_overrides_parse_values_as_yaml():
    cfg = load_config(None, ["actor.lr=1e-4", "rollout.n=4", "trainer.off_policy=true", "data.task_options={digits: 3}"])
    assert cfg.actor.lr == 1e-4 and cfg.rollout.n == 4 and cfg.trainer.off_policy is True
    assert cfg.data.task_options == {"digits": 3}


@pytest.mark.parametrize("override, message", [
    (['actor.lrr=1'],
     'unknown key actor.lrr; allowed keys in actor: lr, weight_decay, grad_clip, warmup_steps, ppo_mini_batch_size, '
     'ppo_epochs, micro_batch_size, micro_batch_tokens, remove_padding, precision, strategy, fsdp, lora, '
     'policy_loss, tau_pos, tau_neg, clip_cov_ratio, clip_cov_lb, clip_cov_ub, kl_cov_ratio, ppo_kl_coef, dro_beta, '
     'clip_ratio, clip_ratio_low, clip_ratio_high, clip_ratio_c, loss_agg_mode, loss_scale_factor, entropy_coeff, '
     'use_rollout_log_probs, use_kl_loss, kl_loss_coef, kl_loss_type'),
    (['bogus=1'],
     'unknown key bogus; allowed keys in the config: name, model, warm_start, data, rollout, evaluation, algorithm, '
     'actor, critic, dpo, reward, sandbox, trainer, dataflow, mapping'),
    (['rollout.n=two'],
     "rollout.n: expected int, got 'two' (str)"),
    (['trainer.off_policy=3'],
     'trainer.off_policy: expected bool, got 3 (int)'),
    (['rollout.n=1'],
     INVALID + 'rollout.n: grpo compares samples within a group, so the group size must be at least 2, got 1'),
    (['data.prompts_per_step=30'],
     INVALID + 'actor.ppo_mini_batch_size: 16 prompts does not divide data.prompts_per_step (30)'),
    (['algorithm.adv_estimator=gpro'],
     INVALID + "algorithm.adv_estimator: 'gpro' is not one of gae, gdpo, gpg, grpo, grpo_passk, grpo_vectorized, "
               "opo, optimal_token_baseline, reinforce_plus_plus, reinforce_plus_plus_baseline, remax, rloo, "
               "rloo_vectorized, tir_optimal_token_baseline"),
    (['actor.loss_agg_mode=mean'],
     INVALID + "actor.loss_agg_mode: 'mean' is not one of token-mean, token-sum, seq-mean-token-sum, "
               "seq-mean-token-mean, seq-mean-token-sum-norm"),
    (['model=huge'],
     INVALID + "model: unknown zoo model 'huge'; a zoo name is a preset (tiny, small, mid), optionally with a family "
               "(-llama, -llama3, -qwen3, -mistral, -qwen3moe, -gemma3, -phi3; without one: qwen2), e.g. tiny-qwen3 "
               "(or give the path of a local Hugging Face checkpoint directory)"),
    (['reward.kind=function'],
     INVALID + "reward.function: reward.kind is 'function', so give an import path like mypkg.rewards:score"),
    (['data.task=sudoku'],
     INVALID + "data.task: unknown task 'sudoku'; choose one of: arith, calc, countdown, countdown_code, reasoning_gym, reverse"),
    (['trainer.streaming=true'],
     INVALID + "trainer.streaming: the rollout role shares the actor's processes (colocate 'engine'); give it processes"
               " of its own (another pool or colocate name): the engines generate while the actor trains"),
    (['trainer.streaming=true', 'trainer.off_policy=true', 'trainer.partial_rollouts=later', 'rollout.backend=hf',
      'trainer.stale_samples=wait', "mapping={pools: {a: {devices: 1}, r: {devices: 1}}, roles: {actor: {pool: a},"
      " rollout: {pool: r, colocate: g}, reward: {pool: r, colocate: g}}}", 'trainer.devices=2'],
     INVALID + "trainer.partial_rollouts: 'later' is not one of keep, recompute\n  - trainer.stale_samples: 'wait' is"
               " not one of train, drop\n  - trainer.streaming: needs rollout.backend=vllm, got 'hf'\n  -"
               " trainer.streaming: replaces trainer.off_policy; set trainer.off_policy=false"),
    (['trainer.off_policy=true',
      'dataflow=[generate, reward, rollout_as_old_logprob, ref_logprob, advantages, update_actor, sync_weights]'],
     INVALID + "dataflow[2] rollout_as_old_logprob: trainer.off_policy: off-policy samples come from older weights, "
               "so their rollout log-probs are not the current policy's; use the old_logprob stage instead of "
               "rollout_as_old_logprob (or leave `dataflow` unset: the stages then follow the settings)"),
    (['rollout.top_p=0.9',
      'dataflow=[generate, reward, rollout_as_old_logprob, advantages, update_actor, sync_weights]'],
     INVALID + "dataflow[2] rollout_as_old_logprob: rollout.top_p=0.9, rollout.top_k=0: the rollout's log-probs are "
               "of the truncated distribution, not the actor's; use the old_logprob stage instead of "
               "rollout_as_old_logprob (or leave `dataflow` unset: the stages then follow the settings)"),
    (['rollout.top_k=5',
      'dataflow=[generate, reward, rollout_as_old_logprob, advantages, update_actor, sync_weights]'],
     INVALID + "dataflow[2] rollout_as_old_logprob: rollout.top_p=1.0, rollout.top_k=5: the rollout's log-probs are "
               "of the truncated distribution, not the actor's; use the old_logprob stage instead of "
               "rollout_as_old_logprob (or leave `dataflow` unset: the stages then follow the settings)"),
    (['rollout.backend=hf',
      'mapping={pools: {main: {devices: 2}}, roles: {actor: {pool: main, dp: 2}, rollout: {pool: main, tp: 2}, '
      'reward: {pool: main, dp: 2}}}'],
     INVALID + "mapping.roles.rollout.tp: tp=2 needs rollout.backend=vllm (the 'hf' backend runs a whole model per "
               "device); use dp for replicas"),
    (['warm_start.target_accuracy=0'],
     INVALID + 'warm_start.target_accuracy: must be in (0, 1], got 0.0'),
    (['critic.micro_batch_tokens=-1'],
     INVALID + 'critic.micro_batch_tokens: must be at least 0, got -1'),
    (['trainer.max_staleness=0'],
     INVALID + 'trainer.max_staleness: must be at least 1, got 0'),
    (['reward.error_score=nan'],
     'reward.error_score: expected a number, got nan'),
    (['rollout.temperature=.nan'],
     'rollout.temperature: expected a number, got nan'),
    (['reward.timeout_s=inf'],
     INVALID + 'reward.timeout_s: must be 0 (no limit) or a finite positive number of seconds, got inf'),
    (['rollout.backend=hf', 'rollout.prefix_caching=true'],
     INVALID + 'rollout.prefix_caching: needs rollout.backend=vllm (the hf backend has no prefix cache)'),
    (['algorithm.rollout_correction.rollout_rs=seq_mean_k4', 'algorithm.rollout_correction.rollout_rs_threshold=1'],
     INVALID + "algorithm.rollout_correction.rollout_rs: rollout_rs 'seq_mean_k4': unknown option(s) "
               "['seq_mean_k4']; allowed: token_k1, token_k2, token_k3, seq_sum_k1, seq_sum_k2, seq_sum_k3, "
               "seq_mean_k1, seq_mean_k2, seq_mean_k3, seq_max_k2, seq_max_k3"),
    (['algorithm.rollout_correction.rollout_rs=token_k2'],
     INVALID + 'algorithm.rollout_correction.rollout_rs: rollout_rs_threshold is required when rollout_rs is set'),
    (['algorithm.rollout_correction.rollout_is=tokens'],
     INVALID + "algorithm.rollout_correction.rollout_is: 'tokens' is not one of token, sequence (or null: off)"),
    (['algorithm.rollout_correction.rollout_is=token', 'algorithm.rollout_correction.rollout_is_threshold=2.0_1.0'],
     INVALID + "algorithm.rollout_correction.rollout_is_threshold: rollout_is_threshold '2.0_1.0': bounds must be "
               "positive with lower <= upper"),
    (['algorithm.rollout_correction.bypass_mode=true', 'actor.policy_loss=gspo'],
     INVALID + "algorithm.rollout_correction.bypass_mode: bypass mode runs its own loss (ppo_clip or reinforce, by "
               "loss_type), so actor.policy_loss must be vanilla or bypass_mode, got 'gspo'"),
    (['actor.policy_loss=bypass_mode'],
     INVALID + "actor.policy_loss: bypass_mode needs algorithm.rollout_correction.bypass_mode=true (the rollout's "
               "log-probs stand in for the old ones)"),
    (['algorithm.rollout_correction.loss_type=ppo'],
     INVALID + "algorithm.rollout_correction.loss_type: 'ppo' is not one of ppo_clip, reinforce"),
    (['actor.policy_loss.loss_mode=gpso'],
     INVALID + "actor.policy_loss: 'gpso' is not one of bypass_mode, cispo, clip_cov, dppo_kl, dppo_tv, dro, "
               "geo_mean, gpg, gspo, kl_cov, sapo, vanilla"),
])
def test_bad_values_name_the_key_and_what_is_allowed(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, override)
    assert str(err.value) == message  # the whole message: the key, what is wrong and what is allowed



def test_a_config_object_with_a_nan_setting_is_refused_naming_it():
    from hybridlab.run_config import validate_config

    cfg = load_config(None, [])
    cfg.rollout.temperature = float("nan")  # built in Python, past the loader's check
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    assert str(err.value) == INVALID + "rollout.temperature: must be a number, got nan"


@pytest.mark.parametrize("override, old_stage", [
    ([], "rollout_as_old_logprob"),                     # on-policy, full distribution: exact
    (["actor.use_rollout_log_probs=false"], "old_logprob"),
    (["trainer.off_policy=true"], "old_logprob"),       # samples from older weights
    (["rollout.top_p=0.9"], "old_logprob"),             # log-probs of a truncated distribution
    (["rollout.top_k=5"], "old_logprob"),
    (["rollout.dtype=bfloat16"], "old_logprob"),        # log-probs of another precision
])
def test_rollout_log_probs_stand_in_for_old_ones_only_where_exact(override, old_stage):
    for source in (None, "grpo"):  # the default run and its preset follow the settings
        names = dataflow_names(load_config(source, override))
        assert old_stage in names and not {"old_logprob", "rollout_as_old_logprob"} - {old_stage} & set(names)


def test_rollout_correction_places_its_stage_as_verl_does():
    """Decoupled: the actor recomputes old log-probs and the correction runs after the KL
    penalty, before advantages, its weights reaching the actor's update. Bypass: the rollout's
    log-probs are the old ones (even off-policy) and the loss is bypass_mode."""
    from hybridlab.dataflow.stages import get_stage
    from hybridlab.dataflow.update_stages import actor_loss_settings

    cfg = load_config(None, ["algorithm.rollout_correction.rollout_is=token", "algorithm.use_kl_in_reward=true"])
    names = dataflow_names(cfg)
    assert names.index("old_logprob") < names.index("kl_reward") < names.index("rollout_correction") \
        < names.index("advantages") and "rollout_as_old_logprob" not in names
    assert "rollout_is_weights" in get_stage("update_actor").inputs(cfg)
    cfg = load_config(None, ["algorithm.rollout_correction.bypass_mode=true", "trainer.off_policy=true",
                             "algorithm.rollout_correction.rollout_rs=seq_mean_k1",
                             "algorithm.rollout_correction.rollout_rs_threshold=0.999_1.001"])
    names = dataflow_names(cfg)
    assert "rollout_as_old_logprob" in names and "rollout_correction" not in names and "old_logprob" not in names
    settings = actor_loss_settings(cfg)
    assert settings["policy_loss"] == "bypass_mode" and settings["rollout_correction"]["rollout_rs"] == "seq_mean_k1"
    cfg = load_config(None, ["algorithm.adv_estimator=optimal_token_baseline"])  # needs the actor's sum of p^2
    assert "old_logprob" in dataflow_names(cfg) and "sum_pi_squared" in get_stage("old_logprob").outputs(cfg)


def test_verl_style_policy_loss_sections_and_keys_are_accepted(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("actor:\n  policy_loss:\n    loss_mode: clip_cov\n    clip_cov_ratio: 0.01\n"
                    "    rollout_correction:\n      rollout_is: sequence\n      rollout_is_threshold: 3.0\n")
    cfg = load_config(str(path))
    assert (cfg.actor.policy_loss, cfg.actor.clip_cov_ratio) == ("clip_cov", 0.01)
    assert (cfg.algorithm.rollout_correction.rollout_is, cfg.algorithm.rollout_correction.rollout_is_threshold) \
        == ("sequence", 3.0)
    cfg = load_config(str(path), ["actor.policy_loss.loss_mode=gspo", "actor.policy_loss.kl_cov_ratio=0.5",
                                  "actor.policy_loss.rollout_correction.rollout_is=token"])
    assert (cfg.actor.policy_loss, cfg.actor.kl_cov_ratio, cfg.algorithm.rollout_correction.rollout_is) == \
        ("gspo", 0.5, "token")


def test_the_grpo_preset_gains_the_reference_pass_with_a_kl_loss():
    names = dataflow_names(load_config("grpo", ["actor.use_kl_loss=true"]))
    assert names.index("ref_logprob") < names.index("update_actor")


def test_batch_must_divide_over_data_parallel_ranks():
    with pytest.raises(ConfigError, match=r"actor.ppo_mini_batch_size: 1 prompts x rollout.n 3 = 3 sequences.*"
                                          r"data-parallel size 2"):
        load_config(None, ["trainer.devices=2", "rollout.n=3", "actor.ppo_mini_batch_size=1"])


def test_every_problem_is_listed_at_once():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["rollout.n=1", "trainer.steps=0", "rollout.top_p=2"])
    text = str(err.value)
    assert "rollout.n" in text and "trainer.steps" in text and "rollout.top_p" in text


def test_dataflow_missing_input_and_absent_role_are_named():
    cfg = load_config("rloo")  # KL loss on: update_actor needs ref_log_prob
    no_ref = ["generate", "reward", "old_logprob", "advantages", "update_actor", "sync_weights"]
    with pytest.raises(DataflowError) as err:
        Dataflow(no_ref).validate(cfg, ["actor", "rollout", "ref", "reward"], PROMPT_FIELDS)
    assert "update_actor: input 'ref_log_prob'" in str(err.value) and "ref_logprob" in str(err.value)
    ppo = load_config("ppo")
    with pytest.raises(DataflowError, match="values: runs on role 'critic', which the device mapping does not have"):
        Dataflow(ppo.dataflow).validate(ppo, ["actor", "rollout", "ref", "reward"], PROMPT_FIELDS)
    with pytest.raises(ConfigError) as err:
        load_config("ppo", ["mapping={pools: {main: {devices: 1}}, roles: {actor: {pool: main}}}"])
    assert str(err.value) == "config is invalid:\n" + "\n".join(
        f"  - dataflow[{i}] {stage}: runs on role '{role}', which the device mapping does not have (roles: actor)"
        for i, stage, role in [(0, "generate", "rollout"), (1, "reward", "reward"), (3, "ref_logprob", "ref"),
                               (4, "values", "critic"), (7, "update_critic", "critic"), (9, "sync_weights", "rollout")])


def test_stage_dependencies_let_independent_passes_overlap():
    cfg = load_config("ppo")
    flow = Dataflow(cfg.dataflow)
    deps = dict(zip(flow.names, flow.dependencies(cfg)))
    index = {n: i for i, n in enumerate(flow.names)}
    # old log-probs, reference log-probs and values need only the generated batch: they may run together
    for stage in ("old_logprob", "ref_logprob", "values"):
        assert deps[stage] == {index["generate"]}, (stage, deps[stage])
    assert index["update_actor"] in deps["sync_weights"]
    assert index["kl_reward"] in deps["advantages"] and index["values"] in deps["advantages"]


def test_cli_rejects_a_bad_config_before_starting_anything(tmp_path):
    run = subprocess.run([sys.executable, "-m", "hybridlab.cli", "train", "grpo", "actor.lrr=1",
                          f"trainer.run_dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "error: unknown key actor.lrr" in run.stderr and "Traceback" not in run.stderr
    assert not (tmp_path / "run").exists()


def test_run_config_round_trips_through_a_dict():
    cfg = load_config("ppo")
    from hybridlab.config import build

    assert build(RunConfig, cfg.to_dict()) == cfg


def test_a_config_object_is_validated_when_a_session_is_made():
    import dataclasses

    from hybridlab.dataflow.session import RLSession

    bad = dataclasses.replace(load_config(), rollout=dataclasses.replace(load_config().rollout, n=1))
    with pytest.raises(ConfigError, match="rollout.n"):
        RLSession(bad)


def test_parameter_counts_of_presets_and_checkpoints_agree(tiny_dir):
    from hybridlab.models.zoo import count_parameters

    assert count_parameters("tiny") == count_parameters(tiny_dir) > 500_000


def test_the_readme_zoo_table_matches_the_presets():
    """The model-zoo tables (docs/models.md): each preset's width, layers and heads, and each
    family's parameter counts (to the digits written), or the family whose counts it shares."""
    import re
    from pathlib import Path

    from hybridlab.models.zoo import ARCHS, PRESETS, count_parameters

    def close(written: str, name: str) -> bool:  # the count rounded to the decimals written, in millions
        return abs(count_parameters(name) / 1e6 - float(written)) <= 0.5 * 10 ** -len(written.partition(".")[2])

    text = (Path(__file__).resolve().parents[1] / "docs" / "models.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \| (\d+) x (\d+) \| (\d+) / (\d+) \|$", text, re.M)
    assert [r[0] for r in rows] == list(PRESETS)
    for name, hidden, layers, heads, kv_heads in rows:
        assert (int(hidden), int(layers), int(heads), int(kv_heads)) == tuple(
            getattr(PRESETS[name], k) for k in ("hidden", "layers", "heads", "kv_heads"))
    families = re.findall(r"^\| (none|`-(\w+)`) \|[^|]*\| (?:([\d.]+)M / ([\d.]+)M / ([\d.]+)M|as `-(\w+)`) \|$",
                          text, re.M)
    assert [f[1] or "qwen2" for f in families] == list(ARCHS)
    for _, arch, *counts, same_as in families:
        suffix = f"-{arch}" if arch else ""
        for preset, written in zip(PRESETS, counts):
            if same_as:
                assert count_parameters(f"{preset}{suffix}") == count_parameters(f"{preset}-{same_as}"), arch
            else:
                assert close(written, f"{preset}{suffix}"), (preset, arch, written)


def _in_declared_section(key: str, fields) -> bool:
    """True when a section above ``key`` declares how its changes apply (its fields follow it)."""
    declared = {k for k, f in fields if f.metadata.get("change", "step") != "step"}
    return any(key.startswith(section + ".") for section in declared)


def _another(value):
    """A value of the same kind that differs from ``value`` (a section: its first field changed)."""
    import dataclasses

    if dataclasses.is_dataclass(value):
        first = dataclasses.fields(value)[0].name
        return dataclasses.replace(value, **{first: _another(getattr(value, first))})
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value * 2 + 1
    return "mymodule:score" if value is None else f"{value}-x"


def _replaced(cfg, key: str, value):
    """``cfg`` with the dotted ``key`` set to ``value`` (sections copied, never changed)."""
    import dataclasses

    head, _, rest = key.partition(".")
    if not rest:
        return dataclasses.replace(cfg, **{head: value})
    return dataclasses.replace(cfg, **{head: _replaced(getattr(cfg, head), rest, value)})


def test_every_setting_is_declared_and_read_where_the_schema_says():
    """Each schema field says how a change applies (``setting``): a field the workers of a role
    take reaches their construction arguments (a changed value changes them); a field the
    controller reads is read somewhere in hybridlab; a fixed one says why."""
    import ast
    import functools
    from pathlib import Path

    from hybridlab.config.schema import config_fields
    from hybridlab.dataflow.roles import ROLE_SPECS

    package = Path(__file__).resolve().parents[1] / "hybridlab"
    names = set()  # attribute names and strings in hybridlab's code, outside the schema
    for path in package.rglob("*.py"):
        if path.name != "schema.py":
            for node in ast.walk(ast.parse(path.read_text())):
                names |= {node.attr} if isinstance(node, ast.Attribute) else \
                    {node.value} if isinstance(node, ast.Constant) and isinstance(node.value, str) else set()
    base, problems, fields = RunConfig(), [], config_fields()
    for key, f in fields:
        change, section = f.metadata.get("change", "step"), any(k.startswith(key + ".") for k, _ in fields)
        if change in ("live", "recreate"):
            value = functools.reduce(getattr, key.split("."), base)
            for role in f.metadata["workers"]:
                spec = ROLE_SPECS[role]
                if spec.settings(_replaced(base, key, _another(value))) == spec.settings(base):
                    problems.append(f"{key}: declared {change} for {role}, but {role}'s workers never get it")
        elif change == "fixed" and not f.metadata["why"]:
            problems.append(f"{key}: fixed without a reason")
        elif change == "step" and not section and f.name not in names and not _in_declared_section(key, fields):
            problems.append(f"{key}: read nowhere in hybridlab")
    assert problems == []
    # the check can fail: a worker setting its role does not take, a field nothing reads
    assert ROLE_SPECS["rollout"].settings(_replaced(base, "rollout.n", 99)) == ROLE_SPECS["rollout"].settings(base)
    assert "no_such_setting" not in names
