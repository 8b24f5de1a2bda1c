"""verl's main_ppo settings read as hybridlab's: every key of verl's examples covered, each
translated with its meaning and units, noted or refused by name before any work, verl's defaults
and placement, and docs/verl.md's table equal to the code's. Nothing here starts Ray."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hybridlab.cli import main
from hybridlab.config import ConfigError
from hybridlab.config.schema import EvaluationConfig
from hybridlab.run_config import load_config, load_run
from hybridlab.tasks.dataset import write_rows
from hybridlab.verl.keys import lookup, markdown_table
from hybridlab.verl.metrics import validation_metrics

ROOT = Path(__file__).resolve().parents[1]
AR = "actor_rollout_ref."
VALIDATION = json.loads((ROOT / "tests/verl_reference/validation.json").read_text())


@pytest.fixture(scope="module")
def gsm8k_files(tmp_path_factory) -> tuple[Path, Path]:
    """40 training rows and 8 validation rows in verl's GSM8K format."""
    root = tmp_path_factory.mktemp("gsm8k")
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}], "data_source": "openai/gsm8k",
             "reward_model": {"style": "rule", "ground_truth": str(2 * i)}} for i in range(40)]
    return write_rows(rows, root / "train.parquet"), write_rows(rows[:8], root / "test.parquet")


def settings(files, *more: str) -> list[str]:
    train, test = files
    return [f"data.train_files={train}", f"data.val_files={test}", f"{AR}model.path=tiny",
            f"{AR}rollout.name=vllm", "trainer.n_gpus_per_node=1", f"{AR}rollout.tensor_model_parallel_size=1",
            "trainer.logger=console", *more]


def test_every_key_of_verls_examples_has_a_treatment():
    keys = [line.strip() for line in (ROOT / "tests/verl_reference/example_keys.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    assert len(keys) == 136
    assert [k for k in keys if lookup(k) is None] == []


def test_docs_table_equals_the_code():
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    from verl_table import table_section

    assert table_section((ROOT / "docs" / "verl.md").read_text()) == markdown_table()


def test_sizes_translate_with_their_meaning_and_units(gsm8k_files):
    cfg, verl = load_run(None, settings(gsm8k_files, "data.train_batch_size=8", f"{AR}actor.ppo_mini_batch_size=4",
                                        f"{AR}rollout.n=5", f"{AR}actor.ppo_micro_batch_size_per_gpu=2",
                                        f"{AR}actor.use_dynamic_bsz=False", f"{AR}actor.ppo_max_token_len_per_gpu=3000",
                                        "data.max_response_length=16", "trainer.total_epochs=3"))
    assert (cfg.data.prompts_per_step, cfg.actor.ppo_mini_batch_size, cfg.rollout.n) == (8, 4, 5)
    assert cfg.actor.micro_batch_size == 2 and cfg.actor.micro_batch_tokens == 0  # by count: use_dynamic_bsz=false
    assert cfg.rollout.max_new_tokens == 16
    assert cfg.trainer.steps == 3 * (40 // 8)  # epochs x rows // train_batch_size
    from hybridlab.explain import explain

    # a mini-batch is ppo_mini_batch_size prompts x rollout.n sequences
    assert "8 prompts / 4 (actor.ppo_mini_batch_size) = 2 mini-batches" in explain(cfg).text()
    assert "each 4 x 5 = 20 sequences" in explain(cfg).text()
    dynamic = load_config(None, settings(gsm8k_files, f"{AR}actor.use_dynamic_bsz=True",
                                         f"{AR}actor.ppo_max_token_len_per_gpu=3000", "data.train_batch_size=8",
                                         f"{AR}actor.ppo_mini_batch_size=8"))
    assert dynamic.actor.micro_batch_tokens == 3000 and dynamic.critic.micro_batch_tokens == 32768
    assert verl.noted == {}  # every key above is translated: none is listed as changing nothing


def test_verls_defaults_apply_to_what_the_script_leaves_unset(gsm8k_files):
    cfg, verl = load_run(None, settings(gsm8k_files, f"{AR}actor.ppo_mini_batch_size=8", "data.train_batch_size=8"))
    assert (cfg.actor.lr, cfg.actor.weight_decay, cfg.actor.warmup_steps) == (1e-6, 0.01, 0)
    assert (cfg.algorithm.adv_estimator, cfg.rollout.n, cfg.rollout.max_new_tokens) == ("gae", 1, 512)
    assert (cfg.critic.lr, cfg.warm_start.max_steps, cfg.trainer.max_minutes) == (1e-5, 0, 0.0)
    assert cfg.actor.use_rollout_log_probs is False and cfg.trainer.verl_names is True
    assert cfg.trainer.steps == 30 * (40 // 8) and cfg.trainer.eval_every == 0 and cfg.trainer.save_every == 0
    assert cfg.trainer.run_dir == "checkpoints/verl_examples/gsm8k" and cfg.name == "gsm8k"
    assert cfg.data.train_samples == 0 and cfg.data.test_samples == 0  # every row
    lines = verl.defaults
    assert "actor.lr=1e-06  (verl's default of actor_rollout_ref.actor.optim.lr)" in lines
    assert 'algorithm.adv_estimator="gae"  (verl\'s default of algorithm.adv_estimator)' in lines
    assert not any(line.startswith("data.prompts_per_step=") for line in lines)  # the script set it


def test_explain_shows_the_defaults_and_the_ignored_line(gsm8k_files, capsys):
    assert main(["explain", *settings(gsm8k_files, "data.train_batch_size=8", f"{AR}actor.ppo_mini_batch_size=8",
                                      f"{AR}rollout.gpu_memory_utilization=0.6", f"{AR}rollout.enforce_eager=False",
                                      "algorithm.adv_estimator=grpo", f"{AR}rollout.n=4")]) == 0
    out = capsys.readouterr().out
    assert "Read as verl's main_ppo settings" in out
    assert ("ignored verl settings: actor_rollout_ref.rollout.gpu_memory_utilization (a vLLM engine setting for"
            " speed and memory") in out
    assert "actor_rollout_ref.rollout.enforce_eager (CUDA graphs on or off" in out
    assert "  actor.lr=1e-06  (verl's default of actor_rollout_ref.actor.optim.lr)" in out


def test_hydra_spellings_and_list_values(gsm8k_files):
    train, test = gsm8k_files
    cfg = load_config(None, [f"data.train_files=['{train}', '{test}']", f"+{AR}model.path=tiny",
                             f"++{AR}rollout.name=vllm", "trainer.n_gpus_per_node=1",
                             f"{AR}rollout.tensor_model_parallel_size=1", 'trainer.logger=["console","tensorboard"]',
                             "data.train_batch_size=8", f"{AR}actor.ppo_mini_batch_size=8", "trainer.total_epochs=1"])
    assert cfg.data.train_files == [str(train), str(test)] and cfg.trainer.logger == ["console", "tensorboard"]
    assert cfg.trainer.steps == (40 + 8) // 8  # both files' rows


def test_a_value_yaml_reads_as_a_date_stays_its_text(gsm8k_files):
    cfg = load_config(None, settings(gsm8k_files, "data.train_batch_size=8", f"{AR}actor.ppo_mini_batch_size=8",
                                     "trainer.experiment_name=2024-06-01"))
    assert cfg.name == "2024-06-01" and cfg.trainer.run_dir == "checkpoints/verl_examples/2024-06-01"


def test_placement_follows_verl_and_an_explicit_mapping_wins(gsm8k_files):
    base = settings(gsm8k_files, "data.train_batch_size=8", f"{AR}actor.ppo_mini_batch_size=8",
                    "trainer.n_gpus_per_node=2", "trainer.nnodes=2", f"{AR}rollout.tensor_model_parallel_size=2",
                    f"{AR}actor.megatron.tensor_model_parallel_size=2", "algorithm.adv_estimator=gae")
    cfg = load_config(None, base)
    assert cfg.trainer.devices == 4
    roles = cfg.mapping["roles"]
    assert {r: (roles[r]["tp"], roles[r]["dp"]) for r in ("actor", "critic", "rollout")} == \
        {"actor": (2, 2), "critic": (2, 2), "rollout": (2, 2)}
    assert {spec["colocate"] for spec in roles.values()} == {"engine"} and set(cfg.mapping["pools"]) == {"main"}
    mine = {"pools": {"main": {"devices": 4}}, "roles": {r: {"pool": "main", "dp": 4, "colocate": "engine"}
                                                          for r in ("actor", "rollout", "critic", "reward")}}
    assert load_config(None, [*base, f"mapping={json.dumps(mine)}"]).mapping == mine
    with pytest.raises(ConfigError, match=r"rollout.tensor_model_parallel_size = 2 does not divide the 1 devices"):
        load_config(None, settings(gsm8k_files, f"{AR}rollout.tensor_model_parallel_size=2"))


@pytest.mark.parametrize("pair, message", [
    (f"{AR}rollout.name=sglang", r"rollout.name='sglang' is refused: hybridlab's rollout engine is vLLM"),
    (f"{AR}actor.ulysses_sequence_parallel_size=2", r"ulysses_sequence_parallel_size=2 is refused: hybridlab has no"
                                                    r" Ulysses"),
    (f"{AR}model.path=Qwen/Qwen3-4B", r"'Qwen/Qwen3-4B' is not a local directory; hybridlab loads local checkpoints"),
    ("trainer.n_gpu_per_node=8", r"unknown verl key trainer.n_gpu_per_node: .*close: trainer.n_gpus_per_node"),
    ("critic.model.path=/elsewhere", r"critic.model.path='/elsewhere' differs from actor_rollout_ref.model.path"),
    ("reward_model.reward_manager=prime", r"reward manager 'prime' is refused"),
    ("trainer.resume_mode=resume_latest", r"resume_mode='resume_latest' is refused: verl's resume modes \(accepted: auto,"
                                          r" disable, resume_path\)"),
    ("reward_model.reward_kwargs.overlong_buffer_cfg.enable=True", r"verl's dapo manager is the one that reads it"),
])
def test_refused_values_and_unknown_keys_are_named_before_any_work(gsm8k_files, pair, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, settings(gsm8k_files, pair))


def test_critic_warmup_counts_as_verl_counts(gsm8k_files):
    common = ["data.train_batch_size=8", f"{AR}actor.ppo_mini_batch_size=8", "algorithm.adv_estimator=gae"]
    # verl skips the actor's update while critic_warmup > the step (counted from 1): 3 skips steps 1 and 2
    assert load_config(None, settings(gsm8k_files, *common, "trainer.critic_warmup=3")).trainer.critic_warmup == 2
    assert load_config(None, settings(gsm8k_files, *common, "trainer.critic_warmup=0")).trainer.critic_warmup == 0


def test_rollout_data_dir_is_taken_from_where_the_script_runs_as_verl_takes_it(gsm8k_files, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, settings(gsm8k_files, "data.train_batch_size=8", f"{AR}actor.ppo_mini_batch_size=8",
                                     "trainer.rollout_data_dir=./gens"))
    assert cfg.trainer.rollout_data_dir == str(tmp_path / "gens")


def test_warmup_counts_training_steps_as_optimizer_steps(gsm8k_files):
    # 8 prompts a step in mini-batches of 4, 2 epochs: 4 optimizer steps per training step
    common = ["data.train_batch_size=8", f"{AR}actor.ppo_mini_batch_size=4", f"{AR}actor.ppo_epochs=2",
              "trainer.total_training_steps=20"]
    assert load_config(None, settings(gsm8k_files, *common, f"{AR}actor.optim.lr_warmup_steps=3")) \
        .actor.warmup_steps == 12
    assert load_config(None, settings(gsm8k_files, *common, f"{AR}actor.optim.lr_warmup_steps_ratio=0.1")) \
        .actor.warmup_steps == 2 * 4


def test_a_custom_reward_function_is_called_by_keyword_with_its_kwargs(gsm8k_files, tmp_path):
    module = tmp_path / "verl_reward.py"
    module.write_text("async def my_score(*, data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):\n"
                      "    return {'score': float(solution_str == ground_truth) + bonus}\n")
    cfg = load_config(None, settings(gsm8k_files, "data.train_batch_size=8", f"{AR}actor.ppo_mini_batch_size=8",
                                     f"custom_reward_function.path={module}", "custom_reward_function.name=my_score",
                                     "+custom_reward_function.reward_kwargs={bonus: 0.5}"))
    assert (cfg.reward.kind, cfg.reward.function) == ("function", f"{module}:my_score")
    from hybridlab.workers.reward.scoring import load_function, score_one

    fn = load_function(cfg.reward.function, cfg.reward.function_kwargs)
    # (score, acc, the dict answer as verl records it)
    assert score_one(fn, "openai/gsm8k", "4", "4", None) == (1.5, None, {"score": 1.5})
    assert score_one(fn, "openai/gsm8k", "5", "4", None) == (0.5, None, {"score": 0.5})


def test_hybridlabs_own_keys_win_and_are_not_listed_as_verl_defaults(gsm8k_files):
    cfg, verl = load_run(None, settings(gsm8k_files, "data.train_batch_size=8", f"{AR}actor.ppo_mini_batch_size=8",
                                        "trainer.max_minutes=30", "trainer.steps=7",
                                        f"{AR}actor.optim.lr_warmup_steps_ratio=0.5"))
    assert cfg.trainer.max_minutes == 30 and cfg.trainer.steps == 7  # applied after the translation
    lines = verl.defaults
    assert not any(line.startswith(("trainer.max_minutes=", "actor.warmup_steps=", "trainer.total_epochs="))
                   for line in lines), lines
    assert verl.own == {"trainer.max_minutes": 30, "trainer.steps": 7}
    assert cfg.actor.warmup_steps == int(0.5 * 7) * 1  # the ratio of the run's own 7 steps, 1 update a step


def test_resuming_refuses_another_adapter_than_the_checkpoints(tmp_path):
    import yaml

    from hybridlab.errors import UserError
    from hybridlab.train_command import _same_adapter

    checkpoint = tmp_path / "run" / "checkpoints" / "step-000002"
    checkpoint.mkdir(parents=True)
    (checkpoint / "config.yaml").write_text(yaml.safe_dump(load_config(None, []).to_dict()))
    _same_adapter(load_config(None, []), checkpoint)  # the same adapter (none): resumes
    with pytest.raises(UserError, match=r"actor.lora.rank: the settings ask for 8, and the checkpoint in .*run holds an"
                                        r" adapter built with 0"):
        _same_adapter(load_config(None, ["actor.lora.rank=8", "actor.strategy=fsdp2"]), checkpoint)


def test_resume_path_resumes_the_latest_in_place_and_an_older_checkpoint_in_a_new_directory(gsm8k_files, tmp_path):
    from hybridlab.errors import UserError
    from hybridlab.train_command import _verl_resume

    run = tmp_path / "run"
    (run / "metrics.jsonl").parent.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n')
    (run / "warm_start").mkdir()
    (run / "warm_start" / "config.json").write_text("{}")
    (run / "warm_start.json").write_text("{}")
    for step, size in (("step-000002", 24), ("step-000003", 36)):
        (run / "checkpoints" / step / "actor").mkdir(parents=True)
        (run / "checkpoints" / step / "session.json").write_text(json.dumps({"metrics_bytes": size}))
        (run / "checkpoints" / step / "config.yaml").write_text("actor: {lora: {rank: 0}}\n")
        (run / "checkpoints" / step / "actor" / "model.safetensors").write_bytes(b"weights of " + step.encode())
    common = ["data.train_batch_size=8", f"{AR}actor.ppo_mini_batch_size=8", "trainer.resume_mode=resume_path"]
    with pytest.raises(ConfigError, match=r"resume_mode=resume_path needs trainer.resume_from_path"):
        load_run(None, settings(gsm8k_files, *common))

    def resumed(path, into=run) -> str | None:
        cfg, verl = load_run(None, settings(gsm8k_files, *common, f"trainer.resume_from_path={path}",
                                            f"trainer.default_local_dir={into}"))
        return _verl_resume(verl, cfg)

    older = run / "checkpoints" / "step-000002"
    assert resumed(run) == str(run) and resumed(run / "checkpoints" / "step-000003") == str(run)
    with pytest.raises(UserError, match=r"step-000002: its run has a newer checkpoint, step-000003, and"
                                        r" trainer.default_local_dir is that run"):
        resumed(older)
    # in a new directory: the checkpoint (hard-linked) and the logs up to it; the run stays as it was
    branch = tmp_path / "branch"
    assert resumed(older, into=branch) == str(branch)
    assert sorted(p.name for p in (branch / "checkpoints").iterdir()) == ["step-000002"]
    weights = branch / "checkpoints" / "step-000002" / "actor" / "model.safetensors"
    assert weights.read_bytes() == b"weights of step-000002"
    assert weights.stat().st_ino == (older / "actor" / "model.safetensors").stat().st_ino
    assert (branch / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
    assert (run / "metrics.jsonl").read_text().count("step") == 3 and len(list((run / "checkpoints").iterdir())) == 2
    assert (branch / "warm_start" / "config.json").read_text() == "{}" and (branch / "warm_start.json").is_file()
    with pytest.raises(UserError, match=r"branch is not empty: a run going on from .*step-000003 needs a new run"):
        resumed(run / "checkpoints" / "step-000003", into=branch)  # another checkpoint into it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["branch", "run"]  # nothing half-written left beside
    nested = tmp_path / "checkpoints" / "exp"  # a run directory inside a folder named checkpoints
    shutil.copytree(run, nested)
    assert resumed(nested, into=nested) == str(nested)
    assert resumed(older, into=branch) == str(branch)  # the same command again: on in the branch, not refused
    with pytest.raises(UserError, match=r"resume_from_path=.*elsewhere: no such checkpoint \(RUN/checkpoints/step-N\)"
                                        r" or run directory"):
        resumed(tmp_path / "elsewhere")
    with pytest.raises(UserError, match=r"resume_from_path=.*step-000009: no such checkpoint"):
        resumed(run / "checkpoints" / "step-000009")
    cfg, verl = load_run(None, settings(gsm8k_files, *common[:2], "trainer.resume_mode=disable",
                                        f"trainer.default_local_dir={run}"))
    assert _verl_resume(verl, cfg) is None  # disable: afresh, though run has checkpoints


def test_file_lists_and_every_row_are_checked_by_name(gsm8k_files):
    train, _ = gsm8k_files
    with pytest.raises(ConfigError, match=r"data.train_files: expected a file path or a list of them, got \{'a': 1\}"):
        load_config(None, ["warm_start.max_steps=0", "data.train_files={a: 1}"])
    with pytest.raises(ConfigError, match=r"data.test_files: no file '/nowhere.parquet'"):
        load_config(None, ["warm_start.max_steps=0", f"data.train_files=[{train}]", "data.test_files=/nowhere.parquet"])
    with pytest.raises(ConfigError, match=r"data.train_samples: 0 \(every row\) needs data.train_files"):
        load_config(None, ["data.train_samples=0"])
    assert load_config(None, ["trainer.max_minutes=0"]).trainer.max_minutes == 0  # no limit


def test_validation_sampling_translates_as_verl_samples(gsm8k_files):
    v, size = f"{AR}rollout.val_kwargs.", ("data.train_batch_size=8", f"{AR}actor.ppo_mini_batch_size=8")
    sampled = load_config(None, settings(gsm8k_files, *size, f"{v}do_sample=True", f"{v}temperature=0.6", f"{v}n=4",
                                         f"{v}top_p=0.95", f"{v}top_k=-1"))
    assert sampled.evaluation == EvaluationConfig(n=4, temperature=0.6, top_p=0.95, top_k=0)
    greedy = load_config(None, settings(gsm8k_files, *size, f"{v}do_sample=False", f"{v}temperature=1.0", f"{v}n=2"))
    assert greedy.evaluation == EvaluationConfig(n=2, temperature=0.0)  # verl decodes greedily without do_sample
    assert load_config(None, settings(gsm8k_files, *size)).evaluation == EvaluationConfig()  # one greedy answer
    with pytest.raises(ConfigError, match=r"evaluation.n: must be at least 1, got 0"):
        load_config(None, settings(gsm8k_files, *size, f"{v}n=0"))


def test_validation_metrics_equal_verls():
    """verl 0.9.1's own process_validation_metrics and _val_metrics_update on constructed answers
    (tests/verl_reference/make_validation.py): every entry, bit for bit, maj@N included."""
    for case in VALIDATION:
        infos, rows = case["infos"], range(len(case["sources"]))
        answers = [{k: values[i] for k, values in infos.items() if k != "reward"} for i in rows]
        assert validation_metrics(case["sources"], case["uids"], infos["reward"], answers) == case["metrics"]
    names = [name for case in VALIDATION for name in case["metrics"]]
    assert len(names) == 303 and "val-core/math_dapo/acc/maj@8/mean" in names and "val-aux/mine/format/best@4/std" in names


def test_verls_sandbox_fusion_settings_become_the_sandboxs(gsm8k_files):
    cfg, verl = load_run(None, settings(gsm8k_files, "data.train_batch_size=8", f"{AR}actor.ppo_mini_batch_size=8",
                                        "reward.sandbox_fusion.url=http://10.0.0.1:8080/run_code",
                                        "reward.sandbox_fusion.max_concurrent=8",
                                        "reward.sandbox_fusion.memory_limit_mb=1024"))
    assert (cfg.sandbox.parallel, cfg.sandbox.memory_mb) == (8, 1024)
    assert verl.noted == {"reward.sandbox_fusion.url": "code answers run in hybridlab's own sandbox (docs/sandbox.md)"}


def test_an_answer_whose_scoring_failed_leaves_its_prompts_dict_entries_out():
    right = {"score": 1.0, "acc": 1.0, "pred": "a"}
    out = validation_metrics(["s"] * 4, [0, 0, 1, 1], [1.0, 1.0, 1.0, -1.0], [right, right, right, {}])
    assert out["val-core/s/acc/mean@2"] == 1.0 and out["val-core/s/acc/maj@2/mean"] == 1.0  # the first prompt's
    assert out["val-aux/s/reward/mean@2"] == 0.5  # both prompts' rewards
